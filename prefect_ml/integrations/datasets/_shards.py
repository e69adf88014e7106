"""One worker's rows of a prepared split, and the order it trains on them.

A prepared dataset has one of two layouts (:mod:`integrations.storage` names their files):

* ``arrays``: one ``.npy`` pair per split. A worker reads its row range once and keeps it on its
  device: the fastest for data that fits (the built-in datasets, small files).
* ``parquet``: Parquet shards written by Ray Data (:mod:`integrations.datasets`), listed with
  their row counts in a manifest. A worker streams its share: a background thread reads up to
  two shuffle windows of row groups ahead of the step that needs them and a seeded window
  shuffle mixes them, so a worker holds a few windows of rows, never its whole shard.

Both orders are exact: an epoch's order is a pure function of the run's seed, the epoch, the
rank and the world size, so a worker restarted mid-run trains the epoch it restarts on the same
rows in the same order. (Ray Data's ``streaming_split`` hands blocks to whichever worker asks
first: fast, but not repeatable after a restart; that is why workers read their own rows.)
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import queue
import threading
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from prefect_ml.integrations import storage
from prefect_ml.integrations.errors import PrefectMLError

if TYPE_CHECKING:
    import pyarrow
    import pyarrow.parquet
    import torch

LAYOUTS = ("arrays", "parquet")
FEATURES, LABEL = "features", "label"  # the Parquet shards' columns
PREFETCH_WINDOWS = 2  # shuffle windows' worth of row groups read ahead of the training step
WINDOW_BYTES = 64 * 2**20  # rows shuffled together by a streamed shard
OPEN_FILES = 32  # shard files a worker keeps open (no read buffers: each read is one request)

# What turns a chunk of stored rows into a batch on the worker's device: features and the task's
# targets (class ids, or standardised values).
Placement = Callable[[np.ndarray, np.ndarray], "tuple[torch.Tensor, torch.Tensor]"]


Rows = tuple[np.ndarray, np.ndarray]  # features and labels of consecutive rows


class ShardReadError(PrefectMLError):
    """A shard file read back differently from its manifest (truncated, replaced, missing)."""


def epoch_seed(seed: int, epoch: int, rank: int) -> int:
    """The seed of one worker's epoch: shuffling and dropout are a pure function of it.

    Reseeding every epoch makes a resumed run draw exactly the numbers the uninterrupted run
    would have, without gathering per-worker RNG states into every checkpoint.
    """
    return int(np.random.SeedSequence([seed, epoch, rank]).generate_state(1)[0])


@dataclass(frozen=True)
class EpochOrder:
    """Which epoch a worker shuffles for."""

    seed: int
    epoch: int
    rank: int

    @property
    def worker_seed(self) -> int:
        return epoch_seed(self.seed, self.epoch, self.rank)

    @property
    def shared_seed(self) -> int:
        """The same on every worker: a streamed split's file order."""
        return int(np.random.SeedSequence([self.seed, self.epoch]).generate_state(1)[0])


def shard_bounds(rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of worker ``rank``; every worker gets the same count.

    Equal shards keep DDP's collective calls in step; the at most ``world_size - 1`` rows left
    over are dropped (the split was shuffled, so they are a random few).
    """
    per_worker = rows // world_size
    return rank * per_worker, (rank + 1) * per_worker


class Shard(Protocol):
    """A worker's rows of one split."""

    rows: int

    def head(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The first ``n`` rows as stored: features and labels."""
        ...

    def batches(
        self, batch_size: int, order: EpochOrder | None, place: Placement, *, skip: int = 0
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every row once, in batches on the device: shuffled for ``order``, else as stored;
        the first ``skip`` batches of that order left out (a run resumed mid-epoch)."""
        ...


class ArrayShard:
    """A shard held whole, on the device after its first batch."""

    def __init__(self, features: np.ndarray, labels: np.ndarray) -> None:
        self.features, self.labels = features, labels
        self.rows = len(labels)
        self._placed: tuple[torch.Tensor, torch.Tensor] | None = None

    def head(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        return self.features[:n], self.labels[:n]

    def batches(
        self, batch_size: int, order: EpochOrder | None, place: Placement, *, skip: int = 0
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        import torch

        if self._placed is None:
            self._placed = place(self.features, self.labels)
        features, targets = self._placed
        first = skip * batch_size  # skipped batches are never indexed
        if order is None:
            for start in range(first, self.rows, batch_size):
                yield features[start : start + batch_size], targets[start : start + batch_size]
            return
        # The order is drawn on the host (the same on every device) and indexes on the device: a
        # host index would be copied to the GPU, synchronously, twice per step.
        index = torch.from_numpy(np.random.default_rng(order.worker_seed).permutation(self.rows))
        index = index.to(features.device)
        for start in range(first, self.rows, batch_size):
            step = index[start : start + batch_size]
            yield features[step], targets[step]


class StoredArrayShard(ArrayShard):
    """A worker's rows of an ``arrays`` split in storage: read whole (only its byte range) on
    the first batch; ``head`` before that reads only the rows it returns."""

    def __init__(self, splits_url: str, split: str, rank: int = 0, world_size: int = 1) -> None:
        self.features_url = storage.split_array_url(splits_url, split, "features")
        self.labels_url = storage.split_array_url(splits_url, split, "labels")
        self.start, self.stop = shard_bounds(storage.array_rows(self.labels_url), rank, world_size)
        self.rows = self.stop - self.start
        self._placed = None
        self._loaded = False

    def _rows(self, stop: int) -> tuple[np.ndarray, np.ndarray]:
        return (
            storage.read_array_rows(self.features_url, self.start, stop),
            storage.read_array_rows(self.labels_url, self.start, stop),
        )

    def head(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if self._loaded:
            return super().head(n)
        return self._rows(self.start + min(n, self.rows))

    def batches(
        self, batch_size: int, order: EpochOrder | None, place: Placement, *, skip: int = 0
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if not self._loaded:
            self.features, self.labels = self._rows(self.stop)
            self._loaded = True
        return super().batches(batch_size, order, place, skip=skip)


@dataclass(frozen=True)
class ShardFile:
    """One Parquet file of a split (its name relative to the splits' URL) and the rows of each
    of its row groups."""

    name: str
    groups: tuple[int, ...]

    @property
    def rows(self) -> int:
        return sum(self.groups)


Piece = tuple[ShardFile, int, int, int]  # rows [start, stop) of one row group of a file


def write_manifest(splits_url: str, files: dict[str, list[ShardFile]]) -> None:
    manifest = {
        split: [[f.name, list(f.groups)] for f in listed] for split, listed in files.items()
    }
    storage.write_bytes(storage.shard_manifest_url(splits_url), json.dumps(manifest).encode())


def read_manifest(splits_url: str) -> dict[str, list[ShardFile]]:
    manifest = json.loads(storage.read_bytes(storage.shard_manifest_url(splits_url)))
    return {
        split: [ShardFile(str(name), tuple(int(n) for n in groups)) for name, groups in listed]
        for split, listed in manifest.items()
    }


def table_arrays(table: pyarrow.Table, sample_shape: tuple[int, ...]) -> Rows:
    """A Parquet shard's rows as ``(features, labels)`` arrays."""
    features = table.column(FEATURES).combine_chunks().flatten().to_numpy(zero_copy_only=False)
    labels = table.column(LABEL).to_numpy()
    features = np.require(features.reshape((len(labels), *sample_shape)), requirements="W")
    return features, labels  # writable: torch refuses read-only arrays


class StreamedShard:
    """A shard read from Parquet shards as it is trained on."""

    def __init__(
        self,
        splits_url: str,
        files: list[ShardFile],
        sample_shape: tuple[int, ...],
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.splits_url, self.files, self.sample_shape = splits_url, files, sample_shape
        self.rank, self.world_size = rank, world_size
        self.rows = sum(f.rows for f in files) // world_size
        self._footers: dict[str, pyarrow.parquet.FileMetaData] = {}  # checked once, then reused
        row_bytes = 4 * int(np.prod(sample_shape)) + 8
        self.window_rows = max(1024, WINDOW_BYTES // row_bytes)

    def pieces(self, order: EpochOrder | None) -> list[Piece]:
        """This worker's rows as ``(file, row group, start, stop)``: its equal share of the
        split's row groups, shuffled (for ``order``) the same way on every worker, else as
        stored. Row groups from anywhere in the split then meet in each shuffle window, so
        sorted source files still give mixed batches."""
        groups = [(file, g, n) for file in self.files for g, n in enumerate(file.groups)]
        if order is not None:
            permutation = np.random.default_rng(order.shared_seed).permutation(len(groups))
            groups = [groups[i] for i in permutation]
        start, stop = self.rank * self.rows, (self.rank + 1) * self.rows
        pieces, offset = [], 0
        for file, group, rows in groups:
            low, high = max(start, offset), min(stop, offset + rows)
            if low < high:
                pieces.append((file, group, low - offset, high - offset))
            offset += rows
        return pieces

    def _chunks(self, pieces: list[Piece]) -> Iterator[Rows]:
        """The rows of ``pieces``, a row group at a time, checked against the manifest; at
        most ``OPEN_FILES`` files are open at once."""
        import pyarrow.parquet as pq

        with contextlib.ExitStack() as stack:
            opened: collections.OrderedDict[str, tuple[Any, pq.ParquetFile]] = (
                collections.OrderedDict()
            )
            for file, group, start, stop in pieces:
                url = storage.join(self.splits_url, file.name)
                if url not in opened:
                    if len(opened) >= OPEN_FILES:
                        opened.popitem(last=False)[1][0].close()
                    handle = stack.enter_context(storage.open_file(url, random_access=True))
                    if url not in self._footers:
                        self._footers[url] = self._checked(url, handle, file).metadata
                    # One coalesced read per row group (pre_buffer), no second footer read.
                    parquet = pq.ParquetFile(handle, metadata=self._footers[url], pre_buffer=True)
                    opened[url] = (handle, parquet)
                opened.move_to_end(url)
                table = opened[url][1].read_row_group(group, columns=[FEATURES, LABEL])
                if table.num_rows != file.groups[group]:
                    raise ShardReadError(
                        f"row group {group} of {url} read back {table.num_rows} rows of "
                        f"{file.groups[group]}; refusing to train on a partial shard"
                    )
                yield table_arrays(table.slice(start, stop - start), self.sample_shape)

    @staticmethod
    def _checked(url: str, handle: Any, file: ShardFile) -> pyarrow.parquet.ParquetFile:
        import pyarrow as pa
        import pyarrow.parquet as pq

        parquet = pq.ParquetFile(handle)
        types = {field.name: field.type for field in parquet.schema_arrow}
        features, label = types.get(FEATURES), types.get(LABEL)
        # What Ray Data wrote: plain types only (an extension type would run its own decoder).
        if not (
            features is not None
            and pa.types.is_fixed_size_list(features)
            and features.value_type == pa.float32()
            and label in (pa.int64(), pa.float32())
        ):
            raise ShardReadError(
                f"{url} has columns {FEATURES}: {features}, {LABEL}: {label}, not the "
                "fixed-size float32 lists and int64/float32 labels prepared splits have"
            )
        metadata = parquet.metadata
        groups = tuple(metadata.row_group(g).num_rows for g in range(metadata.num_row_groups))
        if groups != file.groups:
            raise ShardReadError(
                f"{url} holds {metadata.num_rows} rows in {len(groups)} row groups where its "
                f"manifest says {file.rows} in {len(file.groups)}: the prepared splits changed "
                "under the run; prepare them again"
            )
        return parquet

    def head(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        for features, labels in self._chunks(self.pieces(None)):
            return features[:n], labels[:n]
        return np.zeros((0, *self.sample_shape), np.float32), np.zeros(0)

    def batches(
        self, batch_size: int, order: EpochOrder | None, place: Placement, *, skip: int = 0
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches of the epoch's shuffle windows. Skipped batches are still read (each
        window's shuffle mixes rows carried over from the one before, so the window a resumed
        run starts in depends on every window before it), but never placed on the device."""
        rng = np.random.default_rng(order.worker_seed) if order is not None else None
        delivered = 0
        for features, labels in self._windows(self.pieces(order), batch_size, rng):
            for start in range(0, len(labels), batch_size):
                stop = start + batch_size
                if skip > 0:
                    skip -= 1
                    continue
                yield place(features[start:stop], labels[start:stop])
            delivered += len(labels)
        if delivered != self.rows:
            raise ShardReadError(
                f"read {delivered} of the {self.rows} rows of rank {self.rank}'s shard of "
                f"{self.splits_url}; refusing to train on a partial shard"
            )

    def _windows(
        self, pieces: list[Piece], batch_size: int, rng: np.random.Generator | None
    ) -> Iterator[Rows]:
        """The rows of ``pieces`` in windows of about ``window_rows`` rows (shuffled with ``rng``
        when given), each a whole number of batches but the last."""
        window: list[Rows] = []
        window_rows = 0
        group_rows = max(
            1, self.rows * self.world_size // max(1, sum(len(f.groups) for f in self.files))
        )
        depth = max(2, math.ceil(PREFETCH_WINDOWS * self.window_rows / group_rows))
        with contextlib.closing(prefetched(self._chunks(pieces), depth)) as chunks:
            for chunk in chunks:
                window.append(chunk)
                window_rows += len(chunk[1])
                if window_rows < self.window_rows:
                    continue
                features, labels = _concatenate(window, rng)
                full = len(labels) - len(labels) % batch_size
                yield features[:full], labels[:full]
                window = [(features[full:], labels[full:])]  # carried to the next window
                window_rows = len(labels) - full
        if window_rows:
            yield _concatenate(window, rng)


def _concatenate(window: list[Rows], rng: np.random.Generator | None) -> Rows:
    features = np.concatenate([f for f, _ in window])
    labels = np.concatenate([label for _, label in window])
    if rng is None:
        return features, labels
    permutation = rng.permutation(len(labels))
    return features[permutation], labels[permutation]


def prefetched(items: Iterator[Rows], depth: int) -> Generator[Rows, None, None]:
    """``items`` produced by a background thread up to ``depth`` ahead; its errors are raised
    here, and closing the iterator stops the thread."""
    buffer: queue.Queue[object] = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def put(item: object) -> None:
        while not stop.is_set():
            try:
                buffer.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def produce() -> None:
        try:
            for item in items:
                put(item)
                if stop.is_set():
                    return
            put(done)
        except BaseException as exc:  # raised in the consumer
            put(exc)

    threading.Thread(target=produce, name="shard-prefetch", daemon=True).start()
    try:
        while (item := buffer.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item  # type: ignore[misc]
    finally:
        stop.set()


def open_shard(
    splits_url: str,
    layout: str,
    split: str,
    sample_shape: tuple[int, ...],
    rank: int = 0,
    world_size: int = 1,
) -> Shard:
    """Worker ``rank``'s rows of ``split`` (``train``, ``val`` or ``test``)."""
    if layout == "parquet":
        files = read_manifest(splits_url)[split]
        return StreamedShard(splits_url, files, sample_shape, rank, world_size)
    return StoredArrayShard(splits_url, split, rank, world_size)
