"""Large S3 objects moved from and to memory by parallel threads (boto3's client).

s3fs drives every request from one asyncio thread, so checksumming, signing and copying of all
parts share one core; threads let that work and the sockets overlap, as boto3's own transfer
manager does, but straight from the bytes in memory (no local file, no extra copy of the
whole object). Used by :mod:`integrations.storage` for every S3 read and for writes of two
parts or more; it reads the same endpoint, region, retry and credential settings as the s3fs
filesystem.

A multipart upload is aborted if any part fails, so no partial object is ever published;
a killed process leaves an incomplete upload that readers never see.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

logger = logging.getLogger(__name__)

_clients: dict[tuple[Any, ...], Any] = {}
_clients_lock = threading.Lock()


def client(options: dict[str, Any]) -> Any:
    """A boto3 S3 client for the storage module's s3fs ``options`` (cached; thread-safe)."""
    config = options["config_kwargs"]
    region = options.get("client_kwargs", {}).get("region_name")
    key = (
        options.get("endpoint_url"),
        region,
        config["retries"]["max_attempts"],
        options["max_concurrency"],
        os.environ.get("AWS_ACCESS_KEY_ID"),
        os.environ.get("AWS_PROFILE"),
    )
    with _clients_lock:
        if key not in _clients:
            import boto3
            from botocore.config import Config

            _clients[key] = boto3.session.Session().client(
                "s3",
                endpoint_url=options.get("endpoint_url"),
                region_name=region,
                config=Config(**config, max_pool_connections=2 * options["max_concurrency"]),
            )
        return _clients[key]


def upload(s3: Any, bucket: str, key: str, data: bytes, part_size: int, threads: int) -> None:
    """Multipart upload of ``data``, ``threads`` parts in flight; aborted if any part fails."""
    upload_id = s3.create_multipart_upload(Bucket=bucket, Key=key, ChecksumAlgorithm="CRC32")[
        "UploadId"
    ]
    view = memoryview(data)

    def send(number: int) -> dict[str, Any]:
        start = (number - 1) * part_size
        response = s3.upload_part(
            Bucket=bucket,
            Key=key,
            UploadId=upload_id,
            PartNumber=number,
            Body=view[start : start + part_size].tobytes(),
            ChecksumAlgorithm="CRC32",
        )
        return {
            "PartNumber": number,
            "ETag": response["ETag"],
            "ChecksumCRC32": response["ChecksumCRC32"],
        }

    try:
        with ThreadPoolExecutor(threads, thread_name_prefix="s3-upload") as pool:
            parts = list(pool.map(send, range(1, -(-len(data) // part_size) + 1)))
        s3.complete_multipart_upload(
            Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
        )
    except BaseException:
        try:
            s3.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
        except Exception:  # the upload stays invisible; the next run's cleanup aborts it
            logger.warning(
                "Could not abort multipart upload %s of s3://%s/%s", upload_id, bucket, key
            )
        raise


def download(
    s3: Any,
    objects: Sequence[tuple[str, str]],
    part_size: int,
    threads: int,
    digests: Sequence[Any] = (),
) -> list[bytearray]:
    """The bytes of each ``(bucket, key)`` of ``objects``, in order, by ranged GETs.

    No HEAD: an object's first GET asks for its first part, and the answer's ``Content-Range``
    gives the object's size and its ETag; the other parts follow as parallel ranged GETs pinned
    to that ETag, so an object replaced meanwhile fails the read instead of mixing two versions.
    A one-part object is one request. Every part is read into its place in one buffer of the
    object's size, and that buffer is what comes back (no copy of the whole object). The objects
    share ``threads`` requests in flight: one object's parts download while the next one
    starts. ``digests`` (hashlib objects or None, one per object), if given, are fed each
    object's parts in order while later parts are still downloading.

    Raises:
        FileNotFoundError: no such object or bucket. Every error names the object's URL.
    """
    with ThreadPoolExecutor(threads, thread_name_prefix="s3-download") as pool:
        try:
            started = [_first_part(s3, bucket, key, part_size, pool) for bucket, key in objects]
            for (buffer, parts), digest in zip(
                started, digests or [None] * len(objects), strict=True
            ):
                for start, stop, pending in parts:
                    if pending is not None:
                        pending.result()
                    if digest is not None:
                        digest.update(memoryview(buffer)[start:stop])
        except BaseException:
            pool.shutdown(cancel_futures=True)  # the other objects' parts are of no use now
            raise
    return [buffer for buffer, _parts in started]


_Part = tuple[int, int, "Future[None] | None"]


def _first_part(
    s3: Any, bucket: str, key: str, part_size: int, pool: ThreadPoolExecutor
) -> tuple[bytearray, list[_Part]]:
    """Read an object's first part into a new buffer of the object's size and start the GETs
    of its other parts; the buffer, and every part's range with its GET (None when done)."""
    url = f"s3://{bucket}/{key}"
    try:
        response = _get(s3, url, Bucket=bucket, Key=key, Range=f"bytes=0-{part_size - 1}")
    except _Unsatisfiable:  # only an empty object has no byte 0
        response = _get(s3, url, Bucket=bucket, Key=key)
    # 206 names the whole size after the slash; a 200 (no range asked, or none honoured) is all.
    size = int(response.get("ContentRange", "").rpartition("/")[2] or response["ContentLength"])
    buffer = bytearray(size)
    first = int(response["ContentLength"])
    if first:
        again = {"Range": f"bytes=0-{first - 1}", "IfMatch": response["ETag"]}
        _read_body(s3, url, response, memoryview(buffer)[:first], Bucket=bucket, Key=key, **again)
    parts: list[_Part] = [(0, first, None)]
    for start in range(first, size, part_size):
        stop = min(start + part_size, size)
        fetch = pool.submit(
            _fetch_part, s3, bucket, key, response["ETag"], start, memoryview(buffer)[start:stop]
        )
        parts.append((start, stop, fetch))
    return buffer, parts


def _fetch_part(s3: Any, bucket: str, key: str, etag: str, start: int, target: memoryview) -> None:
    """GET the part of the object at ``start`` into ``target``, if it still has ``etag``."""
    url = f"s3://{bucket}/{key}"
    request = {"Bucket": bucket, "Key": key, "IfMatch": etag}
    request["Range"] = f"bytes={start}-{start + len(target) - 1}"
    _read_body(s3, url, _get(s3, url, **request), target, **request)


class _CutShort(OSError):
    """A body that ended before its part did."""


def _read_body(s3: Any, url: str, response: Any, target: memoryview, **request: Any) -> None:
    """Fill ``target`` from the body of ``response`` (a GET of exactly its bytes), then let
    botocore check the body's length and checksum (it does so at the end of the stream).

    botocore retries a request that fails before its body; a body cut short (a reset or a
    timeout mid-stream) is asked for again with ``request``, as boto3's transfer manager does,
    up to the client's total attempts."""
    from botocore.exceptions import IncompleteReadError, ReadTimeoutError, ResponseStreamingError

    attempts = int(s3.meta.config.retries.get("total_max_attempts", 1))
    for attempt in range(1, attempts + 1):
        try:
            if int(response["ContentLength"]) != len(target):
                raise OSError(
                    errno.EIO, f"got {response['ContentLength']} bytes for {len(target)}", url
                )
            body, filled = response["Body"], 0
            while filled < len(target):
                read = body.readinto(target[filled:])
                if not read:
                    raise _CutShort(errno.EIO, f"the body ended after {filled} bytes", url)
                filled += read
            body.read()  # at the end: botocore's length and checksum checks
            return
        except (_CutShort, IncompleteReadError, ReadTimeoutError, ResponseStreamingError):
            if attempt == attempts:
                raise
            logger.info("Reading %s again (%s): attempt %d", url, request["Range"], attempt + 1)
            response = _get(s3, url, **request)


class _Unsatisfiable(OSError):
    """A range beyond the object's end (416): the object is shorter, or empty."""


def _get(s3: Any, url: str, **request: Any) -> Any:
    """``get_object`` with S3's error answers as OSErrors that name ``url``: FileNotFoundError
    for a missing object or bucket, PermissionError for refused credentials (as s3fs and every
    fsspec filesystem raise them)."""
    from botocore.exceptions import ClientError

    try:
        return s3.get_object(**request)
    except ClientError as exc:
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        text = f"{code}: {error.get('Message', exc)}"
        if code in ("NoSuchKey", "NoSuchBucket", "404"):
            raise FileNotFoundError(errno.ENOENT, text, url) from exc
        if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403"):
            raise PermissionError(errno.EACCES, text, url) from exc
        if code in ("InvalidRange", "416"):
            raise _Unsatisfiable(errno.EINVAL, text, url) from exc
        if code in ("PreconditionFailed", "412"):  # If-Match: another version was written
            text = f"replaced while it was being read ({text}); read it again"
        raise OSError(errno.EIO, text, url) from exc
