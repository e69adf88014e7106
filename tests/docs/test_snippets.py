"""The code on the pages: every Python block at least compiles, and the examples the pages
include from examples/ meet the contracts they show (the README's flow runs in
tests/e2e/test_readme.py, examples/sequence.py in tests/e2e/test_examples.py)."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import torch

from examples import wine
from prefect_ml.integrations import catalog
from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.tasks.params import TrainModelParams

REPO_ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted(
    [*REPO_ROOT.glob("*.md"), *REPO_ROOT.glob("deployments/*.md"), *REPO_ROOT.glob("docs/**/*.md")]
)
BLOCK = re.compile(r"^( *)```python\n(.*?)^\1```", re.MULTILINE | re.DOTALL)
INCLUDE = re.compile(r'^--8<-- "(?P<path>[^"]+)"$', re.MULTILINE)


def included(path: str) -> str:
    """What ``--8<-- "path"`` includes: the file, or with ``path:name`` the lines between its
    ``# --8<-- [start:name]`` and ``# --8<-- [end:name]`` markers (pymdownx.snippets' sections)."""
    path, _, section = path.partition(":")
    text = (REPO_ROOT / path).read_text()
    if not section:
        return text
    start, end = f"# --8<-- [start:{section}]\n", f"# --8<-- [end:{section}]\n"
    assert start in text and end in text, f"{path} has no section {section!r}"
    return text.split(start, 1)[1].split(end, 1)[0]


def python_blocks() -> list[tuple[str, str]]:
    """(where, code) of every Python block on the pages, includes read from their files."""
    blocks = []
    for page in PAGES:
        for number, match in enumerate(BLOCK.finditer(page.read_text())):
            code = textwrap.dedent(match[2])
            code = INCLUDE.sub(lambda m: included(m["path"]), code)
            blocks.append((f"{page.relative_to(REPO_ROOT)}#{number}", code))
    return blocks


def test_the_pages_have_python_blocks() -> None:
    where = {block[0].split("#")[0] for block in python_blocks()}
    assert {"README.md", "docs/tutorials/own-model.md"} <= where


@pytest.mark.parametrize(("where", "code"), [pytest.param(*b, id=b[0]) for b in python_blocks()])
def test_every_python_block_compiles(where: str, code: str) -> None:
    compile(code, where, "exec")


def test_the_own_model_example_meets_the_contracts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFECT_ML_ALLOWED_MODULES", "examples")
    # what `prefect-ml train --dataset examples.wine:load --model examples.wine:build
    # --model-options '{"width": 128}'` parses, with the same checks
    params = TrainModelParams.model_validate(
        {
            "data": {"dataset": "examples.wine:load"},
            "model": {"model": "examples.wine:build", "model_options": {"width": 128}},
        }
    )
    dataset = catalog.load_dataset(params.data.dataset, params.data.dataset_options)
    assert dataset.features.shape == (178, 13) and len(set(dataset.labels.tolist())) == 3
    model = catalog.build_model(params.model.model, dataset.sample_shape, 3, {"width": 128})
    logits = model(torch.from_numpy(dataset.features[:5]))
    assert logits.shape == (5, 3)
    hidden = list(model.children())[1]
    assert isinstance(hidden, torch.nn.Linear) and hidden.out_features == 128  # the option
    assert catalog.resolve_model("examples.wine:build") is wine.build


def test_the_alert_blocks_example_saves_blocks_that_deploy_accepts() -> None:
    from prefect.blocks.notifications import CustomWebhookNotificationBlock, SlackWebhook

    from examples import alert_blocks
    from prefect_ml.integrations import alerts

    alert_blocks.save_alert_blocks()
    alert_blocks.save_alert_blocks()  # again: updated, not refused
    assert SlackWebhook.load("ml-alerts").url.get_secret_value().startswith("https://hooks.")
    custom = CustomWebhookNotificationBlock.load("ml-alerts")
    assert custom.json_data == {"subject": "{{subject}}", "body": "{{body}}"}
    # as the page says: NAME, or TYPE/NAME where several block types share the name
    assert alerts.find_notification_block("slack-webhook/ml-alerts").reference == (
        "slack-webhook/ml-alerts"
    )
    with pytest.raises(ConfigurationError, match="several notification blocks"):
        alerts.find_notification_block("ml-alerts")
