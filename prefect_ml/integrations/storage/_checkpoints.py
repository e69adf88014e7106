"""Atomic, verifiable checkpoints at any fsspec URL.

A checkpoint is a directory ``<root>/epoch-000007/`` holding data files and, written last,
``MANIFEST.json`` with the sha256 and size of every file. The manifest is the commit marker:
a reader trusts a checkpoint only if the manifest exists and every hash matches, so a crash
mid-write leaves an incomplete directory that readers skip, never a checkpoint that lies.

A checkpoint taken inside an epoch (after 120 optimiser steps of epoch 7) is
``<root>/epoch-000007-step-000120/``: it comes after epoch 6's end and before epoch 7's
(:class:`CheckpointPosition`). ``epochs()`` lists epoch ends only (they hold the epoch's
metrics); ``positions()`` and ``latest()`` see every checkpoint.

A :class:`RetentionPolicy` bounds storage: after each commit, checkpoints that are neither among
the last K (mid-epoch ones counted) nor the best are pruned. Pruning rewrites the manifest to
list only the small files the policy keeps (the epoch's metrics), then deletes the rest, so the
history stays verifiable while the weights go. A pruned mid-epoch checkpoint goes whole: it has
no history to keep. An epoch's end can also be committed with its metrics only (``save(...,
metrics_only=True)``: an epoch the training loop's checkpoint budget did not spend a commit of
its weights on); it reads like a pruned one, and ``latest()`` passes over it.

sha256 catches corruption, not forgery: whoever can write the storage can write a matching
manifest. With ``PREFECT_ML_CHECKPOINT_KEY`` set, every manifest carries an HMAC-SHA256 of its
content under that key, and a manifest without a valid one is refused before any file of its
checkpoint is read. The content names the run's folder and the position, so a signed manifest
copied to another run or another epoch (a rollback dressed as progress) is refused too.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from prefect_ml.integrations.errors import CheckpointError, ConfigurationError
from prefect_ml.integrations.settings import get_settings
from prefect_ml.integrations.storage import _files, _keys, _locations

MANIFEST = "MANIFEST.json"
SIGNATURE = "hmac_sha256"
_PREFIX = "epoch-"
_STEP = "-step-"
_WORKER_GROUP = "worker-group-"  # + the nanosecond it started + ".json"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetentionPolicy:
    """Which checkpoints keep their weights: the last ``keep_last`` and the best by ``metric``.

    ``metric`` is read from ``metrics_file`` inside each checkpoint; ``None`` keeps no best.
    Files named in ``kept_files`` survive pruning (they hold the epoch's history).
    """

    keep_last: int
    metric: str | None = None
    mode: str = "min"
    metrics_file: str = "metrics.json"
    kept_files: tuple[str, ...] = ("metrics.json",)

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise ValueError(
                "keep_last must be at least 1: the newest checkpoint is the resume point"
            )
        if self.mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', not {self.mode!r}")


@dataclass(frozen=True)
class CheckpointPosition:
    """Where in training a checkpoint was taken: the end of ``epoch``, or (``step`` set) after
    ``step`` optimiser steps of ``epoch``, before its end."""

    epoch: int
    step: int | None = None

    def sort_key(self) -> tuple[int, float]:
        """Training order: epoch 2's end, then epoch 3's steps, then epoch 3's end."""
        return (self.epoch, float("inf") if self.step is None else self.step)

    @property
    def name(self) -> str:
        """The checkpoint's directory name."""
        name = f"{_PREFIX}{self.epoch:06d}"
        return name if self.step is None else f"{name}{_STEP}{self.step:06d}"

    @classmethod
    def parse(cls, name: str) -> CheckpointPosition | None:
        """The position a directory name encodes; None for any other name."""
        if not name.startswith(_PREFIX):
            return None
        epoch, marker, step = name[len(_PREFIX) :].partition(_STEP)
        if not epoch.isdigit() or (marker and not step.isdigit()):
            return None
        return cls(int(epoch), int(step) if step else None)


class MetricsOnlyCheckpoint(CheckpointError):
    """The checkpoint holds an epoch's metrics but no weights (pruned, or committed so)."""


@dataclass(frozen=True)
class VerifiedCheckpoint:
    """A checkpoint whose manifest verified; ``files`` are the exact bytes that were hashed.

    ``step`` is set for a mid-epoch checkpoint (``epoch`` is then the epoch in progress)."""

    epoch: int
    url: str
    files: dict[str, bytes]
    step: int | None = None

    @property
    def position(self) -> CheckpointPosition:
        return CheckpointPosition(self.epoch, self.step)

    @property
    def completed_epochs(self) -> int:
        """Epochs fully trained when it was taken."""
        return self.epoch if self.step is None else self.epoch - 1


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _upload(url: str, files: dict[str, bytes]) -> dict[str, dict[str, Any]]:
    """Write ``files`` under ``url``; their manifest entries (sha256 and size), by name."""
    # Hashing runs beside the uploads (hashlib releases the interpreter lock).
    with ThreadPoolExecutor(1, thread_name_prefix="sha256") as hasher:
        digests = {name: hasher.submit(_sha256, data) for name, data in files.items()}
        for name, data in files.items():
            _files.write_bytes(_keys.join(url, name), data)
        return {n: {"sha256": digests[n].result(), "size": len(d)} for n, d in files.items()}


def manifest_signature(manifest: dict[str, Any], key: bytes) -> str:
    """HMAC-SHA256 of the manifest's content (every field but the signature), canonical JSON."""
    content = {k: v for k, v in manifest.items() if k != SIGNATURE}
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(key, canonical, hashlib.sha256).hexdigest()


def settings_key() -> bytes | None:
    """The manifest signing key of ``PREFECT_ML_CHECKPOINT_KEY``, if set."""
    secret = get_settings().checkpoint_key
    return secret.get_secret_value().encode() if secret else None


def _check_entries(url: str, manifest: dict[str, Any]) -> None:
    """Every file the manifest lists is a name inside its folder with a sha256 and a size: a
    manifest that is not is a broken checkpoint (readers skip it), never an error that stops
    the search for an earlier one."""
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise CheckpointError(f"{url}/{MANIFEST} lists no files")
    for name, entry in files.items():
        try:
            _keys.check_key(name)
        except ConfigurationError as exc:
            raise CheckpointError(f"{url}/{MANIFEST} lists {exc.message}") from None
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("sha256"), str)
            and isinstance(entry.get("size"), int)
        ):
            raise CheckpointError(f"{url}/{MANIFEST} has no sha256 and size for {name!r}")


class CheckpointStore:
    """Per-run checkpoint directory: ``save`` commits atomically, ``latest`` verifies on read.

    ``key`` signs and verifies manifests; by default the key of ``PREFECT_ML_CHECKPOINT_KEY``,
    and none (sha256 only) when that is unset.
    """

    def __init__(self, root_url: str, *, key: bytes | None = None) -> None:
        self.root_url = root_url.rstrip("/")
        # The folder every manifest names, written the same way whichever form of the URL a
        # process was given (``/x``, ``file:///x``).
        self._run = _locations.canonical_location(self.root_url)
        self._key = key if key is not None else settings_key()
        # Manifests and metric values this store has seen: committed manifests change only
        # through this store's own ``prune``, so each is read at most once per store.
        self._manifests: dict[CheckpointPosition, dict[str, Any]] = {}
        self._scores: dict[tuple[int, str], float | None] = {}

    def url_for(self, epoch: int, step: int | None = None) -> str:
        """The checkpoint of ``epoch``'s end, or of ``step`` steps into it."""
        return _keys.join(self.root_url, CheckpointPosition(epoch, step).name)

    def save(
        self,
        epoch: int,
        files: dict[str, bytes],
        *,
        step: int | None = None,
        metrics_only: bool = False,
    ) -> str:
        """Write ``files`` for ``epoch`` (``step`` steps into it, if given), then the manifest;
        return the checkpoint URL. ``metrics_only``: ``files`` are the epoch's history without
        weights, committed as a pruned checkpoint is (no resume point; a later ``save`` of the
        same epoch with its weights replaces it)."""
        if MANIFEST in files:
            raise ValueError(f"{MANIFEST} is reserved for the commit marker")
        if step is not None and step < 1:
            raise ValueError(f"a mid-epoch checkpoint comes after step 1 or later, not {step}")
        url = self.url_for(epoch, step)
        listed = _upload(url, files)
        position = {"epoch": epoch} if step is None else {"epoch": epoch, "step": step}
        manifest = {**position, "created_unix": time.time(), "files": listed}
        self._write_manifest(url, {**manifest, "pruned": True} if metrics_only else manifest)
        return url

    def upload(
        self, epoch: int, files: dict[str, bytes], *, step: int | None = None
    ) -> dict[str, dict[str, Any]]:
        """One writer's part of a checkpoint with several writers (a sharded one): write
        ``files`` into the checkpoint's directory without committing it, and return their
        manifest entries (sha256 and size) for :meth:`commit`.

        Each rank uploads its own files, in parallel with the others; until the one
        :meth:`commit` lists them they belong to no checkpoint.
        """
        if MANIFEST in files:
            raise ValueError(f"{MANIFEST} is reserved for the commit marker")
        return _upload(self.url_for(epoch, step), files)

    def commit(
        self,
        epoch: int,
        listings: list[dict[str, dict[str, Any]]],
        files: dict[str, bytes],
        *,
        step: int | None = None,
    ) -> str:
        """Commit a checkpoint that several writers uploaded (the second phase of a two-phase
        commit): check that every file of ``listings`` (one per writer, from :meth:`upload`)
        is in place with its size, write the committer's own ``files``, then the manifest
        naming them all; return the checkpoint URL.

        Raises:
            CheckpointError: a listed file is missing or has another size, or two writers
                listed the same name; nothing is committed.
        """
        if MANIFEST in files:
            raise ValueError(f"{MANIFEST} is reserved for the commit marker")
        url = self.url_for(epoch, step)
        listed: dict[str, dict[str, Any]] = {}
        for writer, listing in enumerate(listings):
            if clash := set(listing) & set(listed):
                raise CheckpointError(
                    f"writer {writer} of {url} listed {sorted(clash)}, which another writer "
                    "also wrote: not committing it"
                )
            listed.update(listing)
        present = _files.list_sizes(url)
        for name, entry in listed.items():
            if present.get(name) != entry["size"]:
                found = "missing" if name not in present else f"{present[name]} bytes"
                raise CheckpointError(
                    f"{url}/{name} is {found}, not the {entry['size']} bytes its writer "
                    "uploaded: not committing the checkpoint"
                )
        if clash := set(files) & set(listed):
            raise CheckpointError(f"{url}: {sorted(clash)} written by a writer and the committer")
        listed.update(_upload(url, files))
        # Shards of an attempt that died before its commit (another worker count) would stay
        # behind, named by no manifest, and outlive pruning.
        for name in set(present) - set(listed) - {MANIFEST}:
            _files.remove(_keys.join(url, name))
        position = {"epoch": epoch} if step is None else {"epoch": epoch, "step": step}
        manifest = {
            **position,
            "created_unix": time.time(),
            "files": listed,
            "layout": "sharded",
            "writers": len(listings),
        }
        self._write_manifest(url, manifest)
        return url

    def positions(self) -> list[CheckpointPosition]:
        """Every checkpoint directory (epoch ends and mid-epoch), verified or not, in training
        order."""
        found = [CheckpointPosition.parse(name) for name in _files.list_names(self.root_url)]
        return sorted((p for p in found if p is not None), key=CheckpointPosition.sort_key)

    def epochs(self) -> list[int]:
        """Epochs that have an end-of-epoch checkpoint directory, verified or not, ascending
        (mid-epoch checkpoints hold no metrics: see ``positions``)."""
        return [p.epoch for p in self.positions() if p.step is None]

    def record_worker_group(self, record: dict[str, str]) -> None:
        """What a worker group that just started is (its size, nodes, first epoch), named by
        when it started: the driver tags the run with the newest (:meth:`worker_groups`), so
        the workers themselves never talk to MLflow."""
        name = f"{_WORKER_GROUP}{time.time_ns():020d}.json"
        _files.write_bytes(_keys.join(self.root_url, name), json.dumps(record).encode())

    def worker_groups(self) -> list[str]:
        """The names of the worker groups' records (:meth:`record_worker_group`), oldest first."""
        names = _files.list_names(self.root_url)
        return [n for n in names if n.startswith(_WORKER_GROUP) and n.endswith(".json")]

    def read_worker_group(self, name: str) -> dict[str, str]:
        """One worker group's record, by its name from :meth:`worker_groups`."""
        record = json.loads(_files.read_bytes(_keys.join(self.root_url, name)))
        return {str(key): str(value) for key, value in record.items()}

    def _write_manifest(self, url: str, manifest: dict[str, Any]) -> None:
        manifest = {**manifest, "run": self._run}
        if self._key is not None:
            manifest = {**manifest, SIGNATURE: manifest_signature(manifest, self._key)}
        _files.write_bytes(_keys.join(url, MANIFEST), json.dumps(manifest, indent=1).encode())
        step = manifest.get("step")
        position = CheckpointPosition(int(manifest["epoch"]), None if step is None else int(step))
        self._manifests[position] = manifest

    def _manifest(self, position: CheckpointPosition) -> dict[str, Any]:
        url = self.url_for(position.epoch, position.step)
        try:
            manifest: dict[str, Any] = json.loads(_files.read_bytes(_keys.join(url, MANIFEST)))
        except FileNotFoundError as exc:
            raise CheckpointError(f"{url} has no {MANIFEST}: it was never committed") from exc
        except ValueError as exc:
            raise CheckpointError(f"{url}/{MANIFEST} is not valid JSON") from exc
        if not isinstance(manifest, dict):
            raise CheckpointError(f"{url}/{MANIFEST} is not a manifest")
        if self._key is not None:
            self._check_signature(url, manifest, self._key)
        self._check_place(url, manifest, position)
        _check_entries(url, manifest)
        return manifest

    def _check_place(
        self, url: str, manifest: dict[str, Any], position: CheckpointPosition
    ) -> None:
        """The manifest was written for this folder: its position, and with a key its run's
        (without one, anyone can rewrite the run's name: a run moved whole still resumes)."""
        written_at = (manifest.get("epoch"), manifest.get("step"))
        if written_at != (position.epoch, position.step):
            raise CheckpointError(
                f"{url}/{MANIFEST} was written for epoch {written_at[0]}, step {written_at[1]}: "
                "copied here from another checkpoint; refusing it"
            )
        run = manifest.get("run")
        if self._key is not None and run != self._run:
            raise CheckpointError(
                f"{url}/{MANIFEST} was written for {run or 'no named run'}, not {self._run}: "
                "copied from another run; refusing it"
            )

    @staticmethod
    def _check_signature(url: str, manifest: dict[str, Any], key: bytes) -> None:
        signature = manifest.get(SIGNATURE)
        if not isinstance(signature, str):
            raise CheckpointError(
                f"{url}/{MANIFEST} is not signed, and PREFECT_ML_CHECKPOINT_KEY is set: refusing "
                "it (a checkpoint written before the key was set starts its run over)"
            )
        if not hmac.compare_digest(signature, manifest_signature(manifest, key)):
            raise CheckpointError(
                f"{url}/{MANIFEST} does not match its HMAC signature: forged, altered, or signed "
                "with another PREFECT_ML_CHECKPOINT_KEY; refusing it"
            )

    def _verified_files(
        self, position: CheckpointPosition, names: list[str] | None
    ) -> dict[str, bytes]:
        """Files ``names`` of a committed checkpoint (all it lists when None, refused if it was
        pruned), read together and each verified against the manifest.

        When this store has the manifest already (it wrote or read it before), the files' names
        are known: the manifest is read again beside them, and must still be the one this store
        verified; if it was removed or replaced since, everything is read again as a new store
        would: the manifest first, its signature checked before any file is read.
        """
        url = self.url_for(position.epoch, position.step)
        cached = self._manifests.get(position)
        if cached is not None:
            try:
                listed = self._names(url, cached, names)
                (current, _sha256), *read = self._read(url, [MANIFEST, *listed])
                unchanged = json.loads(current) == cached
            except (CheckpointError, ValueError):
                unchanged = False
            if unchanged:
                return self._checked(url, cached, listed, read)
            self._manifests.pop(position, None)
        manifest = self._manifest(position)
        listed = self._names(url, manifest, names)
        files = self._checked(url, manifest, listed, self._read(url, listed))
        self._manifests[position] = manifest
        return files

    @staticmethod
    def _names(url: str, manifest: dict[str, Any], names: list[str] | None) -> list[str]:
        if names is None and manifest.get("pruned"):
            raise MetricsOnlyCheckpoint(f"{url} holds metrics only (pruned, or not committed)")
        listed = manifest.get("files", {})
        if unlisted := [name for name in names or () if name not in listed]:
            raise CheckpointError(f"{url} has no {unlisted[0]} in its manifest")
        return list(listed) if names is None else names

    @staticmethod
    def _read(url: str, names: list[str]) -> list[tuple[bytes, str]]:
        try:
            return _files.read_all_and_sha256([_keys.join(url, name) for name in names])
        except FileNotFoundError as exc:
            name = str(exc.filename).removeprefix(f"{url}/")
            raise CheckpointError(f"{url}/{name} is listed in the manifest but missing") from exc

    @staticmethod
    def _checked(
        url: str,
        manifest: dict[str, Any],
        names: list[str],
        read: list[tuple[bytes, str]],
    ) -> dict[str, bytes]:
        listed = manifest.get("files", {})
        for name, (data, sha256) in zip(names, read, strict=True):
            if len(data) != listed[name]["size"] or sha256 != listed[name]["sha256"]:
                raise CheckpointError(f"{url}/{name} does not match its sha256 in the manifest")
        return {name: data for name, (data, _sha256) in zip(names, read, strict=True)}

    def load(self, epoch: int, *, step: int | None = None) -> VerifiedCheckpoint:
        """Read and verify one checkpoint (``epoch``'s end, or ``step`` steps into it); raise
        :class:`CheckpointError` if it does not verify. Its files are read in parallel, each
        hashed while it downloads."""
        files = self._verified_files(CheckpointPosition(epoch, step), None)
        return VerifiedCheckpoint(epoch, self.url_for(epoch, step), files, step)

    def read_verified(self, epoch: int, name: str) -> bytes:
        """One file of a committed checkpoint, verified, without reading the others."""
        return self._verified_files(CheckpointPosition(epoch), [name])[name]

    def latest(self) -> VerifiedCheckpoint | None:
        """The newest checkpoint that verifies, mid-epoch ones included; broken ones are
        skipped with a warning, metrics-only ones without."""
        for position in reversed(self.positions()):
            try:
                return self.load(position.epoch, step=position.step)
            except MetricsOnlyCheckpoint:
                continue
            except CheckpointError as exc:
                logger.warning("Skipping checkpoint: %s; trying the previous one", exc)
        return None

    def _committed(self) -> dict[CheckpointPosition, dict[str, Any]]:
        """Manifests of the committed checkpoints, in training order (uncommitted ones are left
        alone)."""
        manifests = {}
        for position in self.positions():
            if position not in self._manifests:
                try:
                    self._manifests[position] = self._manifest(position)
                except CheckpointError:
                    continue
            manifests[position] = self._manifests[position]
        return manifests

    def _score(self, epoch: int, policy: RetentionPolicy) -> float | None:
        key = (epoch, policy.metrics_file)
        if key not in self._scores:
            try:
                metrics = json.loads(self.read_verified(epoch, policy.metrics_file))
                self._scores[key] = float(metrics[policy.metric])
            except (CheckpointError, KeyError, TypeError, ValueError):
                self._scores[key] = None
        return self._scores[key]

    def best_epoch(self, policy: RetentionPolicy) -> int | None:
        """The committed, unpruned epoch that is best by the policy's metric (newest on ties)."""
        if policy.metric is None:
            return None
        sign = 1 if policy.mode == "min" else -1
        scored = {
            position.epoch: score
            for position, manifest in self._committed().items()
            if position.step is None  # only an epoch's end has its metrics
            and not manifest.get("pruned")
            and (score := self._score(position.epoch, policy)) is not None
        }
        return min(scored, key=lambda e: (sign * scored[e], -e)) if scored else None

    def prune(
        self, policy: RetentionPolicy, *, also_keep: frozenset[int] = frozenset()
    ) -> list[int]:
        """Drop the weights of checkpoints the policy does not keep (nor the epochs in
        ``also_keep``, e.g. early stopping's best epoch); return the epochs whose weights went.

        ``keep_last`` counts mid-epoch checkpoints too, and only checkpoints with weights (a
        metrics-only epoch is no resume point). An epoch's end keeps its manifest,
        rewritten first (listing only ``kept_files``), then the other files are deleted, so a
        reader never finds a manifest that names a missing file. A mid-epoch checkpoint goes
        whole, its manifest first.
        """
        manifests = self._committed()
        best = self.best_epoch(policy)
        weighted = [position for position, found in manifests.items() if not found.get("pruned")]
        keep = set(weighted[-policy.keep_last :]) | {
            CheckpointPosition(epoch) for epoch in {best, *also_keep} if epoch is not None
        }
        pruned = []
        for position, manifest in manifests.items():
            if position in keep or manifest.get("pruned"):
                continue
            url = self.url_for(position.epoch, position.step)
            if position.step is not None:
                _files.remove(_keys.join(url, MANIFEST))
                _files.remove_folder(url)
                self._manifests.pop(position, None)
                continue
            epoch = position.epoch
            files = manifest.get("files", {})
            kept = {name: files[name] for name in policy.kept_files if name in files}
            self._write_manifest(url, {**manifest, "files": kept, "pruned": True})
            for name in set(files) - set(kept):
                _files.remove(_keys.join(url, name))
            pruned.append(epoch)
        return pruned
