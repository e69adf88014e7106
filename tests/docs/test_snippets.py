"""The code on the pages runs in the tests, and there is one copy of it: a Python block on a
page is an include (``--8<-- "examples/x.py"``, or ``"examples/x.py:name"`` for a section) of a
file under examples/ that a test runs (RUN_BY says which; the README's block, which GitHub shows
as it is, is run from the page by tests/e2e/test_readme.py), or a block of plain literals that
this module evaluates. A new inline block that nothing runs fails here, saying how to fix it."""

from __future__ import annotations

import ast
import copy
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from examples import gradient_checkpointing, wine
from prefect_ml.integrations import datasets
from prefect_ml.integrations.campaign import tuned_values
from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.tasks.params import TrainModelParams

REPO_ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted(
    [*REPO_ROOT.glob("*.md"), *REPO_ROOT.glob("deployments/*.md"), *REPO_ROOT.glob("docs/**/*.md")]
)
# a fenced block in Python, however its fence and language are written (```python, ~~~py ...)
BLOCK = re.compile(
    r"^( *)(```|~~~)\s*\{?\.?(?:python|py|pycon|python3)\b[^\n]*\n(.*?)^\1\2",
    re.MULTILINE | re.DOTALL,
)
INCLUDE = re.compile(r'^--8<-- "(?P<path>[^"]+)"$', re.MULTILINE)

# Each examples/ file a page includes -> the test file that runs it (imports it, calls it, or
# names it as user code in a command or parameter).
RUN_BY = {
    "examples/alert_blocks.py": "tests/docs/test_snippets.py",
    "examples/best_trial.py": "tests/e2e/test_search_spaces.py",
    "examples/gradient_checkpointing.py": "tests/docs/test_snippets.py",
    "examples/lightning_classifier.py": "tests/e2e/test_lightning.py",
    "examples/lightning_flow.py": "tests/e2e/test_lightning.py",
    "examples/mlflow_users.py": "tests/e2e/test_mlflow_users.py",
    "examples/pipeline_from_python.py": "tests/e2e/test_pipeline.py",
    "examples/search_space.py": "tests/tasks/test_search_spaces.py",
    "examples/sequence.py": "tests/e2e/test_examples.py",
    "examples/serve_several_versions.py": "tests/e2e/test_serving_protocols.py",
    "examples/serving_clients.py": "tests/e2e/test_serving_protocols.py",
    "examples/version_clients.py": "tests/e2e/test_serving_protocols.py",
    "examples/wine.py": "tests/docs/test_snippets.py",
}
# Pages whose inline Python block a test reads from the page itself -> that test.
RUN_FROM_PAGE = {"README.md": "tests/e2e/test_readme.py"}
HOW_TO_FIX = (
    "move the code to a file under examples/ (or a `# --8<-- [start:name]` ... "
    "`# --8<-- [end:name]` section of one), include it in the block with "
    '`--8<-- "examples/x.py"` (or `"examples/x.py:name"`), run it from a test (an existing '
    "one that sets up what it needs, preferably) and add the file and that test to RUN_BY in "
    "tests/docs/test_snippets.py; or make the block plain Python literals, which this test "
    "evaluates"
)


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


@dataclass(frozen=True)
class Block:
    """A Python block of a page: as written there, and with its includes read."""

    page: str
    where: str
    written: str

    @property
    def code(self) -> str:
        return INCLUDE.sub(lambda m: included(m["path"]), self.written)

    @property
    def includes(self) -> list[str] | None:
        """The files it includes, if including is all it does."""
        lines = [line for line in self.written.splitlines() if line.strip()]
        paths = [m["path"].partition(":")[0] for m in map(INCLUDE.fullmatch, lines) if m]
        return paths if paths and len(paths) == len(lines) else None


def python_blocks() -> list[Block]:
    """Every Python block on the pages."""
    blocks = []
    for page in PAGES:
        name = page.relative_to(REPO_ROOT).as_posix()
        for number, match in enumerate(BLOCK.finditer(page.read_text())):
            blocks.append(Block(name, f"{name}#{number}", textwrap.dedent(match[3])))
    return blocks


def literals(code: str) -> list[object] | None:
    """The values of a block made only of Python literals (each statement one); else None."""
    try:
        statements = ast.parse(code).body
    except SyntaxError:
        return None
    if not statements or not all(isinstance(s, ast.Expr) for s in statements):
        return None
    try:
        return [ast.literal_eval(s.value) for s in statements if isinstance(s, ast.Expr)]
    except ValueError:  # a call, a name: code, not a literal
        return None


def references(test_file: str, example: str) -> bool:
    """Whether the test file names the example's module (``examples.x`` or
    ``from examples import x``)."""
    module = Path(example).stem
    text = (REPO_ROOT / test_file).read_text()
    imported = re.search(rf"^\s*from examples import [\w, ]*\b{module}\b", text, re.MULTILINE)
    return bool(imported or re.search(rf"\bexamples\.{module}\b", text))


def test_the_pages_have_python_blocks() -> None:
    pages = {block.page for block in python_blocks()}
    assert {"README.md", "docs/tutorials/own-model.md"} <= pages


@pytest.mark.parametrize("block", [pytest.param(b, id=b.where) for b in python_blocks()])
def test_every_python_block_compiles(block: Block) -> None:
    compile(block.code, block.where, "exec")


def unrun(blocks: list[Block]) -> list[str]:
    """What is wrong with each block that no test runs."""
    found = []
    for block in blocks:
        paths = block.includes
        if paths is not None:
            found += [
                f"{block.where} includes {p}, which RUN_BY lacks" for p in paths if p not in RUN_BY
            ]
        elif block.page not in RUN_FROM_PAGE and literals(block.code) is None:
            found.append(f"{block.where} is inline code that no test runs")
    return found


def test_every_python_block_is_run_by_a_test() -> None:
    problems = unrun(python_blocks())
    assert not problems, f"{'; '.join(problems)}. To fix: {HOW_TO_FIX}"


@pytest.mark.parametrize(("example", "test_file"), sorted(RUN_BY.items()))
def test_each_included_example_is_referenced_by_its_test_and_included_by_a_page(
    example: str, test_file: str
) -> None:
    assert references(test_file, example), f"{test_file} does not run {example} (RUN_BY)"
    including = [b.where for b in python_blocks() if example in (b.includes or [])]
    assert including, f"no page includes {example}: drop it from RUN_BY"


@pytest.mark.parametrize(("page", "test_file"), sorted(RUN_FROM_PAGE.items()))
def test_a_page_run_from_the_page_is_read_by_its_test(page: str, test_file: str) -> None:
    assert f'"{page}"' in (REPO_ROOT / test_file).read_text(), f"{test_file} does not read {page}"


def test_a_new_inline_block_or_an_unregistered_example_is_found() -> None:
    page = 'text\n\n  ~~~py title="x.py"\n  print(1)\n  ~~~\n\n```python\nx = 2\n```\n'
    assert [textwrap.dedent(m[3]) for m in BLOCK.finditer(page)] == ["print(1)\n", "x = 2\n"]
    inline = Block("docs/x.md", "docs/x.md#0", "from prefect_ml import train\ntrain(data)\n")
    mixed = Block("docs/x.md", "docs/x.md#1", '--8<-- "examples/wine.py"\nprint(1)\n')
    unknown = Block("docs/x.md", "docs/x.md#2", '--8<-- "examples/new.py:part"\n')
    known = Block("docs/x.md", "docs/x.md#3", '--8<-- "examples/wine.py:load"\n')
    plain = Block("docs/x.md", "docs/x.md#4", '{"lr": 0.01}\n[1, 2]\n')
    assert unrun([inline, mixed, unknown, known, plain]) == [
        "docs/x.md#0 is inline code that no test runs",
        "docs/x.md#1 is inline code that no test runs",  # code beside an include is inline
        "docs/x.md#2 includes examples/new.py, which RUN_BY lacks",
    ]
    assert literals(plain.code) == [{"lr": 0.01}, [1, 2]]
    assert literals('{"lr": 0.01}\nx = 1\n') is None and literals("train(data)") is None
    assert references("tests/docs/test_snippets.py", "examples/wine.py")
    assert not references("tests/docs/test_site.py", "examples/wine.py")


def test_the_names_a_search_space_may_return_are_the_same_written_three_ways() -> None:
    """docs/how-to/search-spaces.md: "these three are the same"."""
    (block,) = [
        b
        for b in python_blocks()
        if b.page == "docs/how-to/search-spaces.md" and literals(b.code) is not None
    ]
    values = literals(block.code)
    assert values is not None and len(values) == 3
    flat = [tuned_values(value, source=block.where) for value in values]
    assert flat[0] == flat[1] == flat[2] == {"lr": 0.01, "model_options.widths": [64, 32]}


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
    dataset = datasets.load_dataset(params.data.dataset, params.data.dataset_options)
    assert dataset.features.shape == (178, 13) and len(set(dataset.labels.tolist())) == 3
    model = datasets.build_model(params.model.model, dataset.sample_shape, 3, {"width": 128})
    logits = model(torch.from_numpy(dataset.features[:5]))
    assert logits.shape == (5, 3)
    hidden = list(model.children())[1]
    assert isinstance(hidden, torch.nn.Linear) and hidden.out_features == 128  # the option
    assert datasets.resolve_model("examples.wine:build") is wine.build


def test_the_alert_blocks_example_saves_blocks_that_deploy_accepts() -> None:
    from prefect.blocks.notifications import CustomWebhookNotificationBlock, SlackWebhook

    from examples import alert_blocks
    from prefect_ml.integrations import services

    alert_blocks.save_alert_blocks()
    alert_blocks.save_alert_blocks()  # again: updated, not refused
    assert SlackWebhook.load("ml-alerts").url.get_secret_value().startswith("https://hooks.")
    custom = CustomWebhookNotificationBlock.load("ml-alerts")
    assert custom.json_data == {"subject": "{{subject}}", "body": "{{body}}"}
    # as the page says: NAME, or TYPE/NAME where several block types share the name
    assert services.find_notification_block("slack-webhook/ml-alerts").reference == (
        "slack-webhook/ml-alerts"
    )
    with pytest.raises(ConfigurationError, match="several notification blocks"):
        services.find_notification_block("ml-alerts")


def _one_step(
    model: gradient_checkpointing.Net, features: torch.Tensor, labels: torch.Tensor
) -> tuple[int, list[torch.Tensor]]:
    """One SGD step in training mode: how often the blocks' layers ran, and the gradients."""
    calls: list[None] = []
    for layer in model.blocks.modules():
        if isinstance(layer, torch.nn.Linear):
            layer.register_forward_hook(lambda *_: calls.append(None))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train()
    torch.nn.functional.cross_entropy(model(features), labels).backward()
    gradients = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    optimizer.step()
    return len(calls), gradients


def test_the_gradient_checkpointing_example_trains_a_step_recomputing_its_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """docs/how-to/gpus.md's model: enabled as a run with --gradient-checkpointing enables it,
    each block runs again in backward, and the step's gradients and weights are the same."""
    monkeypatch.setenv("PREFECT_ML_ALLOWED_MODULES", "examples")
    torch.manual_seed(0)
    plain = datasets.build_model("examples.gradient_checkpointing:build", (8, 8), 10, {"blocks": 3})
    assert isinstance(plain, gradient_checkpointing.Net)
    checkpointed = copy.deepcopy(plain)
    assert datasets.enable_gradient_checkpointing(checkpointed) is checkpointed
    features, labels = torch.randn(32, 8, 8), torch.randint(0, 10, (32,))
    plain_calls, plain_gradients = _one_step(plain, features, labels)
    checkpointed_calls, checkpointed_gradients = _one_step(checkpointed, features, labels)
    assert (plain_calls, checkpointed_calls) == (3, 6)  # recomputed in backward, not kept
    assert len(plain_gradients) == len(list(plain.parameters()))
    for gradient, recomputed in zip(plain_gradients, checkpointed_gradients, strict=True):
        torch.testing.assert_close(gradient, recomputed)
    for weight, stepped in zip(plain.parameters(), checkpointed.parameters(), strict=True):
        torch.testing.assert_close(weight, stepped)
    with torch.no_grad():  # evaluation and serving run it plainly
        torch.testing.assert_close(checkpointed.eval()(features), plain.eval()(features))
