"""The README's example of the public API in a user's own flow, run as it is written there (the
site's home page is the same file, so this is the one copy)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

from prefect_ml.integrations import tracking
from prefect_ml.integrations.settings import PrefectMLSettings
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.e2e


def readme_example(folder: Path) -> ModuleType:
    """The README's Python block, as the module a user would save it as."""
    readme = (REPO_ROOT / "README.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", readme, re.MULTILINE | re.DOTALL)
    assert len(blocks) == 1, "the README has one Python example; this test runs it"
    path = folder / "my_flow.py"
    path.write_text(blocks[0])
    spec = importlib.util.spec_from_file_location("my_flow", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.usefixtures("ray_cluster")
def test_the_readme_flow_trains_registers_and_promotes(
    home: PrefectMLSettings, tmp_path: Path
) -> None:
    example = readme_example(tmp_path)
    outcome = example.wine_pipeline(folder=str(tmp_path), epochs=6)
    assert outcome.startswith("wine-classifier v1: "), outcome

    client = tracking.client_for(home.resolved_tracking_uri)
    champion = client.get_model_version_by_alias("wine-classifier", "champion")
    assert str(champion.version) == "1" and champion.run_id is not None
    metrics = client.get_run(champion.run_id).data.metrics
    assert metrics["test_accuracy"] > 0.6, metrics  # 3 classes: a third by chance
    assert (tmp_path / "wine.csv").exists()  # the user's own task ran first
