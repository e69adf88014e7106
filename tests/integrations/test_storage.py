from __future__ import annotations

from pathlib import Path

import numpy as np

from prefect_ml.integrations import storage


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
