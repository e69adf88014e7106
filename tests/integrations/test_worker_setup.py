"""The worker setup hook's code pinning and content check, run in this process (the real
cluster, with a node that has a partial copy at the driver's path, is in
tests/e2e/test_cluster.py)."""

from __future__ import annotations

import importlib
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import prefect_ml
from prefect_ml.integrations import compute
from prefect_ml.integrations.compute import CodeMismatchError, ExpectedCode
from prefect_ml.integrations.settings import PrefectMLSettings


@pytest.fixture
def isolated_imports(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The finders and modules a test adds are gone afterwards."""
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        del sys.modules[name]


def _expected(**values: object) -> ExpectedCode:
    expected = ExpectedCode(
        shipped=[],
        installed=[],
        project_hash=None,
        project_version="1.2.0",
        excludes=list(compute.EXCLUDES),
    )
    expected.update(values)  # type: ignore[typeddict-item]
    return expected


def test_a_shipped_package_is_imported_from_its_shipped_folder_though_a_copy_comes_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, isolated_imports: None
) -> None:
    """Ray puts the driver's working directory ahead of the shipped folders: a partial copy
    there (its submodule missing) must not be what the worker imports."""
    stale, shipped = tmp_path / "driver-cwd" / "acme_pinned", tmp_path / "pkg" / "acme_pinned"
    for package, origin in ((stale, "stale"), (shipped, "shipped")):
        package.mkdir(parents=True)
        (package / "__init__.py").write_text(f"ORIGIN = {origin!r}\n")
    (shipped / "models.py").write_text("def build() -> str:\n    return 'shipped'\n")
    monkeypatch.syspath_prepend(str(stale.parent))
    monkeypatch.setenv("PYTHONPATH", f"{shipped.parent}:/elsewhere")
    assert importlib.util.find_spec("acme_pinned").origin == str(stale / "__init__.py")

    compute.use_shipped_code(_expected(shipped=["acme_pinned"]))

    models = importlib.import_module("acme_pinned.models")
    assert models.build() == "shipped" and sys.modules["acme_pinned"].ORIGIN == "shipped"


def test_a_package_pinned_to_site_packages_that_is_not_there_is_not_found_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, isolated_imports: None
) -> None:
    """An installed prefect-ml is looked for only in the node's site-packages: a copy at the
    driver's path does not stand in for it."""
    (tmp_path / "acme_installed").mkdir()
    (tmp_path / "acme_installed" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))

    compute.use_shipped_code(_expected(installed=["acme_installed"]))

    with pytest.raises(ModuleNotFoundError, match="No module named 'acme_installed' in .*site"):
        importlib.import_module("acme_installed")


def test_content_hash_is_the_same_through_links_and_changes_with_any_shipped_file(
    tmp_path: Path,
) -> None:
    """The driver hashes the checkout's folder of links; the node hashes the copy Ray unpacked.
    Caches are not shipped, so they do not count."""
    source = tmp_path / "src" / "integrations"
    source.mkdir(parents=True)
    (source / "a.py").write_text("A = 1\n")
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "__init__.py").write_text("")
    (linked / "integrations").symlink_to(source)
    unpacked = tmp_path / "unpacked"
    shutil.copytree(linked, unpacked)  # links followed, as Ray zips them
    (unpacked / "__pycache__").mkdir()
    (unpacked / "__pycache__" / "x.pyc").write_bytes(b"cache")

    def digest(folder: Path) -> str:
        return compute.content_hash(folder, compute.EXCLUDES)

    assert digest(linked) == digest(unpacked)
    (unpacked / "integrations" / "a.py").write_text("A = 2\n")
    assert digest(linked) != digest(unpacked)
    (unpacked / "integrations" / "a.py").write_text("A = 1\n")
    (unpacked / "integrations" / "b.py").write_text("")
    assert digest(linked) != digest(unpacked), "a file more"


def test_a_worker_refuses_a_prefect_ml_that_is_not_the_shipped_one_naming_both(
    monkeypatch: pytest.MonkeyPatch, isolated_imports: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """The driver's own prefect_ml with the hash the driver ships passes; other content is
    refused: importing prefect_ml raises an ImportError naming the folder found, both versions
    and contents, and the fixes (what Ray Train ends a run on), also said on stderr."""
    plan = compute.plan_code(PrefectMLSettings(ray_address="127.0.0.1:1"))
    expected = plan.expected_code(ship_project=True, version="9.9.9")
    assert expected["shipped"][0] == "prefect_ml" and expected["installed"] == []
    assert compute.project_difference(expected) is None

    folder = Path(prefect_ml.__file__).parent
    monkeypatch.setenv("PYTHONPATH", str(folder.parent))
    monkeypatch.delitem(sys.modules, "prefect_ml")  # as in a new worker; restored afterwards
    compute.use_shipped_code({**expected, "shipped": ["prefect_ml"], "project_hash": "f" * 64})

    with pytest.raises(CodeMismatchError) as refused:
        importlib.import_module("prefect_ml")
    message = str(refused.value)
    assert f"imports prefect_ml from {folder} (prefect-ml {prefect_ml.__version__}" in message
    assert f"content {expected['project_hash'][:12]}" in message  # what it found
    assert "not the prefect-ml 9.9.9 the driver shipped (content ffffffffffff)" in message
    assert "PREFECT_ML_SHIP_CODE=always" in message and "install prefect-ml 9.9.9" in message
    assert message.startswith("worker ") and " on node " in message
    assert f"prefect-ml: {message}" in capsys.readouterr().err


def test_the_expected_code_of_a_job_that_uses_the_nodes_prefect_ml() -> None:
    plan = compute.plan_code(PrefectMLSettings(ray_address="127.0.0.1:1"))
    expected = plan.expected_code(ship_project=False, version="1.2.0")
    assert expected["installed"] == ["prefect_ml"] and "prefect_ml" not in expected["shipped"]
    assert expected["project_hash"] is None
