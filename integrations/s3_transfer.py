"""Large S3 objects moved from and to memory by parallel threads (boto3's client).

s3fs drives every request from one asyncio thread, so checksumming, signing and copying of all
parts share one core; threads let that work and the sockets overlap, as boto3's own transfer
manager does, but straight from the bytes in memory (no local file, no extra copy of the
whole object). Used by :mod:`integrations.storage` for objects of two parts or more; it reads
the same endpoint, region, retry and credential settings as the s3fs filesystem.

A multipart upload is aborted if any part fails, so no partial object is ever published;
a killed process leaves an incomplete upload that readers never see.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
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
    bucket: str,
    key: str,
    size: int,
    etag: str,
    part_size: int,
    threads: int,
    digest: Any = None,
) -> bytes:
    """The object's bytes by parallel ranged GETs, each pinned to ``etag``: an object replaced
    meanwhile fails the read instead of mixing two versions. ``digest`` (a hashlib object), if
    given, is fed the parts in order while the later ones are still downloading."""
    buffer = bytearray(size)

    def fetch(start: int) -> None:
        stop = min(start + part_size, size)
        body = s3.get_object(
            Bucket=bucket, Key=key, Range=f"bytes={start}-{stop - 1}", IfMatch=etag
        )["Body"].read()
        if len(body) != stop - start:
            raise OSError(f"s3://{bucket}/{key}: got {len(body)} bytes of range {start}-{stop}")
        buffer[start:stop] = body

    starts = range(0, size, part_size)
    with ThreadPoolExecutor(threads, thread_name_prefix="s3-download") as pool:
        for start, _done in zip(starts, pool.map(fetch, starts), strict=True):
            if digest is not None:
                digest.update(memoryview(buffer)[start : start + part_size])
    return bytes(buffer)
