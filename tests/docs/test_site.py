"""The documentation site is built and checked with the code: `make docs`'s strict build, what
the generated reference lists, and the hooks that keep one copy of every text (docs/hooks/)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from prefect_ml.flows.cli import app
from prefect_ml.integrations.settings import PrefectMLSettings
from tests.helpers import docs_hook

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built as `make docs` builds it (strict: any warning fails)."""
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    return out


def page(site: Path, path: str) -> str:
    return (site / path / "index.html").read_text()


def test_the_site_builds_strictly_and_lists_every_command_and_flag(site: Path) -> None:
    cli = page(site, "reference/cli")
    for name, command in app.commands.items():
        section = cli.split(f'id="prefect-ml-{name}"', 1)[1].split("<h2", 1)[0]
        for option in command.params:
            assert option.opts[0] in section or option.human_readable_name in section, (
                f"prefect-ml {name} {option.opts[0]}"
            )


def test_the_parameters_page_lists_every_field_of_every_flow(site: Path) -> None:
    from prefect_ml.tasks import params

    parameters = page(site, "reference/parameters")
    for model in (params.PipelineParams, params.ServeModelParams, params.PredictParams):
        for name, field in model.model_fields.items():
            models = [field.annotation, *typing.get_args(field.annotation)]
            section = next((m for m in models if isinstance(m, type) and m is not type(None)), None)
            for leaf in getattr(section, "model_fields", None) or [name]:
                assert f"<code>{leaf}</code>" in parameters, f"{model.__name__}: {leaf}"


def test_the_settings_page_lists_every_setting(site: Path) -> None:
    settings = page(site, "reference/settings")
    for name in PrefectMLSettings.model_fields:
        assert f"PREFECT_ML_{name.upper()}" in settings


def test_the_api_page_documents_every_public_name(site: Path) -> None:
    import prefect_ml

    api = page(site, "reference/api")
    for name in prefect_ml._EXPORTS:
        assert f'id="prefect_ml.{prefect_ml._EXPORTS[name].split(".", 1)[1]}.{name}"' in api


def test_the_benchmark_figures_are_drawn_from_the_results(site: Path) -> None:
    figure = (site / "explanation" / "figures" / "serving.svg").read_text()
    assert figure.startswith("<?xml") and "requests / s" in figure


def test_a_public_symbol_without_a_docstring_is_found(tmp_path: Path) -> None:
    import griffe

    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text('"""A package."""\n')
    (package / "mod.py").write_text(
        '"""A module."""\n\n'
        "def documented():\n"
        '    """Says what."""\n\n'
        "def bare():\n"
        "    pass\n\n"
        "class Thing:\n"
        '    """A thing."""\n\n'
        "    def method(self):\n"
        "        pass\n\n"
        "    def _private(self):\n"
        "        pass\n"
    )
    loaded = griffe.load("pkg", search_paths=[str(tmp_path)])
    paths = ["pkg.mod.documented", "pkg.mod.bare", "pkg.mod.Thing"]
    assert docs_hook("reference").missing_docstrings(loaded, paths) == [
        "pkg.mod.bare",
        "pkg.mod.Thing.method",
    ]


def test_links_are_made_to_work_on_the_site(caplog: pytest.LogCaptureFixture) -> None:
    pages = docs_hook("repo_pages")
    included_by = {"BENCHMARKS.md": "docs/explanation/benchmarks.md"}
    text = (
        "[S3](docs/how-to/s3.md#credentials) [numbers](BENCHMARKS.md#serving) "
        "[the Makefile](Makefile) [`Makefile`](Makefile) [web](https://example.com) "
        "[gone](nowhere.md)\n```\n[in code](Makefile)\n```\n"
    )
    with caplog.at_level(logging.WARNING):
        rewritten = pages.rewrite_links(
            text, "SCALING.md", "docs/explanation/scaling.md", included_by
        )
    assert rewritten == (
        "[S3](../how-to/s3.md#credentials) [numbers](benchmarks.md#serving) "
        "the Makefile (`Makefile`) `Makefile` [web](https://example.com) "
        "[gone](nowhere.md)\n```\n[in code](Makefile)\n```\n"
    )
    assert "nowhere.md, which is not in the repository" in caplog.text
