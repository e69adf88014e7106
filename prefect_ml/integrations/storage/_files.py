"""Bytes at a URL through fsspec: reads, all-or-nothing writes, exclusive creation, listings."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import os
import re
import uuid
from collections.abc import Iterator, Sequence
from typing import IO, TYPE_CHECKING, Any

from prefect_ml.integrations.settings import get_settings
from prefect_ml.integrations.storage._keys import join

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

# s3fs's pipe_file writes an object of two parts or more as a multipart upload of parts this
# size (s3fs's default), ten in flight; a smaller one in one PUT. 8 MiB parts (boto3's) were
# slower through s3fs: BENCHMARKS.md, "Checkpoints on S3", 2026-12-06.
S3_PART_SIZE = 50 * 2**20
S3_CONCURRENCY = 10


def _is_s3(url: str) -> bool:
    return url.startswith(("s3://", "s3a://"))


def s3_options() -> dict[str, Any]:
    """s3fs options from the standard AWS variables; credentials are left to botocore's chain."""
    options: dict[str, Any] = {
        "config_kwargs": {
            # Transient errors (5xx, throttling, connection resets, timeouts): botocore's
            # "standard" mode retries them with exponential backoff and jitter, bounded.
            "retries": {"max_attempts": get_settings().s3_max_attempts, "mode": "standard"},
            "connect_timeout": 5,
            "read_timeout": 60,
        },
        "max_concurrency": S3_CONCURRENCY,
        # Other processes (workers, a resumed run) write here: never answer from a stale listing.
        "use_listings_cache": False,
    }
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        options["endpoint_url"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        options["client_kwargs"] = {"region_name": region}
    return options


# HTTP(S) data is fetched without following redirects: the host check of check_data_url holds
# for the host it named, not for wherever that host sends the request next.
_HTTP_OPTIONS = {"http": {"allow_redirects": False}, "https": {"allow_redirects": False}}


def filesystem(url: str) -> tuple[AbstractFileSystem, str]:
    """The fsspec filesystem for ``url`` and the path inside it."""
    from fsspec.core import url_to_fs

    options = s3_options() if _is_s3(url) else {}
    if re.search(r"(^|::)https?://", url):
        options.update(_HTTP_OPTIONS)
    fs, path = url_to_fs(url, **options)
    if _is_s3(url):
        # s3fs retries a failed request (and a body cut short) on top of botocore's retries, 5
        # times unless told: one setting bounds both, so 1 means no retry at all.
        fs.retries = options["config_kwargs"]["retries"]["max_attempts"]
    return fs, path


def is_local(url: str) -> bool:
    return url.startswith("file://") or "://" not in url


def write_bytes(url: str, data: bytes) -> None:
    """Write ``data`` so that a reader never sees a partial object.

    Local files are written beside the target and renamed. On S3 an object appears only when
    its single PUT or its multipart upload (``S3_PART_SIZE`` parts) completes; s3fs aborts the
    multipart upload if a part fails, and a killed writer leaves only an incomplete upload,
    invisible to readers (:func:`abort_incomplete_uploads` cleans those).
    """
    fs, path = filesystem(url)
    if is_local(url):
        fs.makedirs(fs._parent(path), exist_ok=True)
        staging = f"{path}.tmp-{uuid.uuid4().hex}"
        with fs.open(staging, "wb") as handle:
            handle.write(data)
        fs.mv(staging, path)
        return
    if _is_s3(url):
        fs.pipe_file(path, data, chunksize=S3_PART_SIZE)
        return
    handle = fs.open(path, "wb")
    try:
        handle.write(data)
    except BaseException:
        handle.discard()
        raise
    handle.close()


def read_bytes(url: str) -> bytes:
    """The whole object."""
    return read_all_and_sha256([url], digest=False)[0][0]


def read_bytes_and_sha256(url: str) -> tuple[bytes, str]:
    """The whole object and its sha256 hex digest; see :func:`read_all_and_sha256`."""
    return read_all_and_sha256([url])[0]


def read_all_and_sha256(urls: Sequence[str], *, digest: bool = True) -> list[tuple[bytes, str]]:
    """Each object of ``urls`` whole, with its sha256 hex digest ("" without ``digest``).

    On S3 the objects are read together, each in one GET with no HEAD (:func:`_read_s3`).

    Raises:
        FileNotFoundError: an object does not exist; its ``filename`` is that URL.
    """
    if urls and all(_is_s3(url) for url in urls):
        contents = _read_s3(urls)
    else:
        contents = []
        for url in urls:
            fs, path = filesystem(url)
            try:
                contents.append(fs.cat_file(path))
            except FileNotFoundError as exc:
                raise FileNotFoundError(errno.ENOENT, "No such object", url) from exc
    return [(c, hashlib.sha256(c).hexdigest() if digest else "") for c in contents]


def _read_s3(urls: Sequence[str]) -> list[bytes]:
    """The S3 objects at ``urls``, read concurrently on s3fs's event loop.

    Each object is one streamed GET (``max_concurrency=1``: no HEAD to size it, no ranged
    parts), so it is always one version of the object, and s3fs asks again for a body cut
    short. BENCHMARKS.md, "Checkpoints on S3", 2026-12-06, has the numbers behind this choice.
    """
    from fsspec.asyn import sync

    located = [filesystem(url) for url in urls]
    fs = located[0][0]

    async def read_all() -> list[Any]:
        reads = [fs._cat_file(path, max_concurrency=1) for _fs, path in located]
        return await asyncio.gather(*reads, return_exceptions=True)

    contents = sync(fs.loop, read_all)
    for url, content in zip(urls, contents, strict=True):
        if isinstance(content, FileNotFoundError):
            raise FileNotFoundError(errno.ENOENT, f"No such object ({content})", url) from content
        if isinstance(content, BaseException):
            raise content
    return contents


@contextlib.contextmanager
def open_file(url: str, mode: str = "rb", *, random_access: bool = False) -> Iterator[IO[bytes]]:
    """``url`` open as a file. ``random_access``: every read is one request for exactly its
    bytes (no read-ahead block), for readers that know their byte ranges (Parquet's)."""
    fs, path = filesystem(url)
    options = {"cache_type": "none"} if random_access and not is_local(url) else {}
    with fs.open(path, mode, **options) as handle:
        yield handle


def exists(url: str) -> bool:
    fs, path = filesystem(url)
    return fs.exists(path)  # type: ignore[no-any-return]


def remove(url: str) -> None:
    fs, path = filesystem(url)
    fs.rm(path)


def remove_folder(url: str) -> None:
    """Delete everything under ``url`` and the folder itself; nothing if it does not exist."""
    fs, path = filesystem(url)
    fs.invalidate_cache(path)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def create_exclusive(url: str, data: bytes) -> bool:
    """Write ``data`` at ``url`` only if nothing is there; False if something already is.

    Of writers racing for one URL exactly one gets True, and no reader sees a partial object:
    locally a complete staging file is hard-linked into place (``link`` refuses an existing
    name); on S3 a PUT with ``If-None-Match: *``.
    """
    fs, path = filesystem(url)
    if is_local(url):
        fs.makedirs(fs._parent(path), exist_ok=True)
        staging = f"{path}.tmp-{uuid.uuid4().hex}"
        with open(staging, "wb") as handle:
            handle.write(data)
        try:
            os.link(staging, path)
        except FileExistsError:
            return False
        finally:
            os.remove(staging)
        return True
    try:
        with fs.open(path, "xb") as handle:
            handle.write(data)
    except FileExistsError:
        return False
    except OSError as exc:
        if not _refused_as_existing(exc):
            raise
        return False
    return True


def _refused_as_existing(exc: OSError) -> bool:
    """Whether an object store refused a conditional PUT because the object exists (412), or
    because another conditional write to it was in flight (409)."""
    text = f"{exc} {exc.__cause__}"
    return any(m in text for m in ("PreconditionFailed", "ConditionalRequestConflict", "412"))


def modified_time(url: str) -> float:
    """When the object at ``url`` was last written, by the storage's clock (POSIX seconds)."""
    fs, path = filesystem(url)
    fs.invalidate_cache(path)
    return float(fs.modified(path).timestamp())


def storage_clock(url: str) -> float:
    """The storage's clock now: the modified time of a probe object written under ``url``.

    Processes on different hosts compare times written by the storage itself, never their own
    clocks, so clock skew between hosts does not matter.
    """
    probe = join(url, f".clock-{uuid.uuid4().hex}")
    write_bytes(probe, b"")
    try:
        return modified_time(probe)
    finally:
        remove(probe)


def list_names(url: str) -> list[str]:
    """Names (not paths) of the entries directly under ``url``; empty if it does not exist."""
    fs, path = filesystem(url)
    fs.invalidate_cache(path)
    if not fs.exists(path):
        return []
    return sorted(entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(path, detail=False))


def list_sizes(url: str) -> dict[str, int]:
    """Sizes in bytes of the files directly under ``url``, by name; empty if it does not exist."""
    fs, path = filesystem(url)
    fs.invalidate_cache(path)  # another process may have written there since the last listing
    if not fs.exists(path):
        return {}
    return {
        entry["name"].rstrip("/").rsplit("/", 1)[-1]: int(entry["size"])
        for entry in fs.ls(path, detail=True)
        if entry["type"] == "file"
    }
