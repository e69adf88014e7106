from __future__ import annotations

import os
import posixpath
from pathlib import Path
from urllib.parse import unquote

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from prefect_ml.integrations import storage
from prefect_ml.integrations.errors import ConfigurationError


def test_read_array_rows_reads_a_slice(tmp_path: Path) -> None:
    array = np.arange(60, dtype=np.float32).reshape(10, 2, 3)
    url = (tmp_path / "a.npy").as_uri()
    storage.write_array(url, array)
    assert np.array_equal(storage.read_array_rows(url, 3, 7), array[3:7])
    assert np.array_equal(storage.read_array_rows(url, 8, 20), array[8:])
    assert storage.read_array_rows(url, 10, 12).shape == (0, 2, 3)


def test_write_bytes_leaves_no_staging_files(tmp_path: Path) -> None:
    url = (tmp_path / "deep" / "dir" / "blob.bin").as_uri()
    storage.write_bytes(url, b"one")
    storage.write_bytes(url, b"two")
    assert storage.read_bytes(url) == b"two"
    assert storage.list_names((tmp_path / "deep" / "dir").as_uri()) == ["blob.bin"]


def test_check_writable(tmp_path: Path) -> None:
    url = tmp_path.as_uri()
    assert "writable" in storage.check_writable(url)
    assert storage.list_names(url) == []


# Property-based tests of the validators a flow parameter meets (issue 36): keys joined under a
# prefix, data URLs and outputs (storage.check_data_url), with traversal, percent-encoding,
# backslashes, symlinks, scheme tricks, unicode look-alikes and leading slashes.

_TRICKS = [
    "..",
    ".",
    "%2e%2e",
    "%2E.",
    ".%2e",
    "%252e%252e",
    "..%2f",
    "%2f",
    "%5c",
    "\\",
    "..\\",
    "/",
    "//",
    "\u2024\u2024",
    "\uff0e\uff0e",
    "\u2215",
    "\uff0f",
    "~",
    "a",
    "data",
    "x.csv",
    "file:",
    "s3:",
    ":",
    "%00",
    "\x00",
    "link",
    "C:",
]
_segment = st.one_of(st.sampled_from(_TRICKS), st.text("ab.%2e5cf/\\:", min_size=1, max_size=6))
_key = st.lists(_segment, min_size=1, max_size=5).map("/".join)


@settings(max_examples=400, deadline=None)
@given(key=_key)
@example(key="::")  # fsspec's chain separator: the joined URL would name another filesystem
def test_a_key_that_is_accepted_stays_under_its_prefix(key: str) -> None:
    """Whatever a key holds, once :func:`storage.check_key` accepts it, the URL it joins is under
    the prefix however it is decoded (percent-decoding until nothing changes)."""
    try:
        storage.check_key(key)
    except ConfigurationError:
        return
    joined = storage.join("s3://bucket/prefix", key)
    decoded = joined
    for _ in range(5):
        decoded = unquote(decoded)
    path = decoded.removeprefix("s3://")
    assert "\\" not in path and "\x00" not in path, key
    assert posixpath.normpath(path).startswith("bucket/prefix/"), key
    assert storage.is_within(joined, "s3://bucket/prefix"), key


_SCHEMES = st.sampled_from(
    ["file://", "FILE://", "File://", "file:", "local://", "local:", "s3:/", "S3://", "", "./"]
)


@pytest.fixture
def confined(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """A data prefix holding a file and a link to a folder outside it; the process runs inside
    the prefix (so a relative path would be inside it too)."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "data").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret.csv").write_text("password\n1\n")
    (root / "link").symlink_to(outside, target_is_directory=True)
    monkeypatch.setenv("PREFECT_ML_DATA_PREFIXES", str(root))
    monkeypatch.chdir(root)
    return root.resolve(), outside.resolve()


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(scheme=_SCHEMES, anchor=st.sampled_from(["root", "outside", "none"]), key=_key)
@example(scheme="file:", anchor="outside", key="secret.csv")  # fsspec opens file:<path> as path
@example(scheme="", anchor="root", key="link/secret.csv")  # a symlink out of the prefix
@example(scheme="file://", anchor="none", key="~")  # fsspec opens ~ as the home folder
def test_a_data_url_that_is_accepted_is_opened_under_the_prefix(
    confined: tuple[Path, Path], scheme: str, anchor: str, key: str
) -> None:
    """What :func:`storage.check_data_url` accepts (data URLs and batch outputs alike) is,
    where fsspec opens it, under PREFECT_ML_DATA_PREFIXES with its symlinks resolved."""
    from fsspec.core import url_to_fs

    root, outside = confined
    base = {"root": f"{root}/", "outside": f"{outside}/", "none": ""}[anchor]
    url = f"{scheme}{base}{key}"
    try:
        storage.check_data_url(url, "data.url")
    except ConfigurationError as exc:
        assert exc.field == "data.url"
        return
    except ValueError:  # a NUL byte: refused by the OS layer before any read
        return
    try:
        fs, path = url_to_fs(url)
    except ValueError:  # a scheme fsspec does not know in that case (FILE://): nothing opened
        return
    assert type(fs).__name__ == "LocalFileSystem", url
    opened = Path(os.path.realpath(path))
    assert opened == root or root in opened.parents, (url, opened)


@settings(max_examples=200, deadline=None)
@given(
    scheme=st.sampled_from(
        [
            "http",
            "HTTP",
            "Https",
            "ftp",
            "sftp",
            "github",
            "hdfs",
            "ssh",
            "DATA",
            "data",
            "blockcache",
        ]
    ),
    form=st.sampled_from(
        ["{s}://h/x.csv", "{s}:text/csv,a", "zip://a.csv::{s}://h/a.zip", "{s}::s3://b/k"]
    ),
)
def test_schemes_off_the_allow_list_are_refused_in_any_case_or_position(
    scheme: str, form: str
) -> None:
    url = form.format(s=scheme)
    with pytest.raises(ConfigurationError) as refused:
        storage.check_data_url(url, "output")
    assert refused.value.field == "output"
