"""``self.log`` and ``self.log_dict`` inside a model's hooks, kept as Lightning keeps them.

A ``LightningModule`` logs from its hooks; Lightning's trainer collects the values (its
``_ResultCollection``) and reduces them per epoch. prefect-ml runs the hooks without a Lightning
``Trainer``, so :func:`attach` puts a :class:`StepLog` in place of the model's ``log`` and
``log_dict`` (and, on a ``LightningModule``, a :class:`LoopState` as its trainer, which
``self.current_epoch``, ``self.global_step`` and ``self.trainer.*`` read). The semantics are
Lightning 2's (``lightning.pytorch.core.module.LightningModule.log``, ``_FxValidator``,
``_ResultMetric``):

* ``on_step``/``on_epoch`` default by hook: ``training_step`` logs on step, ``validation_step``,
  ``test_step`` and the epoch hooks on epoch; epoch hooks refuse ``on_step=True``; both False
  is refused.
* An epoch value reduces the epoch's calls by ``reduce_fx``: ``mean`` weighted by the batch
  size (the batch's rows, or ``batch_size=``), ``sum``, ``max``, ``min``. A step value is the
  latest call's. Logged on step and on epoch, a name becomes ``<name>_step`` (the latest step)
  and ``<name>_epoch``, and ``<name>`` is the epoch value, as Lightning's callback metrics hold.
* ``sync_dist=True`` reduces over every worker (the weighted mean of all their rows); without
  it the value is rank 0's own, as Lightning logs it. A ``torchmetrics.Metric`` is computed
  (its own sync) and reset at the epoch's end.

Values stay on the device until the epoch's end, so logging costs no host sync per step. Names
take the split of their hook as prefix unless they carry one already (``loss`` in
``validation_step`` is ``val_loss``; ``val_acc`` stays ``val_acc``), the convention of the
metrics ``validation_step`` returns. Only torch: it runs in Ray Train workers.
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prefect_ml.integrations.errors import ConfigurationError

if TYPE_CHECKING:
    import torch

# Lightning's _FxValidator: the hooks that may log, whether on_step is allowed there, and the
# split prefix their names take.
STEP_HOOKS = {"training_step": "train_", "validation_step": "val_", "test_step": "test_"}
EPOCH_HOOKS = {
    "on_train_epoch_start": "train_",
    "on_train_epoch_end": "train_",
    "on_validation_epoch_start": "val_",
    "on_validation_epoch_end": "val_",
    "on_test_epoch_start": "test_",
    "on_test_epoch_end": "test_",
}
SPLIT_PREFIXES = ("train_", "val_", "test_", "train/", "val/", "test/")
REDUCTIONS = {"mean", "sum", "max", "min"}


def metric_name(hook: str, name: str) -> str:
    """``name`` as prefect-ml records it: with its hook's split prefix unless it has one."""
    prefix = STEP_HOOKS.get(hook) or EPOCH_HOOKS.get(hook, "")
    return name if name.startswith(SPLIT_PREFIXES) else f"{prefix}{name}"


@dataclass
class Logged:
    """One logged name's accumulation over an epoch (``_ResultMetric``)."""

    hook: str
    name: str  # as recorded (with its prefix)
    on_step: bool
    on_epoch: bool
    reduce: str
    sync: bool
    prog_bar: bool
    total: Any = None  # float64 tensor on the device: the reduced epoch value (mean: weighted sum)
    weight: Any = None  # mean: the summed batch sizes
    last: Any = None  # the latest step's value
    metric: Any = None  # a torchmetrics.Metric logged as such

    def signature(self) -> tuple[bool, bool, str, bool, bool]:
        return (self.on_step, self.on_epoch, self.reduce, self.sync, self.prog_bar)

    def add(self, value: torch.Tensor, batch_size: int) -> None:
        self.last = value
        if not self.on_epoch:
            return
        if self.total is None:
            self.total = value * batch_size if self.reduce == "mean" else value
            self.weight = batch_size
        elif self.reduce == "mean":
            self.total = self.total + value * batch_size
            self.weight = self.weight + batch_size
        elif self.reduce == "sum":
            self.total = self.total + value
        else:
            pick = self.total.maximum if self.reduce == "max" else self.total.minimum
            self.total = pick(value)

    def payload(self) -> dict[str, Any]:
        """What this worker sends at the epoch's end: plain numbers (one host sync)."""
        if self.metric is not None:  # torchmetrics syncs itself; every rank holds the result
            value = float(self.metric.compute())
            self.metric.reset()
            return {**self._meta(), "total": value, "weight": 1.0, "last": value, "synced": True}
        return {
            **self._meta(),
            "total": None if self.total is None else float(self.total),
            "weight": float(self.weight or 0),
            "last": None if self.last is None else float(self.last),
            "synced": False,
        }

    def _meta(self) -> dict[str, Any]:
        return {
            "on_step": self.on_step,
            "on_epoch": self.on_epoch,
            "reduce": self.reduce,
            "sync": self.sync,
            "prog_bar": self.prog_bar,
        }


@dataclass
class StepLog:
    """What a model logged through ``self.log``/``self.log_dict`` since the last :meth:`take`.

    The loop says which hook runs and on how many rows (:meth:`hook`); :meth:`take` hands
    over the epoch's values as plain numbers for :func:`combine`.
    """

    device: Any = None
    _hook: str | None = None
    _batch_size: int = 1
    _logged: dict[str, Logged] = field(default_factory=dict)
    prog_bar: set[str] = field(default_factory=set)  # recorded names shown in the progress line

    @contextlib.contextmanager
    def hook(self, name: str, batch_size: int = 1) -> Iterator[None]:
        """Logging inside ``name`` (a hook), on a batch of ``batch_size`` rows."""
        previous = self._hook, self._batch_size
        self._hook, self._batch_size = name, batch_size
        try:
            yield
        finally:
            self._hook, self._batch_size = previous

    def enter(self, hook: str | None, batch_size: int = 1) -> None:
        """Log into ``hook`` from now on (None: outside the hooks), on batches of
        ``batch_size`` rows; what :meth:`hook` does, without a context per training step."""
        self._hook, self._batch_size = hook, batch_size

    @property
    def logged_any(self) -> bool:
        return bool(self._logged)

    def names(self) -> list[str]:
        """The names recorded so far (an epoch value's own name, not its forks)."""
        return [entry.name for entry in self._logged.values()]

    def discard(self) -> None:
        """Forget everything logged (a probe's values), resetting logged torchmetrics."""
        for entry in self._logged.values():
            if entry.metric is not None:
                entry.metric.reset()
        self._logged.clear()

    def log(
        self,
        name: str,
        value: Any,
        prog_bar: bool = False,
        logger: bool | None = None,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        reduce_fx: Any = "mean",
        enable_graph: bool = False,
        sync_dist: bool = False,
        sync_dist_group: Any = None,
        add_dataloader_idx: bool = True,
        batch_size: int | None = None,
        metric_attribute: str | None = None,
        rank_zero_only: bool = False,
    ) -> None:
        """``LightningModule.log``: record ``value`` under ``name`` in the running hook."""
        hook = self._hook
        if hook is None:  # outside the loop's hooks (a forward called for serving): nothing
            return
        on_step, on_epoch = _levels(hook, name, on_step, on_epoch)
        reduce = _reduction(reduce_fx, hook, name)
        tensor = None if _is_torchmetric(value) else self._tensor(value, hook, name)
        recorded = metric_name(hook, name)
        key = f"{hook}.{name}"
        entry = Logged(hook, recorded, on_step, on_epoch, reduce, sync_dist, prog_bar)
        existing = self._logged.get(key)
        if existing is None:
            self._logged[key] = existing = entry
            if prog_bar:  # Lightning's progress bar shows the forked names
                forked = on_step and on_epoch
                self.prog_bar.update(
                    [f"{recorded}_step", f"{recorded}_epoch"] if forked else [recorded]
                )
        elif existing.signature() != entry.signature():
            raise ConfigurationError(
                f"model.{hook}",
                f"self.log({name!r}, ...) was called twice in {hook} with different arguments; "
                "Lightning does not allow this either: log it with the same arguments each time",
            )
        if tensor is None:
            existing.metric = value
            return
        mean_weight = batch_size if batch_size is not None else self._batch_size
        existing.add(tensor, mean_weight if on_epoch and reduce == "mean" else 1)

    def log_dict(
        self,
        dictionary: Mapping[str, Any],
        prog_bar: bool = False,
        logger: bool | None = None,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        reduce_fx: Any = "mean",
        enable_graph: bool = False,
        sync_dist: bool = False,
        sync_dist_group: Any = None,
        add_dataloader_idx: bool = True,
        batch_size: int | None = None,
        rank_zero_only: bool = False,
    ) -> None:
        """``LightningModule.log_dict``: :meth:`log` for each item."""
        for name, value in dictionary.items():
            self.log(
                name,
                value,
                prog_bar=prog_bar,
                on_step=on_step,
                on_epoch=on_epoch,
                reduce_fx=reduce_fx,
                sync_dist=sync_dist,
                batch_size=batch_size,
            )

    def _tensor(self, value: Any, hook: str, name: str) -> torch.Tensor:
        import torch

        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ConfigurationError(
                    f"model.{hook}",
                    f"self.log({name!r}, ...) got a tensor of shape {list(value.shape)}; log "
                    "one number per name (a scalar tensor), e.g. its .mean()",
                )
            return value.detach().reshape(()).to(torch.float64)
        if isinstance(value, numbers.Number) and not isinstance(value, bool | complex):
            return torch.tensor(float(value), dtype=torch.float64, device=self.device)  # type: ignore[arg-type]
        raise ConfigurationError(
            f"model.{hook}",
            f"self.log({name!r}, ...) got {type(value).__name__}; log a number, a scalar "
            "tensor or a torchmetrics.Metric (one self.log per name, or self.log_dict)",
        )

    def take(self, hooks: tuple[str, ...] | None = None) -> dict[str, dict[str, Any]]:
        """The values logged in ``hooks`` (all by default) as this worker's payload for
        :func:`combine`, keyed by recorded name, and forget them."""
        taken = {k: v for k, v in self._logged.items() if hooks is None or v.hook in hooks}
        for key in taken:
            del self._logged[key]
        return {entry.name: entry.payload() for entry in taken.values()}


def _levels(hook: str, name: str, on_step: bool | None, on_epoch: bool | None) -> tuple[bool, bool]:
    """``_FxValidator.check_logging_and_get_default_levels``."""
    if hook in STEP_HOOKS:
        default_step = hook == "training_step"
        step = default_step if on_step is None else on_step
        epoch = (not default_step) if on_epoch is None else on_epoch
    elif hook in EPOCH_HOOKS:
        if on_step:
            raise ConfigurationError(
                f"model.{hook}",
                f"self.log({name!r}, on_step=True) in {hook}: an epoch hook logs per epoch "
                "only (as in Lightning); drop on_step",
            )
        step, epoch = False, True if on_epoch is None else on_epoch
    else:
        raise ConfigurationError(
            f"model.{hook}", f"self.log({name!r}, ...) in {hook}: Lightning allows no logging there"
        )
    if not (step or epoch):
        raise ConfigurationError(
            f"model.{hook}",
            f"self.log({name!r}, on_step=False, on_epoch=False) logs nothing; set one of them",
        )
    return step, epoch


def _reduction(reduce_fx: Any, hook: str, name: str) -> str:
    """``_Metadata._parse_reduce_fx``: "mean" ("avg"), "sum", "max", "min" or those torch
    functions."""
    text = reduce_fx.lower() if isinstance(reduce_fx, str) else getattr(reduce_fx, "__name__", "")
    text = "mean" if text == "avg" else text
    if text not in REDUCTIONS or not (isinstance(reduce_fx, str) or _is_torch_reduction(reduce_fx)):
        raise ConfigurationError(
            f"model.{hook}",
            f"self.log({name!r}, ..., reduce_fx={reduce_fx!r}): only mean, sum, max and min "
            "reduce an epoch (as in Lightning); log a torchmetrics.Metric for another reduction",
        )
    return text


def _is_torch_reduction(function: Any) -> bool:
    import torch

    return function in (torch.mean, torch.sum, torch.max, torch.min, sum, max, min)


def _is_torchmetric(value: Any) -> bool:
    try:
        from torchmetrics import Metric
    except ImportError:  # torchmetrics comes with lightning; without it no value is one
        return False
    return isinstance(value, Metric)


def combine(payloads: list[dict[str, dict[str, Any]]]) -> dict[str, float]:
    """Every worker's payload (:meth:`StepLog.take`, rank order) as the epoch's metrics: synced
    values reduced over the workers that logged them, the others rank 0's (else the first
    worker's that logged them)."""
    names = sorted({name for payload in payloads for name in payload})
    metrics: dict[str, float] = {}
    for name in names:
        values = [payload[name] for payload in payloads if name in payload]
        first = values[0]
        if not (first["sync"] and not first["synced"]):
            values = values[:1]
        epoch = _reduce_epoch(values) if first["on_epoch"] else None
        step = _reduce_step(values) if first["on_step"] else None
        if first["on_step"] and first["on_epoch"]:
            metrics.update({name: epoch, f"{name}_step": step, f"{name}_epoch": epoch})  # type: ignore[dict-item]
        else:
            metrics[name] = epoch if first["on_epoch"] else step  # type: ignore[assignment]
    return {name: value for name, value in metrics.items() if value is not None}


def _reduce_epoch(values: list[dict[str, Any]]) -> float | None:
    totals = [v["total"] for v in values if v["total"] is not None]
    if not totals:
        return None
    reduce = values[0]["reduce"]
    if reduce == "mean":
        weight = sum(v["weight"] for v in values if v["total"] is not None)
        return sum(totals) / weight if weight else None
    if reduce == "sum":
        return float(sum(totals))
    return float(max(totals) if reduce == "max" else min(totals))


def _reduce_step(values: list[dict[str, Any]]) -> float | None:
    lasts = [v["last"] for v in values if v["last"] is not None]
    if not lasts:
        return None
    reduce = values[0]["reduce"]
    if reduce == "sum":
        return float(sum(lasts))
    if reduce in ("max", "min"):
        return float(max(lasts) if reduce == "max" else min(lasts))
    return sum(lasts) / len(lasts)  # Lightning's step sync is a plain mean over the ranks
