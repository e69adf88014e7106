"""Bytes at a URL through fsspec (local disk, S3 through s3fs, anything fsspec opens)."""

from __future__ import annotations

import io
import uuid
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem


def filesystem(url: str) -> tuple[AbstractFileSystem, str]:
    """The fsspec filesystem for ``url`` and the path inside it."""
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(url)
    return fs, path


def join(url: str, *parts: str) -> str:
    """``url`` with ``parts`` appended as path segments."""
    return "/".join([url.rstrip("/"), *(p.strip("/") for p in parts)])


def write_bytes(url: str, data: bytes) -> None:
    """Write ``data`` so that a reader never sees a partial object.

    Local files are written beside the target and renamed; object stores publish on close,
    so an exception aborts the upload (``discard``) instead of completing a truncated object.
    """
    fs, path = filesystem(url)
    if fs.protocol in ("file", "local") or "file" in fs.protocol:
        fs.makedirs(fs._parent(path), exist_ok=True)
        staging = f"{path}.tmp-{uuid.uuid4().hex}"
        with fs.open(staging, "wb") as handle:
            handle.write(data)
        fs.mv(staging, path)
        return
    handle = fs.open(path, "wb")
    try:
        handle.write(data)
    except BaseException:
        handle.discard()
        raise
    handle.close()


def read_bytes(url: str) -> bytes:
    fs, path = filesystem(url)
    return fs.cat_file(path)  # type: ignore[no-any-return]


def exists(url: str) -> bool:
    fs, path = filesystem(url)
    return fs.exists(path)  # type: ignore[no-any-return]


def list_names(url: str) -> list[str]:
    """Names (not paths) of the entries directly under ``url``; empty if it does not exist."""
    fs, path = filesystem(url)
    if not fs.exists(path):
        return []
    return sorted(entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(path, detail=False))


def array_to_npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()


def write_array(url: str, array: np.ndarray) -> None:
    write_bytes(url, array_to_npy(array))


def read_array(url: str) -> np.ndarray:
    return np.load(io.BytesIO(read_bytes(url)), allow_pickle=False)


def read_array_rows(url: str, start: int, stop: int) -> np.ndarray:
    """Rows ``[start, stop)`` of a ``.npy`` file, reading only those bytes."""
    fs, path = filesystem(url)
    with fs.open(path, "rb") as handle:
        major, _minor = np.lib.format.read_magic(handle)
        read_header = (
            np.lib.format.read_array_header_1_0
            if major == 1
            else np.lib.format.read_array_header_2_0
        )
        shape, fortran_order, dtype = read_header(handle)
        if fortran_order:
            raise ValueError(f"{url} is Fortran-ordered; write arrays C-contiguous")
        row_items = int(np.prod(shape[1:], dtype=np.int64))
        row_bytes = row_items * dtype.itemsize
        stop = min(stop, shape[0])
        handle.seek(handle.tell() + start * row_bytes)
        raw = handle.read(max(stop - start, 0) * row_bytes)
    return np.frombuffer(raw, dtype=dtype).reshape((max(stop - start, 0), *shape[1:])).copy()


def check_writable(url: str) -> str:
    """Write, read back and delete a probe object under ``url``; raise if any step fails."""
    probe = join(url, f".prefect-ml-probe-{uuid.uuid4().hex}")
    write_bytes(probe, b"probe")
    if read_bytes(probe) != b"probe":
        raise OSError(f"{probe} did not read back what was written")
    fs, path = filesystem(probe)
    fs.rm(path)
    return f"{url} is writable"
