"""A tabular dataset's files: one CSV or Parquet file, a directory of them or a glob, at any
fsspec URL (a path, ``file://``, ``s3://``), described and checked from metadata before a row
is read.

Parquet files are described from their footers (schema and row count, a few KB each, read in
parallel); CSV files from their header line, and their rows are counted by a scan that keeps no
rows. Every file must have the first file's columns with the same types and hold the label
column; the first file that does not is named. A dataset's identity is its files' URLs, sizes
and versions (ETags on S3, modification times on disk), never their bytes: the splits'
fingerprint changes when a file does, at the cost of a listing.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prefect_ml.integrations import storage
from prefect_ml.integrations.errors import ConfigurationError

if TYPE_CHECKING:
    import pyarrow

SUFFIXES = {".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}
# Arrow type names of the columns that can be features.
NUMERIC_TYPES = ("int", "uint", "float", "double", "halffloat", "bool", "decimal")
GLOB_CHARACTERS = "*?["
DESCRIBE_THREADS = 16  # footers read at once


@dataclass(frozen=True)
class SourceFile:
    """One file of a dataset, as listed."""

    url: str
    size: int
    version: str  # the ETag, else the modification time
    rows: int
    columns: dict[str, str]  # name: type (Parquet's Arrow types; "" for CSV)
    row_groups: tuple[int, ...] = ()  # Parquet: the rows of each row group


@dataclass(frozen=True)
class TabularSource:
    """The files of a tabular dataset, checked to share one schema holding the label."""

    url: str
    format: str  # "csv" | "parquet"
    files: list[SourceFile]
    label_column: str

    @property
    def feature_columns(self) -> list[str]:
        return [c for c in self.files[0].columns if c != self.label_column]

    @property
    def rows(self) -> int:
        return sum(f.rows for f in self.files)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def identity(self) -> dict[str, Any]:
        """What names the data in a fingerprint: each file's URL, size and version."""
        return {
            "files": files_digest(self.files),
            "label_column": self.label_column,
            "format": self.format,
        }


def files_digest(files: list[SourceFile]) -> str:
    """The sha256 of the files' URLs, sizes and versions: changes when any file does."""
    listed = [[f.url, f.size, f.version] for f in files]
    return hashlib.sha256(json.dumps(listed).encode()).hexdigest()


def file_format(url: str) -> str | None:
    """``csv`` or ``parquet`` from the URL's suffix; None for any other file."""
    for suffix, fmt in SUFFIXES.items():
        if url.lower().endswith(suffix):
            return fmt
    return None


def list_files(url: str, field: str = "data.url") -> list[tuple[str, dict[str, Any]]]:
    """The CSV and Parquet files at ``url`` (a file, a directory searched recursively, or a
    glob), sorted, with their listing details.

    Raises:
        ConfigurationError: naming ``field``: nothing matches, or CSV and Parquet files are mixed.
    """
    fs, path = storage.filesystem(url)
    fs.invalidate_cache()
    if any(c in path for c in GLOB_CHARACTERS):
        found: dict[str, dict[str, Any]] = fs.glob(path, detail=True)
    elif fs.isdir(path):
        found = fs.find(path, detail=True)
    elif fs.exists(path):
        found = {path: fs.info(path)}
    else:
        found = {}
    files = sorted(
        (fs.unstrip_protocol(name), info)
        for name, info in found.items()
        if info.get("type") != "directory"
        and not name.rsplit("/", 1)[-1].startswith((".", "_"))  # _SUCCESS, .crc, hidden
        and file_format(name) is not None
    )
    if not files:
        raise ConfigurationError(
            field,
            f"{url!r} matches no CSV or Parquet file; give a file, a directory holding .csv or "
            ".parquet files, or a glob such as s3://bucket/data/*.parquet",
        )
    # A file a glob or folder reaches through a link is checked where it really lies.
    storage.check_locations([name for name, _ in files], field)
    formats = {file_format(name) for name, _ in files}
    if len(formats) > 1:
        raise ConfigurationError(
            field, f"{url!r} mixes CSV and Parquet files; point it at one format"
        )
    return files


def _version(info: dict[str, Any]) -> str:
    for key in ("ETag", "etag", "mtime", "LastModified", "created"):
        if info.get(key) is not None:
            return str(info[key])
    return ""


def _describe_file(url: str, info: dict[str, Any]) -> SourceFile:
    import pyarrow.parquet as pq

    with storage.open_file(url) as handle:
        if file_format(url) == "parquet":
            parquet = pq.ParquetFile(handle)
            schema: pyarrow.Schema = parquet.schema_arrow
            columns = {field.name: str(field.type) for field in schema}
            metadata = parquet.metadata
            rows = metadata.num_rows
            groups = tuple(metadata.row_group(g).num_rows for g in range(metadata.num_row_groups))
        else:
            header = handle.readline().decode("utf-8-sig").strip()
            columns = {name.strip().strip('"'): "" for name in header.split(",") if name}
            rows, groups = _count_lines(handle), ()
    return SourceFile(url, int(info.get("size") or 0), _version(info), rows, columns, groups)


def _count_lines(handle: Any) -> int:
    """Lines left in ``handle``, the last one counted without its newline too."""
    lines, last = 0, b"\n"
    for chunk in iter(lambda: handle.read(2**24), b""):
        lines += chunk.count(b"\n")
        last = chunk[-1:]
    return lines + (last != b"\n")


def describe_files(url: str, field: str = "data.url") -> list[SourceFile]:
    """The files at ``url`` (see :func:`list_files`) with their columns and rows, from their
    footers or headers, read in parallel."""
    listed = list_files(url, field)
    with ThreadPoolExecutor(DESCRIBE_THREADS) as pool:
        return list(pool.map(lambda item: _describe_file(*item), listed))


def check_same_columns(files: list[SourceFile], field: str = "data.url") -> None:
    """Raise, naming ``field`` and the first file that differs, unless every file has the first
    file's columns and types."""
    first = files[0]
    for file in files:
        if file.columns != first.columns:
            # Names both files have, with other types; other names are not quoted: a glob may
            # reach a file that is not data, whose first line is a secret.
            shared = [c for c in first.columns if c in file.columns]
            retyped = [c for c in shared if file.columns[c] != first.columns[c]]
            unshared = len(set(file.columns) ^ set(first.columns))
            raise ConfigurationError(
                field,
                f"{file.url} has other columns than {first.url} ({len(file.columns)} columns "
                f"against {len(first.columns)}, {unshared} not in both"
                + (f"; other types: {retyped[:3]}" if retyped else "")
                + "); every file of a dataset must have the same columns and types",
            )


def column_types(file: SourceFile) -> dict[str, str]:
    """The Arrow type of each column of ``file``: Parquet's from its footer; a CSV's as Arrow
    infers them from the file's first block (a MB at most), reading no more."""
    if file_format(file.url) == "parquet":
        return dict(file.columns)
    import pyarrow.csv

    with storage.open_file(file.url) as handle:
        reader = pyarrow.csv.open_csv(
            handle, read_options=pyarrow.csv.ReadOptions(block_size=2**20)
        )
        return {field.name: str(field.type) for field in reader.schema}


def _columns_hint(columns: list[str], wanted: str) -> str:
    """How many columns a file has and, of its names, only those close to ``wanted`` (at most
    three, never all of them): a data URL may name a file that is not data, whose first line
    (a CSV's "header") is a secret, so an error never quotes the header."""
    close = difflib.get_close_matches(wanted, columns, n=3, cutoff=0.7)
    shown = f"; the closest: {close}" if close and len(close) < len(columns) else ""
    return f"which has {len(columns)} column{'s' if len(columns) != 1 else ''}{shown}"


def describe_source(url: str, label_column: str, task: str = "classification") -> TabularSource:
    """The files at ``url`` and their shared schema, from metadata only.

    Raises:
        ConfigurationError: no file, a file without the label column, a file whose columns or
            types differ from the first file's, or a feature column that is not numeric; each
            names the file.
    """
    files = describe_files(url)
    first = files[0]
    for file in files:
        if label_column not in file.columns:
            raise ConfigurationError(
                "data.label_column",
                f"column {label_column!r} is not in {file.url}, "
                f"{_columns_hint(list(file.columns), label_column)}. "
                "Set --label-column to a column every file has.",
            )
    check_same_columns(files)
    fmt = file_format(first.url) or "csv"
    if fmt == "parquet":
        features = {c: t for c, t in first.columns.items() if c != label_column}
        text = [c for c, t in features.items() if not t.startswith(NUMERIC_TYPES)]
        if text:
            raise ConfigurationError(
                "data.url",
                f"feature columns {text} of {first.url} are not numeric; encode or drop them",
            )
        label_type = first.columns[label_column]
        if task == "regression" and not label_type.startswith(NUMERIC_TYPES):
            raise ConfigurationError(
                "data.label_column",
                f"the regression target {label_column!r} is {label_type} in {first.url}, not a "
                "number; use --task classification for class labels",
            )
        # Plain values only: an extension type (Ray's pickled objects, say) would be decoded by
        # code named in the file.
        if not label_type.startswith(
            (*NUMERIC_TYPES, "string", "large_string", "dictionary<values=string")
        ):
            raise ConfigurationError(
                "data.label_column",
                f"the label {label_column!r} is {label_type} in {first.url}; a label must be a "
                "number, a boolean or a string",
            )
    return TabularSource(url, fmt, files, label_column)
