"""``torch.distributed.checkpoint`` (DCP) files in memory, loaded without unpickling code.

A checkpoint's files travel as bytes through :class:`integrations.checkpoints.CheckpointStore`
(which verifies every file against its manifest); this module turns a state dict into those
files and back. DCP itself unpickles its ``.metadata`` file and ``torch.load``s non-tensor values
with ``weights_only=False``: here the metadata goes through an unpickler that admits only DCP's
own metadata classes, torch dtypes and paths, and values load with ``weights_only=True``, so a
tampered checkpoint cannot run code.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import pickle
import tempfile
import warnings
from collections.abc import Iterator
from typing import Any

from prefect_ml.integrations.errors import CheckpointError

METADATA_FILE = ".metadata"
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


def to_files(state: dict[str, Any]) -> dict[str, bytes]:
    """``state`` (nested dicts of tensors and plain values) as the files of a DCP checkpoint."""
    import torch.distributed.checkpoint as dcp

    with tempfile.TemporaryDirectory(prefix="prefect-ml-dcp-") as directory, _single_process():
        dcp.save(state, checkpoint_id=directory, no_dist=True)
        files = {}
        for name in os.listdir(directory):
            with open(os.path.join(directory, name), "rb") as handle:
                files[name] = handle.read()
    return files


def load_files(files: dict[str, bytes], state: dict[str, Any]) -> None:
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
