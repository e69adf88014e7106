"""Canary rollouts on Ray Serve: a new version answers a share of the requests next to the
serving one, both are measured the same way, and a verdict promotes or rolls it back.

A named Ray actor per application, :class:`CanaryControl`, is the rollout's only shared state:
the driver puts the canary's version in it; every replica of the application syncs with it once
a second (:class:`CanaryRoute`), loads the canary next to its own model, sends it ``share`` of
its requests and reports what each version did. When the actor goes away (the rollout ended, or
its driver died) the replicas drop the canary and serve only their own version again.

A request the canary fails is answered by the serving version and counted against the canary,
so a canary that errors costs its share latency, never a failed request.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from prefect_ml.integrations.config.serving import CanaryPolicy

logger = logging.getLogger(__name__)

NAMESPACE = "prefect-ml"
SYNC_INTERVAL_S = 1.0
LATENCY_SAMPLE = 4096  # latencies kept per version and replica between syncs
LATENCY_SLACK_MS = 2.0  # p95s within this of each other are equal whatever their ratio


def control_name(app_name: str) -> str:
    return f"canary-{app_name}"


@dataclass
class VersionStats:
    """What one version did with its requests: additive across replicas and syncs."""

    requests: int = 0
    errors: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    labelled: int = 0
    correct: int = 0  # classification: rows whose label was the prediction
    squared_error: float = 0.0  # regression

    def add(self, other: VersionStats) -> None:
        self.requests += other.requests
        self.errors += other.errors
        self.latencies_ms.extend(other.latencies_ms)
        self.labelled += other.labelled
        self.correct += other.correct
        self.squared_error += other.squared_error

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    def latency_ms(self, quantile: float) -> float:
        return float(np.quantile(self.latencies_ms, quantile)) if self.latencies_ms else math.nan

    def metric(self, task: str) -> float | None:
        """Accuracy (classification) or RMSE (regression) on the labelled rows, if any."""
        if not self.labelled:
            return None
        if task == "regression":
            return math.sqrt(self.squared_error / self.labelled)
        return self.correct / self.labelled


@dataclass(frozen=True)
class Verdict:
    promote: bool
    reason: str


def metric_name(task: str) -> str:
    return "rmse" if task == "regression" else "accuracy"


def judge(
    stable: VersionStats,
    canary: VersionStats,
    policy: CanaryPolicy,
    task: str,
    *,
    window_over: bool,
) -> Verdict | None:
    """The verdict on the canary, or None to keep watching.

    Errors end the window early: once the canary has ``min_requests`` and errs more than allowed,
    waiting longer only fails more of its share. Latency and the metric are judged at the end.
    """
    increase = canary.error_rate - stable.error_rate
    if canary.requests >= policy.min_requests and increase > policy.max_error_increase:
        return Verdict(
            False,
            f"error rate {canary.error_rate:.1%} against {stable.error_rate:.1%} "
            f"(+{increase:.1%}; at most +{policy.max_error_increase:.1%})",
        )
    if not window_over:
        return None
    if canary.requests < policy.min_requests:
        return Verdict(
            False,
            f"only {canary.requests} canary request(s) in {policy.window_s:g} s, fewer than the "
            f"{policy.min_requests} needed to judge it",
        )
    reasons = [f"error rate {canary.error_rate:.1%} against {stable.error_rate:.1%}"]
    canary_p95, stable_p95 = canary.latency_ms(0.95), stable.latency_ms(0.95)
    if stable.requests and canary_p95 > policy.max_latency_ratio * stable_p95 + LATENCY_SLACK_MS:
        return Verdict(
            False,
            f"p95 latency {canary_p95:.1f} ms against {stable_p95:.1f} ms (more than "
            f"{policy.max_latency_ratio:g}x)",
        )
    reasons.append(f"p95 {canary_p95:.1f} ms against {stable_p95:.1f} ms")
    new, old = canary.metric(task), stable.metric(task)
    if new is not None and old is not None:
        name = metric_name(task)
        drop = (new - old) if task == "regression" else (old - new)
        if drop > policy.max_metric_drop:
            return Verdict(
                False,
                f"{name} {new:.4f} against {old:.4f} on labelled requests (worse by {drop:.4f}; "
                f"at most {policy.max_metric_drop:g})",
            )
        reasons.append(f"{name} {new:.4f} against {old:.4f}")
    return Verdict(True, "; ".join(reasons))


def label_outcome(predicted: np.ndarray, labels: list[Any], task: str) -> VersionStats:
    """How a request's predictions (class names, or values) compare with its labels."""
    if task == "regression":
        errors = predicted.astype(np.float64) - np.asarray(labels, dtype=np.float64)
        return VersionStats(labelled=len(labels), squared_error=float(np.square(errors).sum()))
    correct = sum(str(p) == str(label) for p, label in zip(predicted, labels, strict=True))
    return VersionStats(labelled=len(labels), correct=correct)


class CanaryControl:
    """The rollout's shared state (run as a named Ray actor): the canary version and share that
    replicas should serve, which replicas have it loaded, and the merged statistics."""

    def __init__(self, canary: dict[str, Any], share: float) -> None:
        self.canary: dict[str, Any] | None = canary
        self.share = share
        self.loaded: dict[str, str] = {}  # replica -> the canary version it has loaded
        self.failures: dict[str, str] = {}  # replica -> why the canary did not load there
        self.stats = {"stable": VersionStats(), "canary": VersionStats()}

    def sync(
        self,
        replica: str,
        loaded_version: str | None,
        failure: str | None,
        deltas: dict[str, VersionStats],
    ) -> dict[str, Any]:
        if loaded_version:
            self.loaded[replica] = loaded_version
        else:
            self.loaded.pop(replica, None)
        if failure:
            self.failures[replica] = failure
        for role, delta in deltas.items():
            self.stats[role].add(delta)
        return {"canary": self.canary, "share": self.share}

    def start_window(self) -> None:
        self.stats = {"stable": VersionStats(), "canary": VersionStats()}

    def snapshot(self) -> dict[str, Any]:
        return {"loaded": dict(self.loaded), "failures": dict(self.failures), **self.stats}

    def stop(self) -> None:
        self.canary = None


class CanaryRoute:
    """A replica's side of a rollout: the canary's predictor once loaded, the share of requests
    to give it, and the statistics to report. A daemon thread syncs with the application's
    :class:`CanaryControl`; while there is none, it does nothing but look once a second."""

    def __init__(self, app_name: str, replica: str, load: Callable[[dict[str, Any]], Any]) -> None:
        self._name, self._replica, self._load = control_name(app_name), replica, load
        self.predictor: Any = None
        self.served: dict[str, Any] | None = None
        self.share = 0.0
        self.active = False  # a rollout is under way: count the serving version too
        self._failure: str | None = None
        self._lock = threading.Lock()
        self._pending = {"stable": VersionStats(), "canary": VersionStats()}
        self._thread = threading.Thread(target=self._run, name="canary-sync", daemon=True)
        self._thread.start()

    def takes_request(self) -> bool:
        return self.predictor is not None and random.random() < self.share

    def record(self, role: str, outcome: VersionStats) -> None:
        if not self.active:
            return
        with self._lock:
            pending = self._pending[role]
            pending.add(outcome)
            del pending.latencies_ms[:-LATENCY_SAMPLE]

    def _run(self) -> None:
        import ray

        while True:
            time.sleep(SYNC_INTERVAL_S)
            try:
                control = ray.get_actor(self._name, namespace=NAMESPACE)
            except ValueError:
                self._drop()
                continue
            try:
                self._sync(ray, control)
            except Exception as exc:  # the actor went away meanwhile, or Ray is shutting down
                logger.debug("canary sync failed: %s", exc)
                self._drop()

    def _sync(self, ray: Any, control: Any) -> None:
        with self._lock:
            deltas = self._pending
            self._pending = {"stable": VersionStats(), "canary": VersionStats()}
        loaded = str(self.served["version"]) if self.served and self.predictor else None
        desired = ray.get(
            control.sync.remote(self._replica, loaded, self._failure, deltas), timeout=10
        )
        canary = desired["canary"]
        if canary is None:
            self._drop()
            return
        self.active = True
        if self.served is None or self.served["version"] != canary["version"]:
            self._drop_predictor()
            self.served = canary
            try:
                self.predictor = self._load(canary)
                self._failure = None
            except Exception as exc:
                self._failure = f"{type(exc).__name__}: {exc}"
        self.share = float(desired["share"])

    def _drop_predictor(self) -> None:
        self.share, self.predictor = 0.0, None

    def _drop(self) -> None:
        self._drop_predictor()
        self.served, self.active, self._failure = None, False, None


class Rollout:
    """The driver's handle on one application's canary: opens the control actor, waits until
    every replica has the canary loaded, measures, and closes it (the replicas then drop it)."""

    def __init__(self, app_name: str, canary: dict[str, Any], share: float) -> None:
        import ray

        from prefect_ml.integrations.errors import ConfigurationError

        name = control_name(app_name)
        try:
            ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            pass
        else:
            raise ConfigurationError(
                "serving.app_name",
                f"a canary rollout of {app_name!r} is already under way (Ray actor {name!r} in "
                f"namespace {NAMESPACE!r}); wait for it to end or serve another application",
            )
        # Owned by this driver: if it dies mid-rollout, the actor goes with it and the replicas
        # fall back to their own version.
        remote: Any = ray.remote(num_cpus=0)(CanaryControl)
        self._actor = remote.options(name=name, namespace=NAMESPACE).remote(canary, share)
        self.version = str(canary["version"])

    def _snapshot(self) -> dict[str, Any]:
        import ray

        return ray.get(self._actor.snapshot.remote(), timeout=30)  # type: ignore[no-any-return]

    def wait_loaded(self, replicas: Callable[[], int], timeout_s: float) -> None:
        """Return once every running replica has loaded the canary; raise DeploymentError
        with the replica's reason when one could not load it, or on the timeout."""
        from prefect_ml.integrations.errors import DeploymentError

        deadline = time.monotonic() + timeout_s
        while True:
            snapshot = self._snapshot()
            if snapshot["failures"]:
                reason = next(iter(snapshot["failures"].values()))
                raise DeploymentError(f"the canary v{self.version} did not load: {reason}")
            loaded = [v for v in snapshot["loaded"].values() if v == self.version]
            if loaded and len(loaded) >= replicas():
                return
            if time.monotonic() > deadline:
                raise DeploymentError(
                    f"the canary v{self.version} was loaded by {len(loaded)} of {replicas()} "
                    f"replica(s) after {timeout_s:g} s"
                )
            time.sleep(SYNC_INTERVAL_S / 2)

    def measure(
        self,
        policy: CanaryPolicy,
        task: str,
        progress: Callable[[float, VersionStats, VersionStats], None],
    ) -> tuple[Verdict, VersionStats, VersionStats]:
        """Count from now for the policy's window (less, when the canary fails early) and judge;
        ``progress`` sees (elapsed seconds, serving stats, canary stats) once a second."""
        import ray

        ray.get(self._actor.start_window.remote(), timeout=30)
        started = time.monotonic()
        while True:
            time.sleep(SYNC_INTERVAL_S)
            elapsed = time.monotonic() - started
            # One more sync after the window, so the replicas' last second is counted.
            window_over = elapsed >= policy.window_s + SYNC_INTERVAL_S
            snapshot = self._snapshot()
            stable, canary = snapshot["stable"], snapshot["canary"]
            progress(min(elapsed, policy.window_s), stable, canary)
            verdict = judge(stable, canary, policy, task, window_over=window_over)
            if verdict is not None:
                return verdict, stable, canary

    def close(self, timeout_s: float = 4 * SYNC_INTERVAL_S) -> None:
        """End the rollout and return once every replica has dropped the canary (a replica
        reports that at its next sync), so that nothing answers with it after a verdict; a
        replica that stopped syncing (it died) is waited for only ``timeout_s``."""
        import ray

        try:
            ray.get(self._actor.stop.remote(), timeout=30)
            deadline = time.monotonic() + timeout_s
            while self.version in self._snapshot()["loaded"].values():
                if time.monotonic() > deadline:
                    logger.warning(
                        "a replica still held the canary v%s %g s after the rollout ended",
                        self.version,
                        timeout_s,
                    )
                    break
                time.sleep(SYNC_INTERVAL_S / 4)
        finally:
            ray.kill(self._actor)
