"""Bytes at a URL through fsspec: local disk, S3 through s3fs, anything fsspec opens.

Every step reads and writes through this module, so one place decides how an object store is
reached (endpoint, region, credentials, retries), how a write stays all-or-nothing, and which
keys are refused. S3 is configured the standard AWS way: ``AWS_ENDPOINT_URL_S3`` /
``AWS_ENDPOINT_URL``, ``AWS_REGION`` / ``AWS_DEFAULT_REGION``, credentials from the environment,
``AWS_PROFILE`` or instance roles, or a Prefect Secret block named by
``PREFECT_ML_S3_CREDENTIALS_BLOCK`` (see :func:`apply_credentials_block`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import io
import os
import re
import uuid
from collections.abc import Iterator, Sequence
from typing import IO, TYPE_CHECKING, Any
from urllib.parse import unquote

import numpy as np

from prefect_ml.integrations import tenancy
from prefect_ml.integrations.errors import ConfigurationError, EnvironmentCheckError
from prefect_ml.integrations.settings import PrefectMLSettings, get_settings

if TYPE_CHECKING:
    import pyarrow.fs
    from fsspec import AbstractFileSystem

# s3fs's pipe_file writes an object of two parts or more as a multipart upload of parts this
# size (s3fs's default), ten in flight; a smaller one in one PUT. 8 MiB parts (boto3's) were
# slower through s3fs: BENCHMARKS.md, "Checkpoints on S3", 2026-12-06.
S3_PART_SIZE = 50 * 2**20
S3_CONCURRENCY = 10
_ENCODED = re.compile(r"%[0-9A-Fa-f]{2}")


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


def check_key(part: str) -> str:
    """``part`` if it is a safe relative key; raise if it could leave the directory it joins.

    Refuses ``..`` segments however they are percent-encoded (``..%2f``, ``%252e%252e%252f``),
    absolute paths, URLs, fsspec chains (``::``), backslashes and NUL bytes.
    """
    decoded = part
    for _ in range(5):  # %25 → % → the character: decode until nothing changes
        if not _ENCODED.search(decoded):
            break
        decoded = unquote(decoded)
    else:
        raise ConfigurationError("key", f"{part!r} is percent-encoded too many times")
    problem = None
    if "\x00" in decoded or "\\" in decoded:
        problem = "contains a NUL byte or a backslash"
    elif "::" in decoded:  # fsspec reads it as a chain of URLs: another filesystem
        problem = "contains '::'"
    elif decoded.startswith("/") or "://" in decoded or re.match(r"^[A-Za-z]:", decoded):
        problem = "is absolute"
    elif any(segment in ("..", ".") for segment in decoded.split("/")):
        problem = "has a '..' or '.' segment"
    if problem:
        raise ConfigurationError("key", f"{part!r} {problem}; keys must stay inside their prefix")
    return part


def join(url: str, *parts: str) -> str:
    """``url`` with ``parts`` appended as path segments; every part must pass :func:`check_key`."""
    return "/".join([url.rstrip("/"), *(check_key(p).strip("/") for p in parts)])


def root_url(settings: PrefectMLSettings) -> str:
    """The root of everything runs store (splits, checkpoints, leases, campaigns): the storage
    URL, or its ``tenants/<tenant>`` folder when a tenant is set."""
    return join(settings.resolved_storage_url, *tenancy.storage_keys(settings.tenant))


# The storage layout: every root under the storage URL is named here, and nowhere else.
def dataset_url(root_url: str, fingerprint: str) -> str:
    """The prepared splits of the dataset (and recipe) with ``fingerprint``."""
    return join(root_url, "datasets", fingerprint)


def split_array_url(splits_url: str, split: str, part: str) -> str:
    """An in-memory split's ``features`` or ``labels`` array (``.npy``)."""
    return join(splits_url, f"{split}_{part}.npy")


def statistic_url(splits_url: str, name: str) -> str:
    """The training split's per-feature ``mean`` or ``std`` (``.npy``), both layouts."""
    return join(splits_url, f"{name}.npy")


def split_parquet_url(splits_url: str) -> str:
    """A streamed dataset's Parquet shards, one ``split=<name>`` folder per split."""
    return join(splits_url, "parquet")


def shard_manifest_url(splits_url: str) -> str:
    """A streamed dataset's shard manifest: every split's files and their row counts."""
    return join(splits_url, "shards.json")


def dataset_meta_url(splits_url: str) -> str:
    """What was prepared (JSON), written after every split: its presence means complete."""
    return join(splits_url, "meta.json")


def run_checkpoint_url(root_url: str, experiment_id: str, run_id: str) -> str:
    """The checkpoints of one training run."""
    return join(root_url, "checkpoints", experiment_id, run_id)


def campaign_url(root_url: str, storage_digest: str, name: str) -> str:
    """A campaign's root: its trials' checkpoints and its lease."""
    return join(root_url, "campaigns", storage_digest, name)


def trial_checkpoint_url(campaign_url: str, root_trial: int) -> str:
    """The checkpoints of a campaign trial and of its retries (they share the first's number)."""
    return join(campaign_url, f"trial-{root_trial:05d}")


def trial_stop_url(trial_checkpoint_url: str, attempt: int) -> str:
    """The marker that asks one attempt of a trial to stop after its current epoch."""
    return join(trial_checkpoint_url, f"STOP-{attempt}")


def lease_url(root_url: str) -> str:
    """The lease folder of whatever lives under ``root_url`` (a campaign's checkpoint root)."""
    return join(root_url, "lease")


def training_lease_url(storage_url: str, run_key: str) -> str:
    """The lease folder of the training run with identity ``run_key``; it exists before the
    run's MLflow id (and so its checkpoint folder) is known."""
    return join(storage_url, "leases", "training", run_key)


def predictions_url(root_url: str, fingerprint: str) -> str:
    """A batch scoring's Parquet output for the input files and model version with
    ``fingerprint``."""
    return join(root_url, "predictions", fingerprint)


def predictions_manifest_url(output_url: str) -> str:
    """What a batch scoring wrote (JSON), written after every Parquet file: its presence
    means complete. ``_``-prefixed, so a reader of the folder's data files skips it."""
    return join(output_url, "_SUCCESS")


def predictions_pending_url(output_url: str) -> str:
    """The marker a batch scoring writes before its first file: the folder is ours to clear
    when no manifest follows (a crashed write)."""
    return join(output_url, "_PENDING")


def doctor_url(root_url: str, name: str) -> str:
    """Where ``prefect-ml doctor`` puts its probe objects under ``root_url``: ``.doctor/<name>``,
    one name per node (its Ray node id) and per driver, so a leftover says who wrote it."""
    return join(root_url, ".doctor", name)


def check_url(url: str, field: str) -> str:
    """A user-given base URL without traversal segments (``s3://b/a/../c`` is refused), in each
    URL of an fsspec chain (``zip://a.csv::s3://b/a.zip``)."""
    try:
        for part in url.split("::"):
            check_key(part.rpartition("://")[2].lstrip("/").rstrip("/"))
    except ConfigurationError as exc:
        raise ConfigurationError(field, exc.message) from None
    return url


# Where a dataset may be read from by default: local files and object stores. Other fsspec
# protocols reach other machines on the driver's behalf (http, ftp, sftp, github...): a URL
# parameter from the UI would make the driver fetch from wherever it points (internal services,
# cloud metadata endpoints); they are allowed only through PREFECT_ML_EXTRA_URL_SCHEMES.
DATA_URL_SCHEMES = frozenset(
    {"file", "local", "s3", "s3a", "gs", "gcs", "abfs", "abfss", "az", "memory"}
)


# A scheme without "//" (``data:text/csv,...``, which fsspec opens as inline data); a single
# letter is a Windows drive, not a scheme.
_OPAQUE_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):(?!//)")


def _scheme_and_host(part: str, chained: bool) -> tuple[str, str]:
    scheme, separator, rest = part.partition("://")
    if not separator:  # a local path, a data: URL, or a protocol name inside a chain
        opaque = _OPAQUE_SCHEME.match(part)
        return (opaque[1] if opaque else part if chained else "file").lower(), ""
    return scheme.lower(), rest.split("/", 1)[0].rsplit("@", 1)[-1]


def _check_host(url: str, host: str, field: str) -> None:
    """Refuse a network URL unless its host resolves, and only to public addresses: never
    loopback, private, link-local (cloud metadata) or reserved ones, by name or by number."""
    import ipaddress
    import socket
    from urllib.parse import urlsplit

    try:
        name = urlsplit(f"//{host}").hostname or ""
        literal = {str(ipaddress.ip_address(name))} if _is_ip(name) else set()
        addresses = literal or {str(info[4][0]) for info in socket.getaddrinfo(name, None)}
    except (OSError, UnicodeError, ValueError):
        raise ConfigurationError(
            field, f"the host of {url!r} does not resolve; refused (give a public address)"
        ) from None
    internal = sorted(a for a in addresses if not ipaddress.ip_address(a.split("%")[0]).is_global)
    if internal:
        raise ConfigurationError(
            field,
            f"{url!r} reaches {', '.join(internal)}: loopback, private, link-local (cloud "
            "metadata) or reserved addresses are refused for data",
        )


def _is_ip(name: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def check_data_url(url: str, field: str) -> str:
    """A data URL whose every scheme (``a::b://`` chains included) is allowed, whose network
    hosts resolve to public addresses only, in the places runs may use
    (:func:`check_locations`), without traversal segments."""
    allowed = DATA_URL_SCHEMES | set(get_settings().allowed_extra_url_schemes)
    parts = url.split("::")
    for part in parts:
        scheme, host = _scheme_and_host(part, chained=len(parts) > 1)
        if scheme not in allowed:
            raise ConfigurationError(
                field,
                f"URL scheme {scheme!r} of {url!r} is not allowed for data; use one of "
                f"{sorted(allowed)}, or add it to PREFECT_ML_EXTRA_URL_SCHEMES if the flow may "
                "fetch data from such addresses",
            )
        # The last URL of a chain is where the bytes come from; the others name paths inside
        # it (zip://member) or wrap it (simplecache).
        if scheme not in DATA_URL_SCHEMES and host and part is parts[-1]:
            _check_host(url, host, field)
    check_locations([url], field)
    return check_url(url, field)


# fsspec's aliases of one store: the same objects under two schemes compare equal.
_SCHEME_ALIASES = {"s3a": "s3", "gcs": "gs", "abfss": "abfs", "local": "file"}
_LOCAL_PREFIX = re.compile(r"^(?:file|local):")


def canonical_location(url: str) -> str:
    """Where ``url`` points, comparable by prefix: the last URL of an fsspec chain, a local
    path with its symlinks and ``..`` resolved (``realpath``), a lower-case scheme."""
    last = url.split("::")[-1]
    scheme, separator, rest = last.partition("://")
    if not separator:  # a path; fsspec opens ``file:<path>`` and ``local:<path>`` as the path
        scheme, rest = "file", _LOCAL_PREFIX.sub("", last)
    scheme = _SCHEME_ALIASES.get(scheme.lower(), scheme.lower())
    if scheme == "file":  # fsspec expands a leading ``~`` to a home folder, as expanduser does
        return "file://" + os.path.realpath(os.path.expanduser(rest))
    return f"{scheme}://{rest}"


def is_within(url: str, root: str) -> bool:
    """Whether ``url`` is ``root`` or lies under it (whole path segments, symlinks resolved)."""
    location, base = canonical_location(url), canonical_location(root).rstrip("/")
    return location == base or location.startswith(base + "/")


def check_locations(urls: Sequence[str], field: str) -> None:
    """Raise, naming ``field``, unless runs may read or write at every URL of ``urls``: under
    the storage root (the tenant's folder with a tenant) or a prefix of PREFECT_ML_DATA_PREFIXES
    when either is set; never under a tenant's folder that is not this process's tenant's."""
    settings = get_settings()
    own = root_url(settings)
    roots = (own, *settings.allowed_data_prefixes)
    confined = settings.tenant is not None or bool(settings.allowed_data_prefixes)
    tenants = join(settings.resolved_storage_url, tenancy.STORAGE_FOLDER)
    for url in urls:
        if confined and not any(is_within(url, root) for root in roots):
            raise ConfigurationError(
                field,
                f"{url!r} is outside the places runs may use ({', '.join(roots)}); move the "
                "data there, or ask the operator to add its prefix to PREFECT_ML_DATA_PREFIXES",
            )
        if is_within(url, tenants) and not (settings.tenant and is_within(url, own)):
            raise ConfigurationError(field, f"{url!r} is in a tenant's folder that is not yours")


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
