"""NumPy arrays at a URL as ``.npy`` objects, whole or a range of rows (no pickles)."""

from __future__ import annotations

import io
from typing import IO, Any

import numpy as np

from prefect_ml.integrations.storage._files import open_file, read_bytes, write_bytes


def array_to_npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()


def write_array(url: str, array: np.ndarray) -> None:
    write_bytes(url, array_to_npy(array))


def read_array(url: str) -> np.ndarray:
    return np.load(io.BytesIO(read_bytes(url)), allow_pickle=False)


def _npy_header(handle: IO[bytes], url: str) -> tuple[tuple[int, ...], np.dtype[Any]]:
    """The shape and dtype of the ``.npy`` file open in ``handle``, left at its first row."""
    major, _minor = np.lib.format.read_magic(handle)
    read_header = (
        np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
    )
    shape, fortran_order, dtype = read_header(handle)
    if fortran_order:
        raise ValueError(f"{url} is Fortran-ordered; write arrays C-contiguous")
    return shape, dtype


def array_rows(url: str) -> int:
    """The rows of a ``.npy`` file, from its header."""
    with open_file(url) as handle:
        return int(_npy_header(handle, url)[0][0])


def read_array_rows(url: str, start: int, stop: int) -> np.ndarray:
    """Rows ``[start, stop)`` of a ``.npy`` file, reading only those bytes."""
    with open_file(url) as handle:
        shape, dtype = _npy_header(handle, url)
        row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        stop = min(stop, shape[0])
        handle.seek(handle.tell() + start * row_bytes)
        raw = handle.read(max(stop - start, 0) * row_bytes)
    return np.frombuffer(raw, dtype=dtype).reshape((max(stop - start, 0), *shape[1:])).copy()
