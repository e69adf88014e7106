"""The reference pages and the benchmark figures, generated from the code at every build.

An mkdocs hook (``hooks:`` in mkdocs.yml). Nothing here is written by hand twice: the CLI page
is read from the click app, the settings page from ``PrefectMLSettings``, the parameters page
from the flows' pydantic models, the API page from ``prefect_ml``'s exports (rendered by
mkdocstrings from the docstrings), the figures from ``benchmarks/results``. A public symbol
without a docstring is a warning, which ``mkdocs build --strict`` turns into a failed build.
"""

from __future__ import annotations

import inspect
import logging
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `mkdocs` run as a script has its bin folder first, not ROOT
    sys.path.insert(0, str(ROOT))

log = logging.getLogger("mkdocs.hooks.reference")

# The user contracts beside ``prefect_ml.__all__``: the functions and modules users write.
CONTRACTS = {
    "prefect_ml.integrations.contracts": "What your own code implements",
    "prefect_ml.integrations.contracts.DatasetLoader": "A dataset loader",
    "prefect_ml.integrations.contracts.ModelFactory": "A model factory",
    "prefect_ml.integrations.contracts.TrainingModule": "Your own training step",
    "prefect_ml.integrations.contracts.ModelParallelHooks": "Tensor and pipeline parallel",
    "prefect_ml.integrations.contracts.SearchSpace": "A campaign's search space",
}

DEFAULT_IN_HELP = re.compile(r"\s*\[default: ([^\]]*)\]")

# The CLI command that runs each flow.
CLI_FLOWS = {
    "run": "ml-pipeline",
    "train": "train-model",
    "sweep": "hpo-campaign",
    "serve": "serve-model",
    "predict": "batch-predict",
}

# Each flow and the model of its one parameter, ``params``.
FLOWS = {
    "ml-pipeline": ("prefect_ml.flows.pipeline:ml_pipeline", "PipelineParams"),
    "train-model": ("prefect_ml.flows.train:train_model", "TrainModelParams"),
    "hpo-campaign": ("prefect_ml.flows.sweep:hpo_campaign", "CampaignParams"),
    "serve-model": ("prefect_ml.flows.serve:serve_model", "ServeModelParams"),
    "batch-predict": ("prefect_ml.flows.predict:batch_predict", "PredictParams"),
}


def _cell(text: Any) -> str:
    """One Markdown table cell: no line breaks, no column separators."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _code(value: Any) -> str:
    text = _cell(value)
    return f"`{text}`" if text else "—"


def _type_name(annotation: Any) -> str:
    """``int``, ``str | None``, ``Literal['adam', 'sgd']`` as a reader writes them."""
    if annotation is type(None):
        return "None"
    if isinstance(annotation, type) and not typing.get_args(annotation):
        return annotation.__name__
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is typing.Literal:
        return " \\| ".join(repr(arg) for arg in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(arg) for arg in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(_type_name(arg) for arg in args)}]"
    return str(annotation).replace("typing.", "")


def _default(field: Any) -> str:
    if field.is_required():
        return "required"
    default = field.get_default(call_default_factory=True)
    if default is None:
        return "—"
    if hasattr(default, "model_dump"):
        return "(section defaults)"
    return _code(default.value if hasattr(default, "value") else default)


# --- CLI ---------------------------------------------------------------------------------


def _flag_sections(flow: str) -> dict[str, str]:
    """CLI option name -> the parameters page's section that documents it, for the command
    that runs ``flow``: ``training`` for a field of the training section; the flow's own name
    for a field of a flat model (batch-predict); none for a top-level field, which the
    command's own table shows."""
    from prefect_ml.tasks import params

    model = getattr(params, FLOWS[flow][1])
    owners = {}
    for name, field in model.model_fields.items():
        section = _section_model(field.annotation)
        if section is not None:
            owners.update(dict.fromkeys(section.model_fields, name))
        elif not any(_section_model(f.annotation) for f in model.model_fields.values()):
            owners[name] = flow
    return owners


def _section_model(annotation: Any) -> Any:
    from pydantic import BaseModel

    candidates = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    first = candidates[0]
    return first if isinstance(first, type) and issubclass(first, BaseModel) else None


def _option_default(option: Any) -> Any:
    """What an option defaults to when not given, or "" where nothing is set (None, click's
    unset sentinel, an empty tuple, a boolean switch's off)."""
    default = option.default
    if default is None or default == () or "UNSET" in repr(default):
        return ""
    return default


def cli_page() -> str:
    import click

    from prefect_ml.flows.cli import app

    lines = [
        "# CLI",
        "",
        "Generated from the `prefect-ml` command itself (`flows/cli/`), as `--help` prints it.",
        "Flags that set a flow parameter mirror its name in kebab-case "
        "(`training.batch_size` → `--batch-size`); their types, defaults and checks are on the "
        "[parameters page](parameters.md). Mapping-valued options take inline JSON or YAML, or "
        "the path of a JSON/YAML file; booleans come in pairs (`--use-gpu/--no-use-gpu`). "
        "Invalid values exit with status 2 and a table naming each bad parameter, before any "
        "Ray, MLflow or storage resource is touched.",
        "",
        "```text",
        _cell(app.help or ""),
        "```",
        "",
    ]
    for name, command in app.commands.items():
        sections = _flag_sections(CLI_FLOWS[name]) if name in CLI_FLOWS else {}
        lines += [f"## prefect-ml {name}", "", inspect.cleandoc(command.help or ""), ""]
        own: list[click.Option] = []
        by_section: dict[str, list[str]] = {}
        for option in command.params:
            if not isinstance(option, click.Option):
                continue
            section = sections.get(option.name or "")
            if section:
                by_section.setdefault(section, []).append(option.opts[0])
            else:
                own.append(option)
        arguments = [p.human_readable_name for p in command.params if isinstance(p, click.Argument)]
        if arguments:
            lines += [f"Arguments: {', '.join(f'`{a}`' for a in arguments)}.", ""]
        if own:
            lines += ["| option | default | meaning |", "|---|---|---|"]
            for option in own:
                if not option.help:
                    log.warning(f"prefect-ml {name} {option.opts[0]}: an option without help")
                flags = " / ".join(f"`{flag}`" for flag in [*option.opts, *option.secondary_opts])
                in_help = DEFAULT_IN_HELP.search(option.help or "")
                help_text = DEFAULT_IN_HELP.sub("", option.help or "")
                default = (
                    in_help[1] if in_help and in_help[1] != "None" else _option_default(option)
                )
                lines.append(f"| {flags} | {_code(default)} | {_cell(help_text)} |")
            lines.append("")
        for section, section_flags in by_section.items():
            shown = ", ".join(f"`{flag}`" for flag in section_flags)
            lines += [
                f"The [`{section}` section](parameters.md#{section})'s flags: {shown}.",
                "",
            ]
    return "\n".join(lines)


# --- Settings ----------------------------------------------------------------------------


def settings_page() -> str:
    from prefect_ml.integrations.settings import PrefectMLSettings

    prefix = PrefectMLSettings.model_config.get("env_prefix", "")
    lines = [
        "# Settings",
        "",
        "Every `PREFECT_ML_*` environment variable, generated from the settings model "
        "`PrefectMLSettings` (`integrations/settings.py`, read by pydantic-settings). The "
        "ecosystem's own variables that prefect-ml honours (`MLFLOW_TRACKING_URI`, "
        "`PREFECT_API_URL`, the AWS chain) are on [Configuration](../how-to/configuration.md).",
        "",
        "| variable | type | default | meaning |",
        "|---|---|---|---|",
    ]
    for name, field in PrefectMLSettings.model_fields.items():
        variable = f"{prefix}{name}".upper()
        meaning = field.description or field.title or ""
        lines.append(
            f"| `{variable}` | {_type_name(field.annotation)} | {_default(field)} | "
            f"{_cell(meaning)} |"
        )
    return "\n".join(lines) + "\n"


# --- Flow parameters ---------------------------------------------------------------------


def _field_rows(model: Any) -> list[str]:
    rows = ["| field | CLI flag | type | default | meaning |", "|---|---|---|---|---|"]
    for name, field in model.model_fields.items():
        flag = "--" + name.replace("_", "-")
        constraints = ", ".join(
            str(m) for m in field.metadata if type(m).__module__.startswith("annotated_types")
        )
        meaning = " ".join(
            filter(None, [field.description, f"({constraints})" * bool(constraints)])
        )
        rows.append(
            f"| `{name}` | `{flag}` | {_type_name(field.annotation)} | {_default(field)} | "
            f"{_cell(meaning)} |"
        )
    return rows


def parameters_page() -> str:
    from prefect_ml.tasks import params

    lines = [
        "# Flow parameters",
        "",
        "Every flow takes one parameter, `params`: a pydantic model of nested sections, which "
        "the Prefect UI renders as a [form](../how-to/deployments.md#parameter-forms). The "
        "CLI's flags and the public tasks' keyword options are the same fields. Generated from "
        "`tasks/params.py` and `integrations/config/`.",
        "",
        "| flow | entrypoint | `params` | sections |",
        "|---|---|---|---|",
    ]
    sections: dict[str, Any] = {}
    for flow, (entrypoint, model_name) in FLOWS.items():
        model = getattr(params, model_name)
        names = []
        for name, field in model.model_fields.items():
            section = _section_model(field.annotation)
            if section is not None:
                sections.setdefault(name, section)
                optional = type(None) in typing.get_args(field.annotation)
                names.append(f"[`{name}`](#{name})" + (" (optional)" if optional else ""))
        shown = ", ".join(names) or "flat: [below](#batch-predict)"
        lines.append(f"| `{flow}` | `{entrypoint}` | `{model_name}` | {shown} |")
    lines.append("")
    top = params.TrainingSections.model_fields["experiment"]
    lines += [
        "The training flows also take `experiment` "
        f"(default {_default(top)}): {_cell(top.description)}",
        "",
    ]
    for name, section in sections.items():
        doc = (section.__doc__ or "").strip()
        lines += [f"## {name}", "", f"`{section.__name__}`: {_cell(doc)}", ""]
        lines += _field_rows(section)
        lines.append("")
    lines += ["## batch-predict", "", f"`PredictParams`: {_cell(params.PredictParams.__doc__)}", ""]
    lines += _field_rows(params.PredictParams)
    return "\n".join(lines) + "\n"


# --- Public API --------------------------------------------------------------------------


def _exports() -> dict[str, str]:
    import prefect_ml

    return dict(prefect_ml._EXPORTS)


def api_page() -> str:
    groups = {
        "Tasks": lambda name, module: ".tasks." in module and name[0].islower(),
        "Results": lambda name, module: ".tasks." in module and name[0].isupper(),
        "Flows": lambda name, module: ".flows." in module,
        "Settings and errors": lambda name, module: ".integrations." in module,
    }
    lines = [
        "# Python API",
        "",
        "What `prefect_ml.__all__` lists is the public, versioned API ([what is stable]"
        "(../how-to/own-flows.md#what-is-stable)); import it from `prefect_ml`. Generated from "
        "the docstrings.",
        "",
    ]
    exports = _exports()
    for title, belongs in groups.items():
        lines += [f"## {title}", ""]
        for name, module in exports.items():
            if belongs(name, module) and f"{module}.{name}" not in CONTRACTS:
                lines += [f"::: {module}.{name}", ""]
    lines += [
        "## User contracts",
        "",
        "What your own code implements. Models and datasets are named by import path or "
        "entry point (`prefect_ml.models`, `prefect_ml.datasets`).",
        "",
    ]
    for path, title in CONTRACTS.items():
        lines += [f"### {title}", "", f"::: {path}", "    options:", "      heading_level: 4"]
        if path.rsplit(".", 1)[-1].islower():  # a module: its docstring states the contract
            lines.append("      members: false")
        lines.append("")
    return "\n".join(lines)


def public_objects() -> list[str]:
    """The dotted paths of every public symbol the API page documents."""
    return [f"{module}.{name}" for name, module in _exports().items()] + list(CONTRACTS)


def missing_docstrings(package: Any, paths: list[str]) -> list[str]:
    """The public symbols among ``paths`` (and their public methods) that have no docstring,
    read by griffe from ``package`` (a loaded griffe module)."""
    missing = []
    for path in paths:
        obj = package[path.split(".", 1)[1]]
        if not obj.docstring:
            missing.append(path)
        if obj.is_class:
            for member_name, member in obj.members.items():
                if member_name.startswith("_") or member.is_alias or not member.is_function:
                    continue
                if not member.docstring:
                    missing.append(f"{path}.{member_name}")
    return missing


def check_docstrings() -> None:
    import griffe

    package = griffe.load("prefect_ml", search_paths=[str(ROOT)], resolve_aliases=False)
    for path in missing_docstrings(package, public_objects()):
        log.warning(f"public symbol without a docstring: {path}")


# --- Hook --------------------------------------------------------------------------------

PAGES = {
    "reference/cli.md": cli_page,
    "reference/settings.md": settings_page,
    "reference/parameters.md": parameters_page,
    "reference/api.md": api_page,
}


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    from benchmarks import figures

    check_docstrings()
    for uri, render in PAGES.items():
        files.append(File.generated(config, uri, content=render()))
    for name, svg in figures.render_all(ROOT / "benchmarks" / "results").items():
        files.append(File.generated(config, f"explanation/figures/{name}.svg", content=svg))
    return files
