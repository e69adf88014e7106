"""Atomic, verifiable checkpoints at any fsspec URL.

A checkpoint is a directory ``<root>/epoch-000007/`` holding data files and, written last,
``MANIFEST.json`` with the sha256 and size of every file. The manifest is the commit marker:
a reader trusts a checkpoint only if the manifest exists and every hash matches, so a crash
mid-write leaves an incomplete directory that readers skip, never a checkpoint that lies.

A :class:`RetentionPolicy` bounds storage: after each commit, checkpoints that are neither among
the last K nor the best are pruned. Pruning rewrites the manifest to list only the small files
the policy keeps (the epoch's metrics), then deletes the rest, so the history stays verifiable
while the weights go.

sha256 catches corruption, not forgery: whoever can write the storage can write a matching
manifest. With ``PREFECT_ML_CHECKPOINT_KEY`` set, every manifest carries an HMAC-SHA256 of its
content under that key, and a manifest without a valid one is refused before any file of its
checkpoint is read.
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

from prefect_ml.integrations import storage
from prefect_ml.integrations.errors import CheckpointError
from prefect_ml.integrations.settings import get_settings

MANIFEST = "MANIFEST.json"
SIGNATURE = "hmac_sha256"
_PREFIX = "epoch-"

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
class VerifiedCheckpoint:
    """A checkpoint whose manifest verified; ``files`` are the exact bytes that were hashed."""

    epoch: int
    url: str
    files: dict[str, bytes]


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def manifest_signature(manifest: dict[str, Any], key: bytes) -> str:
    """HMAC-SHA256 of the manifest's content (every field but the signature), canonical JSON."""
    content = {k: v for k, v in manifest.items() if k != SIGNATURE}
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(key, canonical, hashlib.sha256).hexdigest()


def settings_key() -> bytes | None:
    """The manifest signing key of ``PREFECT_ML_CHECKPOINT_KEY``, if set."""
    secret = get_settings().checkpoint_key
    return secret.get_secret_value().encode() if secret else None


class CheckpointStore:
    """Per-run checkpoint directory: ``save`` commits atomically, ``latest`` verifies on read.

    ``key`` signs and verifies manifests; by default the key of ``PREFECT_ML_CHECKPOINT_KEY``,
    and none (sha256 only) when that is unset.
    """

    def __init__(self, root_url: str, *, key: bytes | None = None) -> None:
        self.root_url = root_url.rstrip("/")
        self._key = key if key is not None else settings_key()
        # Manifests and metric values this store has seen: committed manifests change only
        # through this store's own ``prune``, so each is read at most once per store.
        self._manifests: dict[int, dict[str, Any]] = {}
        self._scores: dict[tuple[int, str], float | None] = {}

    def url_for(self, epoch: int) -> str:
        return storage.join(self.root_url, f"{_PREFIX}{epoch:06d}")

    def save(self, epoch: int, files: dict[str, bytes]) -> str:
        """Write ``files`` for ``epoch``, then the manifest; return the checkpoint URL."""
        if MANIFEST in files:
            raise ValueError(f"{MANIFEST} is reserved for the commit marker")
        url = self.url_for(epoch)
        # Hashing runs beside the uploads (hashlib releases the interpreter lock).
        with ThreadPoolExecutor(1, thread_name_prefix="sha256") as hasher:
            digests = {name: hasher.submit(_sha256, data) for name, data in files.items()}
            for name, data in files.items():
                storage.write_bytes(storage.join(url, name), data)
            listed = {n: {"sha256": digests[n].result(), "size": len(d)} for n, d in files.items()}
        self._write_manifest(url, {"epoch": epoch, "created_unix": time.time(), "files": listed})
        return url

    def epochs(self) -> list[int]:
        """Epochs that have a checkpoint directory, verified or not, ascending."""
        found = []
        for name in storage.list_names(self.root_url):
            if name.startswith(_PREFIX) and name[len(_PREFIX) :].isdigit():
                found.append(int(name[len(_PREFIX) :]))
        return sorted(found)

    def _write_manifest(self, url: str, manifest: dict[str, Any]) -> None:
        if self._key is not None:
            manifest = {**manifest, SIGNATURE: manifest_signature(manifest, self._key)}
        storage.write_bytes(storage.join(url, MANIFEST), json.dumps(manifest, indent=1).encode())
        self._manifests[int(manifest["epoch"])] = manifest

    def _manifest(self, url: str) -> dict[str, Any]:
        try:
            manifest: dict[str, Any] = json.loads(storage.read_bytes(storage.join(url, MANIFEST)))
        except FileNotFoundError as exc:
            raise CheckpointError(f"{url} has no {MANIFEST}: it was never committed") from exc
        except ValueError as exc:
            raise CheckpointError(f"{url}/{MANIFEST} is not valid JSON") from exc
        if self._key is not None:
            self._check_signature(url, manifest, self._key)
        return manifest

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

    @staticmethod
    def _verified_file(url: str, name: str, expected: dict[str, Any]) -> bytes:
        try:
            data, sha256 = storage.read_bytes_and_sha256(storage.join(url, name))
        except FileNotFoundError as exc:
            raise CheckpointError(f"{url}/{name} is listed in the manifest but missing") from exc
        if len(data) != expected["size"] or sha256 != expected["sha256"]:
            raise CheckpointError(f"{url}/{name} does not match its sha256 in the manifest")
        return data

    def load(self, epoch: int) -> VerifiedCheckpoint:
        """Read and verify one checkpoint; raise :class:`CheckpointError` if it does not verify."""
        url = self.url_for(epoch)
        manifest = self._manifest(url)
        if manifest.get("pruned"):
            raise CheckpointError(f"{url} was pruned by the retention policy (metrics only)")
        listed = manifest.get("files", {})
        files = {
            name: self._verified_file(url, name, expected) for name, expected in listed.items()
        }
        return VerifiedCheckpoint(epoch, url, files)

    def read_verified(self, epoch: int, name: str) -> bytes:
        """One file of a committed checkpoint, verified, without reading the others."""
        url = self.url_for(epoch)
        listed = self._manifest(url).get("files", {})
        if name not in listed:
            raise CheckpointError(f"{url} has no {name} in its manifest")
        return self._verified_file(url, name, listed[name])

    def latest(self) -> VerifiedCheckpoint | None:
        """The newest checkpoint that verifies; broken ones are skipped with a warning."""
        for epoch in reversed(self.epochs()):
            try:
                return self.load(epoch)
            except CheckpointError as exc:
                logger.warning("Skipping checkpoint: %s; trying the previous one", exc)
        return None

    def _committed(self) -> dict[int, dict[str, Any]]:
        """Manifests of the committed checkpoints, by epoch (uncommitted ones are left alone)."""
        manifests = {}
        for epoch in self.epochs():
            if epoch not in self._manifests:
                try:
                    self._manifests[epoch] = self._manifest(self.url_for(epoch))
                except CheckpointError:
                    continue
            manifests[epoch] = self._manifests[epoch]
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
            epoch: score
            for epoch, manifest in self._committed().items()
            if not manifest.get("pruned") and (score := self._score(epoch, policy)) is not None
        }
        return min(scored, key=lambda e: (sign * scored[e], -e)) if scored else None

    def prune(
        self, policy: RetentionPolicy, *, also_keep: frozenset[int] = frozenset()
    ) -> list[int]:
        """Drop the weights of checkpoints the policy does not keep (nor ``also_keep``, e.g.
        early stopping's best epoch); return their epochs.

        The manifest is rewritten first (listing only ``kept_files``), then the other files
        are deleted, so a reader never finds a manifest that names a missing file.
        """
        manifests = self._committed()
        keep = set(sorted(manifests)[-policy.keep_last :]) | {self.best_epoch(policy)} | also_keep
        pruned = []
        for epoch, manifest in manifests.items():
            if epoch in keep or manifest.get("pruned"):
                continue
            url = self.url_for(epoch)
            files = manifest.get("files", {})
            kept = {name: files[name] for name in policy.kept_files if name in files}
            self._write_manifest(url, {**manifest, "files": kept, "pruned": True})
            for name in set(files) - set(kept):
                storage.remove(storage.join(url, name))
            pruned.append(epoch)
        return pruned
