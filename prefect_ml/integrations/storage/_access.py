"""Reaching the store: credentials from a Prefect Secret block, a probe that turns a missing
bucket or refused credentials into a clear error before any compute, leftovers of killed
writers, and the filesystem Ray Train writes its run state through."""

from __future__ import annotations

import os
import uuid
from typing import TYPE_CHECKING, Any

from prefect_ml.integrations.errors import ConfigurationError, EnvironmentCheckError
from prefect_ml.integrations.storage._files import (
    _is_s3,
    filesystem,
    is_local,
    read_bytes,
    remove,
    write_bytes,
)
from prefect_ml.integrations.storage._keys import check_url, join

if TYPE_CHECKING:
    import pyarrow.fs

    from prefect_ml.integrations.settings import PrefectMLSettings


_CREDENTIAL_HINT = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or "
    "PREFECT_ML_S3_CREDENTIALS_BLOCK (a Prefect Secret block holding them)"
)


def _permanent_error(url: str, exc: BaseException) -> EnvironmentCheckError | None:
    """A clear error for failures that no retry will fix, or None for anything else."""
    text = f"{type(exc).__name__}: {exc}"
    if type(exc).__name__ in ("NoCredentialsError", "PartialCredentialsError"):
        return EnvironmentCheckError(f"no S3 credentials for {url}: {_CREDENTIAL_HINT}")
    markers = ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "Forbidden", "403")
    if isinstance(exc, PermissionError) or any(m in text for m in markers):
        return EnvironmentCheckError(
            f"S3 refused the credentials for {url} ({text}); {_CREDENTIAL_HINT}"
        )
    if "NoSuchBucket" in text or (isinstance(exc, FileNotFoundError) and _is_s3(url)):
        bucket = url.split("://", 1)[1].split("/", 1)[0]
        return EnvironmentCheckError(
            f"bucket {bucket!r} of {url} does not exist; create it or fix PREFECT_ML_STORAGE_URL"
        )
    return None


def check_writable(url: str) -> str:
    """Write, read back and delete a probe object under ``url``; raise a clear error if any
    step fails (missing bucket, refused or missing credentials, unreachable endpoint)."""
    probe = join(url, f".prefect-ml-probe-{uuid.uuid4().hex}")
    try:
        write_bytes(probe, b"probe")
        if read_bytes(probe) != b"probe":
            raise OSError(f"{probe} did not read back what was written")
        remove(probe)
    except EnvironmentCheckError:
        raise
    except Exception as exc:
        permanent = _permanent_error(url, exc)
        if permanent is not None:
            raise permanent from None
        raise EnvironmentCheckError(
            f"storage {url} is not usable: {type(exc).__name__}: {exc}. "
            "Check PREFECT_ML_STORAGE_URL and, for S3, AWS_ENDPOINT_URL."
        ) from exc
    return f"{url} is writable"


def abort_incomplete_uploads(url: str) -> int:
    """Abort the multipart uploads left under ``url`` by writers that died; return how many.

    They are invisible to readers but hold storage until aborted. Call it only where no other
    writer is uploading under ``url`` (a run's own checkpoint prefix before it resumes).
    """
    if not _is_s3(url):
        return 0
    fs, path = filesystem(url)
    bucket, _, prefix = path.partition("/")
    uploads = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix).get("Uploads", [])
    for upload in uploads:
        fs.call_s3(
            "abort_multipart_upload",
            Bucket=bucket,
            Key=upload["Key"],
            UploadId=upload["UploadId"],
        )
    return len(uploads)


def ray_storage(url: str) -> tuple[str, pyarrow.fs.FileSystem | None]:
    """Ray Train's ``storage_path`` and ``storage_filesystem`` for run state under ``url``.

    Local paths go to Ray as they are; object stores go through this module's filesystem,
    wrapped for pyarrow (``FSSpecHandler``), so Ray uses the same endpoint, credentials and
    retries as everything else.
    """
    if is_local(url):
        return url.removeprefix("file://"), None
    import pyarrow.fs

    fs, path = filesystem(url)
    return path, pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(fs))


CREDENTIAL_VARIABLES = {
    "aws_access_key_id": "AWS_ACCESS_KEY_ID",
    "aws_secret_access_key": "AWS_SECRET_ACCESS_KEY",
    "aws_session_token": "AWS_SESSION_TOKEN",
}


def prepare_storage(settings: PrefectMLSettings) -> str:
    """At flow start, before any compute: credentials from the configured block, then a probe
    that turns a missing bucket, refused credentials or an unreachable endpoint into a clear
    error. Returns the storage URL."""
    url = check_url(settings.resolved_storage_url, "PREFECT_ML_STORAGE_URL")
    if settings.s3_credentials_block:
        apply_credentials_block(settings.s3_credentials_block)
    if is_local(url):  # checked without writing: a failed run leaves the home untouched
        _check_local_writable(url)
    else:
        check_writable(url)
    return url


def _check_local_writable(url: str) -> None:
    from pathlib import Path

    path = Path(url.removeprefix("file://"))
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise EnvironmentCheckError(
            f"storage {url} is not writable ({existing} is not a writable directory); "
            "fix its permissions or set PREFECT_ML_STORAGE_URL"
        )


def apply_credentials_block(block_name: str) -> None:
    """Export the S3 credentials held by a Prefect Secret block as the standard AWS variables.

    The block's value is a JSON object with ``aws_access_key_id``, ``aws_secret_access_key``
    and optionally ``aws_session_token``. Call it on the driver before Ray starts: a local Ray
    passes its environment to its workers; on a remote cluster give the nodes their own role.
    """
    from prefect.blocks.system import Secret

    field = "PREFECT_ML_S3_CREDENTIALS_BLOCK"
    try:
        secret: Any = Secret.load(block_name)
        value = secret.get()
    except ValueError as exc:
        raise ConfigurationError(field, f"no Secret block named {block_name!r}: {exc}") from None
    if not isinstance(value, dict) or not {"aws_access_key_id", "aws_secret_access_key"} <= set(
        value
    ):
        raise ConfigurationError(
            field,
            f"Secret {block_name!r} must hold a JSON object with aws_access_key_id and "
            "aws_secret_access_key",
        )
    for key, variable in CREDENTIAL_VARIABLES.items():
        if key in value:
            os.environ[variable] = str(value[key])
