"""``torch.distributed.checkpoint`` (DCP) files in memory, loaded without unpickling code.

A checkpoint's files travel as bytes through :class:`integrations.storage.CheckpointStore`
(which verifies every file against its manifest); this module turns a state dict into those
files and back. DCP itself unpickles its ``.metadata`` file and ``torch.load``s non-tensor values
with ``weights_only=False``: here the metadata goes through an unpickler that admits only DCP's
own metadata classes, torch dtypes and paths, and values load with ``weights_only=True``, so a
tampered checkpoint cannot run code.

Two layouts (:func:`resolve_layout`): *gathered*, where rank 0 gathers the whole state and
writes every file, and *sharded*, where every rank writes its own part (:func:`commit_sharded`):
each rank uploads its ``.distcp`` files through the store, the listings are gathered to rank 0,
which checks them and commits DCP's ``.metadata`` with the manifest (a two-phase commit: no
manifest, no checkpoint). Both read back the same way, into any layout.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import pickle
import tempfile
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from prefect_ml.integrations.errors import CheckpointError
from prefect_ml.integrations.training import _collectives

if TYPE_CHECKING:
    import torch.distributed as dist

    from prefect_ml.integrations.storage import CheckpointStore

METADATA_FILE = ".metadata"
LAYOUTS = ("auto", "gathered", "sharded")
# Strategies whose ranks hold different parts of the state: gathering it would bound the model
# by one host and serialise every byte through rank 0.
_SHARDED_STRATEGIES = frozenset({"fsdp", "tp", "pp"})
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# Exact (module, name) pairs, compared before anything is looked up. Pickle protocol 4 resolves
# dotted names (``Metadata.__init__.__builtins__.get``), so admitting a module, or a name by its
# shape, admits everything reachable from it: builtins, module globals, ``os.system``.
_SAFE_GLOBALS = frozenset(
    {
        *(
            (_DCP_METADATA, name)
            for name in (
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "TensorProperties",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # maps a layout's name to torch's layout object
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib._local", "PosixPath"),
        ("pathlib._local", "WindowsPath"),
    }
)


@functools.cache
def _dtype_globals() -> frozenset[tuple[str, str]]:
    """``("torch", "float32")`` and the other dtypes, as the names ``torch`` gives them."""
    import torch

    return frozenset(
        ("torch", name) for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype)
    )


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the exact globals a DCP ``.metadata`` file refers to."""

    def find_class(self, module: str, name: str) -> Any:
        pair = (module, name)
        if pair not in _SAFE_GLOBALS and pair not in _dtype_globals():
            raise pickle.UnpicklingError(
                f"{module}.{name} is not allowed in a checkpoint's metadata; refusing to load it"
            )
        # Looked up by hand: pickle's own lookup would map old module names and walk dots.
        return getattr(importlib.import_module(module), name)


@functools.cache
def _safe_reader_classes() -> tuple[type[Any], type[Any]]:
    """A reader whose metadata load is restricted, and a planner that loads values as weights."""
    import io

    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
    from torch.distributed.checkpoint.planner import ReadItem

    class SafeReader(FileSystemReader):  # type: ignore[misc]
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            with open(os.path.join(self.path, METADATA_FILE), "rb") as handle:
                metadata = _MetadataUnpickler(handle).load()
            if not isinstance(metadata, Metadata):
                raise pickle.UnpicklingError(f"{METADATA_FILE} holds no DCP metadata")
            storage_meta = metadata.storage_meta or StorageMeta()
            storage_meta.load_id = self.load_id
            metadata.storage_meta = storage_meta
            return metadata

    class WeightsOnlyPlanner(DefaultLoadPlanner):  # type: ignore[misc]
        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element

                set_element(
                    self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded
                )
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return SafeReader, WeightsOnlyPlanner


@contextlib.contextmanager
def _single_process() -> Iterator[None]:
    """Silence DCP's warning that it runs in one process: ``no_dist`` is deliberate here (rank 0
    writes the gathered state; every reader loads its own part)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def _staging_writer(directory: str) -> Any:
    """DCP's writer into a temporary directory that is read back at once: without an fsync
    per file, which would only make the disk hold what is about to be deleted."""
    from torch.distributed.checkpoint import FileSystemWriter

    return FileSystemWriter(directory, sync_files=False)


def _read_directory(directory: str) -> dict[str, bytes]:
    files = {}
    for name in os.listdir(directory):
        with open(os.path.join(directory, name), "rb") as handle:
            files[name] = handle.read()
    return files


def to_files(state: dict[str, Any]) -> dict[str, bytes]:
    """``state`` (nested dicts of tensors and plain values) as the files of a DCP checkpoint."""
    import torch.distributed.checkpoint as dcp

    with tempfile.TemporaryDirectory(prefix="prefect-ml-dcp-") as directory, _single_process():
        dcp.save(state, storage_writer=_staging_writer(directory), no_dist=True)
        return _read_directory(directory)


def resolve_layout(requested: str, strategy: str, world_size: int) -> str:
    """``"sharded"`` or ``"gathered"``: how a worker group of ``world_size`` training with
    ``strategy`` writes its checkpoints, for ``requested`` (``training.checkpoint_layout``).

    ``auto`` shards under fsdp, tp and pp (each rank holds its own part of the state) and
    gathers under ddp (every rank holds all of it). One process always writes gathered: there
    is nothing to shard.
    """
    if requested not in LAYOUTS:
        raise ValueError(f"checkpoint layout must be one of {LAYOUTS}, not {requested!r}")
    if world_size <= 1:
        return "gathered"
    if requested == "auto":
        return "sharded" if strategy in _SHARDED_STRATEGIES else "gathered"
    return requested


def checkpoint_group() -> dist.ProcessGroup:
    """A gloo group of every worker for checkpoint coordination alone (a collective: every rank
    calls it, in the same order as its other groups).

    Sharded commits run in a background thread; on their own group, their collectives (DCP's
    planning, the gather of the listings) never interleave with training's, and gloo carries
    CPU objects beside an NCCL training group. It times out as the default group does.
    """
    import torch.distributed as dist

    return dist.new_group(backend="gloo", timeout=_default_group_timeout())


def _default_group_timeout() -> timedelta | None:
    """The default group's collective timeout (``init_process_group(timeout=...)``, Ray Train's
    ``TorchConfig.timeout_s``); None (torch's default) where the backend does not say."""
    import torch
    import torch.distributed as dist

    world = dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            timeout = world._get_backend(torch.device(device)).options._timeout  # type: ignore[union-attr]
        except (AttributeError, RuntimeError):
            continue
        if isinstance(timeout, timedelta):
            return timeout
    return None


@dataclass(frozen=True)
class ShardedSnapshot:
    """One rank's part of a sharded checkpoint, as taken while training waited.

    ``state`` is this rank's own CPU copy of its part (DTensor shards, or under pipeline
    parallelism its stage's tensors under the full model's names), so training carries on in
    the live tensors while :func:`commit_sharded` writes it. ``files`` are the small files the
    coordinator (rank 0 of ``group``) commits beside the shards; other ranks' are ignored.
    """

    state: dict[str, Any]
    files: dict[str, bytes]
    group: Any  # the checkpoint group (torch.distributed.ProcessGroup)

    @classmethod
    def take(
        cls, state: dict[str, Any], files: dict[str, bytes], group: dist.ProcessGroup
    ) -> ShardedSnapshot:
        """Copy ``state`` (live tensors, on any device) to CPU memory."""
        from torch.distributed.checkpoint.staging import BlockingAsyncStager

        return cls(BlockingAsyncStager().stage(state), files, group)


def shard_files(state: dict[str, Any], group: dist.ProcessGroup) -> dict[str, bytes]:
    """This rank's files of a DCP save of ``state`` over ``group`` (a collective on it): its own
    ``__<rank>_*.distcp`` files, and on the coordinator DCP's ``.metadata`` too.

    DCP's planner gives every stored tensor chunk to one rank: DTensor shards to their
    holders, a tensor every rank holds (DDP's) to one of them.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    with tempfile.TemporaryDirectory(prefix="prefect-ml-dcp-") as directory:
        try:
            dcp.save(state, storage_writer=_staging_writer(directory), process_group=group)
        except CheckpointException as exc:  # a BaseException, raised on every rank
            causes = "; ".join(str(error) for error, _trace in exc.failures.values())
            raise CheckpointError(f"the sharded save failed: {causes}") from None
        return _read_directory(directory)


def commit_sharded(
    store: CheckpointStore, epoch: int, snapshot: ShardedSnapshot, *, step: int | None = None
) -> str | None:
    """Write ``snapshot`` as this rank's part of checkpoint ``epoch`` (or ``step`` into it) and
    commit the whole; the checkpoint's URL on the coordinator, None on the other ranks.

    A collective on ``snapshot.group``: every rank calls it for the same checkpoint, one at a
    time. Phase one: each rank uploads its own shards through ``store`` (hashed, in parallel
    with the others). Phase two: the listings are gathered to the coordinator, which commits
    only if every rank uploaded and every listed file is in place, writing ``.metadata``, its
    small files and last the manifest. A rank that fails or dies before the gather leaves
    uploaded shards that no manifest names: no checkpoint.

    Raises:
        CheckpointError: this rank's upload failed, or (on the coordinator) another rank's did.
    """
    import torch.distributed as dist

    group = snapshot.group
    coordinator = dist.get_rank(group) == 0
    shards = shard_files(snapshot.state, group)
    # The .metadata makes the shards a loadable checkpoint: it goes in with the manifest,
    # once every rank's shards are known to be in place.
    metadata = {METADATA_FILE: shards.pop(METADATA_FILE)} if coordinator else {}
    listing: dict[str, dict[str, Any]] | str
    try:
        listing = store.upload(epoch, shards, step=step)
    except Exception as exc:  # told to the coordinator, then raised here
        listing = f"{type(exc).__name__}: {exc}"
    listings = _collectives.gather_to_first(listing, group)
    if isinstance(listing, str):
        raise CheckpointError(f"could not upload this rank's shards of epoch {epoch}: {listing}")
    if listings is None:
        return None
    failed = {rank: found for rank, found in enumerate(listings) if isinstance(found, str)}
    if failed:
        raise CheckpointError(
            f"ranks {sorted(failed)} could not upload their shards of epoch {epoch} "
            f"({'; '.join(failed.values())}): the checkpoint is not committed"
        )
    return store.commit(epoch, listings, {**metadata, **snapshot.files}, step=step)


def load_files(files: Mapping[str, bytes | bytearray], state: dict[str, Any]) -> None:
    """Load a DCP checkpoint's files into ``state`` in place, resharding to its layout.

    ``state`` is the template of the current layout (sharded DTensors under FSDP, plain tensors
    otherwise); each process reads only the parts of the stored tensors it holds. Files other
    than DCP's own are ignored.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader_class, planner_class = _safe_reader_classes()
    with tempfile.TemporaryDirectory(prefix="prefect-ml-dcp-") as directory, _single_process():
        for name, data in files.items():
            if name == METADATA_FILE or name.endswith(".distcp"):
                with open(os.path.join(directory, name), "wb") as handle:
                    handle.write(data)
        try:
            dcp.load(
                state,
                storage_reader=reader_class(directory),
                planner=planner_class(),
                no_dist=True,
            )
        except CheckpointException as exc:  # a BaseException: it would pass `except Exception`
            causes = "; ".join(str(error) for error, _trace in exc.failures.values())
            raise CheckpointError(f"the checkpoint's state did not load: {causes}") from None
