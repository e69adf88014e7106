"""User code runs only from a registered plug-in or an allowed module; nothing else is imported."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

from prefect_ml.integrations import plugins
from prefect_ml.integrations.datasets import load_dataset, resolve_dataset, resolve_model
from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.storage import check_data_url


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder on ``sys.path`` holding ``third_party_data`` (it creates ``imported`` when
    imported) and an installed plug-in distribution with entry points."""
    root = tmp_path / "site"
    (root / "third_party_data").mkdir(parents=True)
    (root / "third_party_data" / "__init__.py").write_text(
        f"open({str(tmp_path / 'imported')!r}, 'w').close()\n"
        "def load():\n    return [[0.0], [1.0]], [0, 1]\n"
    )
    (root / "wine_plugin").mkdir()
    (root / "wine_plugin" / "__init__.py").write_text(
        textwrap.dedent(
            """
            from os import system  # reachable through the module, never allowed by it

            def load(rows=20):
                return [[float(i)] for i in range(rows)], [i % 2 for i in range(rows)]

            def build(input_shape, num_classes):
                import torch
                return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(1, num_classes))

            def unregistered():
                return [[0.0]], [0]
            """
        )
    )
    info = root / "wine_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: wine-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[prefect_ml.datasets]\nwine = wine_plugin:load\n\n"
        "[prefect_ml.models]\nwine-net = wine_plugin:build\n"
    )
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delenv("PREFECT_ML_ALLOWED_MODULES", raising=False)
    yield root
    for name in ("third_party_data", "wine_plugin"):
        sys.modules.pop(name, None)


def test_an_unlisted_module_is_refused_without_being_imported(site: Path) -> None:
    with pytest.raises(ConfigurationError) as error:
        resolve_dataset("third_party_data:load")
    assert error.value.field == "data.dataset"
    assert "PREFECT_ML_ALLOWED_MODULES=third_party_data" in error.value.message
    assert "prefect_ml.datasets" in error.value.message
    assert "third_party_data" not in sys.modules
    assert not (site.parent / "imported").exists()


@pytest.mark.parametrize(
    ("name", "field"),
    [
        ("os:system", "data.dataset"),
        ("subprocess:run", "data.dataset"),
        ("builtins:exec", "data.dataset"),
        ("tests.fixturesx.evil:load", "data.dataset"),  # a prefix is a whole module name
    ],
)
def test_standard_library_and_lookalike_prefixes_are_refused(name: str, field: str) -> None:
    with pytest.raises(ConfigurationError, match="is not allowed") as error:
        resolve_dataset(name, {"command": "true"})
    assert error.value.field == field


def test_allowed_prefixes_admit_their_modules(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFECT_ML_ALLOWED_MODULES", "other, third_party_data")
    assert load_dataset("third_party_data:load", {}).class_names == ["0", "1"]


def test_a_function_an_allowed_module_only_imports_is_refused(
    site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREFECT_ML_ALLOWED_MODULES", "wine_plugin")
    with pytest.raises(ConfigurationError, match="defined in 'posix'"):
        resolve_dataset("wine_plugin:system", {"command": "true"})


@pytest.mark.parametrize("name", ["tests.fixtures.user_code:__class__", "a..b:load", ":load"])
def test_names_that_are_not_import_paths_are_refused(name: str) -> None:
    with pytest.raises(ConfigurationError, match="is not an import path"):
        resolve_model(name)


def test_plugins_come_from_entry_points_by_name_or_by_value(site: Path) -> None:
    assert load_dataset("wine", {"rows": 10}).features.shape == (10, 1)
    assert resolve_dataset("wine_plugin:load") is resolve_dataset("wine")
    assert resolve_model("wine-net").__name__ == "build"
    with pytest.raises(ConfigurationError, match="is not allowed"):
        resolve_dataset("wine_plugin:unregistered")


def test_a_plugin_installed_after_the_plugins_were_read_is_found(site: Path) -> None:
    """The entry points are kept between reads (a warm trial worker resolves a model per
    trial), but not past an install: a new ``.dist-info`` folder changes its folder."""
    assert sorted(plugins.registered(plugins.MODEL_GROUP)) == ["wine-net"]
    before = site.stat().st_mtime_ns
    info = site / "late_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: late-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[prefect_ml.models]\nlate-net = wine_plugin:build\n")
    if site.stat().st_mtime_ns == before:  # within one tick of the file system's clock
        os.utime(site, ns=(before + 1, before + 1))

    assert sorted(plugins.registered(plugins.MODEL_GROUP)) == ["late-net", "wine-net"]
    assert resolve_model("late-net").__name__ == "build"


def test_unknown_names_list_the_plugins(site: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"a plug-in of \['wine'\]"):
        resolve_dataset("imagenet")


@pytest.mark.parametrize(
    "url",
    [
        "https://example.com/data.csv",
        "http://127.0.0.1:8080/data.csv",
        "ftp://host/data.csv",
        "github://org:repo@main/data.csv",
        "simplecache::https://example.com/data.csv",
        "zip://data.csv::http://10.0.0.1/a.zip",
    ],
)
def test_data_urls_that_fetch_from_other_hosts_are_refused(url: str) -> None:
    with pytest.raises(ConfigurationError, match="PREFECT_ML_EXTRA_URL_SCHEMES") as error:
        check_data_url(url, "data.url")
    assert error.value.field == "data.url"


@pytest.mark.parametrize(
    "url", ["s3://bucket/a.csv", "gs://b/a.parquet", "abfs://c/a.csv", "/data/a.csv", "file:///a"]
)
def test_object_stores_and_files_are_allowed(url: str) -> None:
    assert check_data_url(url, "data.url") == url


def test_https_once_configured_but_never_link_local(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFECT_ML_EXTRA_URL_SCHEMES", "https,http")
    assert check_data_url("https://93.184.215.14/a.csv", "data.url")  # a public address
    for metadata in ("http://169.254.169.254/latest/meta-data", "https://u@169.254.0.1:8/a.csv"):
        with pytest.raises(ConfigurationError, match="link-local"):
            check_data_url(metadata, "data.url")


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        # Issue 36, finding 8: names of metadata services, and loopback or private by any name.
        ("http://metadata.google.internal/computeMetadata/v1/", "does not resolve|reaches"),
        ("http://instance-data/latest/meta-data/", "does not resolve|reaches"),
        ("http://localhost:8080/a.csv", "reaches 127.0.0.1|reaches ::1"),
        ("http://127.0.0.1/a.csv", "reaches 127.0.0.1"),
        ("http://0x7f000001/a.csv", "reaches 127.0.0.1"),
        ("http://2130706433/a.csv", "reaches 127.0.0.1"),
        ("http://[0:0:0:0:0:0:0:1]:80/a.csv", "reaches ::1"),
        ("http://[::1]:80/a.csv", "not allowed|does not resolve"),  # fsspec splits at "::"
        ("http://[0:0:0:0:0:ffff:a9fe:a9fe]/a.csv", "reaches ::ffff:a9fe:a9fe"),
        ("http://10.0.0.1/a.csv", "reaches 10.0.0.1"),
        ("https://user:pw@192.168.1.1:443/a.csv", "reaches 192.168.1.1"),
        ("http://0.0.0.0/a.csv", "reaches 0.0.0.0"),
        ("simplecache::http://127.0.0.1/a.csv", "reaches 127.0.0.1"),
        ("zip://a.csv::https://10.1.2.3/a.zip", "reaches 10.1.2.3"),
        # A scheme without "//" is a scheme, not a local file.
        ("data:text/csv,a%2Cb", "scheme 'data'"),
        ("DATA:text/csv;base64,YQ==", "scheme 'data'"),
    ],
)
def test_network_urls_that_reach_internal_hosts_or_inline_data_are_refused(
    monkeypatch: pytest.MonkeyPatch, url: str, problem: str
) -> None:
    monkeypatch.setenv("PREFECT_ML_EXTRA_URL_SCHEMES", "https,http,simplecache,zip")
    with pytest.raises(ConfigurationError, match=problem) as refused:
        check_data_url(url, "data.url")
    assert refused.value.field == "data.url"


def test_http_data_is_fetched_without_following_redirects() -> None:
    """A public host that answers 302 to a metadata address is not followed there."""
    from prefect_ml.integrations import storage

    for url in ("https://h.example/a.csv", "simplecache::http://h.example/a.csv"):
        fs, _ = storage.filesystem(url)
        http = getattr(fs, "fs", fs)  # the cache's target filesystem
        assert http.kwargs["allow_redirects"] is False, url
