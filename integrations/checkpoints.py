"""Atomic, verifiable checkpoints at any fsspec URL.

A checkpoint is a directory ``<root>/epoch-000007/`` holding data files and, written last,
``MANIFEST.json`` with the sha256 and size of every file. The manifest is the commit marker:
a reader trusts a checkpoint only if the manifest exists and every hash matches, so a crash
mid-write leaves an incomplete directory that readers skip, never a checkpoint that lies.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from integrations import storage
from integrations.errors import CheckpointError

MANIFEST = "MANIFEST.json"
_PREFIX = "epoch-"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VerifiedCheckpoint:
    """A checkpoint whose manifest verified; ``files`` are the exact bytes that were hashed."""

    epoch: int
    url: str
    files: dict[str, bytes]


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class CheckpointStore:
    """Per-run checkpoint directory: ``save`` commits atomically, ``latest`` verifies on read."""

    def __init__(self, root_url: str) -> None:
        self.root_url = root_url.rstrip("/")

    def url_for(self, epoch: int) -> str:
        return storage.join(self.root_url, f"{_PREFIX}{epoch:06d}")

    def save(self, epoch: int, files: dict[str, bytes]) -> str:
        """Write ``files`` for ``epoch``, then the manifest; return the checkpoint URL."""
        if MANIFEST in files:
            raise ValueError(f"{MANIFEST} is reserved for the commit marker")
        url = self.url_for(epoch)
        for name, data in files.items():
            storage.write_bytes(storage.join(url, name), data)
        manifest = {
            "epoch": epoch,
            "created_unix": time.time(),
            "files": {n: {"sha256": _sha256(d), "size": len(d)} for n, d in files.items()},
        }
        storage.write_bytes(storage.join(url, MANIFEST), json.dumps(manifest, indent=1).encode())
        return url

    def epochs(self) -> list[int]:
        """Epochs that have a checkpoint directory, verified or not, ascending."""
        found = []
        for name in storage.list_names(self.root_url):
            if name.startswith(_PREFIX) and name[len(_PREFIX) :].isdigit():
                found.append(int(name[len(_PREFIX) :]))
        return sorted(found)

    def _manifest(self, url: str) -> dict[str, Any]:
        try:
            manifest: dict[str, Any] = json.loads(storage.read_bytes(storage.join(url, MANIFEST)))
        except FileNotFoundError as exc:
            raise CheckpointError(f"{url} has no {MANIFEST}: it was never committed") from exc
        except ValueError as exc:
            raise CheckpointError(f"{url}/{MANIFEST} is not valid JSON") from exc
        return manifest

    @staticmethod
    def _verified_file(url: str, name: str, expected: dict[str, Any]) -> bytes:
        try:
            data = storage.read_bytes(storage.join(url, name))
        except FileNotFoundError as exc:
            raise CheckpointError(f"{url}/{name} is listed in the manifest but missing") from exc
        if len(data) != expected["size"] or _sha256(data) != expected["sha256"]:
            raise CheckpointError(f"{url}/{name} does not match its sha256 in the manifest")
        return data

    def load(self, epoch: int) -> VerifiedCheckpoint:
        """Read and verify one checkpoint; raise :class:`CheckpointError` if it does not verify."""
        url = self.url_for(epoch)
        listed = self._manifest(url).get("files", {})
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
