"""A checkpoint's ``.metadata`` cannot run code, whatever names its pickle refers to.

Pickle protocol 4 resolves dotted names in ``find_class`` (``Class.__init__.__builtins__.get``),
so every payload here is a protocol 4 pickle that, if its first global resolved, would fetch
``exec`` (or ``open``) and run it to create a canary file.
"""

from __future__ import annotations

import importlib
import inspect
import io
import pkgutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from prefect_ml.integrations.errors import CheckpointError
from prefect_ml.integrations.training._distributed_checkpoint import (
    _MetadataUnpickler,
    load_files,
    to_files,
)

# Attribute chains from a class or function to something that runs code when called.
_CHAINS = (
    "__init__.__builtins__.get",
    "__init__.__globals__.get",
    "__builtins__.get",
    "__globals__.get",
    "__call__.__globals__.get",
    "__new__.__self__.__init__.__globals__.get",
)


def _text(value: str) -> bytes:
    encoded = value.encode()
    return b"\x8c" + bytes([len(encoded)]) + encoded  # SHORT_BINUNICODE


def _payload(module: str, name: str, canary: Path) -> bytes:
    """``<module>.<name>("exec")("<create the canary>")`` as a protocol 4 pickle; with a
    ``__globals__.get`` the first call gives ``__builtins__``, so both keys are tried in turn."""
    code = f"open({str(canary)!r}, 'w').close()"
    first = "exec" if "__builtins__" in name else "__builtins__"
    return (
        b"\x80\x04"
        + _text(module)
        + _text(name)
        + b"\x93"  # STACK_GLOBAL: the dotted name
        + _text(first)
        + b"\x85R"  # TUPLE1, REDUCE: get("exec") or get("__builtins__")
        + _text(code)
        + b"\x85R."  # TUPLE1, REDUCE: exec(code)
    )


def _dcp_modules() -> list[str]:
    import torch.distributed.checkpoint as dcp

    names = [dcp.__name__]
    for info in pkgutil.walk_packages(dcp.__path__, prefix=f"{dcp.__name__}."):
        try:
            importlib.import_module(info.name)
        except Exception:  # optional back-ends (e.g. missing extras) cannot be reached either
            continue
        names.append(info.name)
    return names


def _dotted_names() -> Iterator[tuple[str, str]]:
    """Every (module, ``attribute.chain``) reachable from a DCP module's classes and functions."""
    for module_name in _dcp_modules():
        module = importlib.import_module(module_name)
        for attribute, value in vars(module).items():
            if inspect.isclass(value) or inspect.isroutine(value):
                for chain in _CHAINS:
                    yield module_name, f"{attribute}.{chain}"
            elif inspect.ismodule(value):  # ``os.system`` through the module's own import
                yield module_name, f"{attribute}.system"


DOTTED = sorted(set(_dotted_names()))


def test_the_fuzz_covers_every_dcp_module() -> None:
    modules = {module for module, _ in DOTTED}
    assert "torch.distributed.checkpoint.metadata" in modules
    assert "torch.distributed.checkpoint.filesystem" in modules
    assert len(modules) > 20 and len(DOTTED) > 2000


def test_no_dotted_name_of_any_dcp_module_resolves(tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    resolved = []
    for module, name in DOTTED:
        try:
            _MetadataUnpickler(io.BytesIO(_payload(module, name, canary))).load()
        except Exception as exc:  # the refusal is an UnpicklingError; nothing else may happen
            if "is not allowed in a checkpoint's metadata" not in str(exc):
                resolved.append((module, name, repr(exc)))
        else:
            resolved.append((module, name, "loaded"))
        assert not canary.exists(), f"{module}:{name} ran code"
    assert resolved == []


@pytest.mark.parametrize(
    ("module", "name"),
    [
        # The bypass of the issue: the old check admitted any capitalised name of a DCP module.
        ("torch.distributed.checkpoint.filesystem", "FileSystemReader.__init__.__builtins__.get"),
        ("torch.distributed.checkpoint.metadata", "Metadata.__init__.__globals__.get"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo.__init__.__builtins__.get"),
        ("torch", "float32.__class__.__init__.__builtins__.get"),
        ("torch.distributed.checkpoint.filesystem", "os.system"),
    ],
)
def test_a_crafted_metadata_file_is_refused_by_load_files(
    tmp_path: Path, module: str, name: str
) -> None:
    canary = tmp_path / "canary"
    files = to_files({"model": {"w": torch.ones(3)}})
    files[".metadata"] = _payload(module, name, canary)
    with pytest.raises(CheckpointError, match="not allowed in a checkpoint's metadata"):
        load_files(files, {"model": {"w": torch.zeros(3)}})
    assert not canary.exists()


def test_the_os_system_reproduction_of_the_issue_is_refused(tmp_path: Path) -> None:
    """``exec`` reached through a DCP class's builtins, then ``os.system`` (a shell command)."""
    canary = tmp_path / "canary"
    command = f"import os; os.system('touch {canary}')"
    payload = (
        b"\x80\x04"
        + _text("torch.distributed.checkpoint.filesystem")
        + _text("FileSystemReader.__init__.__builtins__.get")
        + b"\x93"
        + _text("exec")
        + b"\x85R"
        + _text(command)
        + b"\x85R."
    )
    files = to_files({"model": {"w": torch.ones(3)}})
    files[".metadata"] = payload
    with pytest.raises(CheckpointError):
        load_files(files, {"model": {"w": torch.zeros(3)}})
    assert not canary.exists()


def test_real_metadata_of_every_kind_still_loads() -> None:
    """The allow-list admits what DCP writes: every dtype, memory formats, bytes values."""
    state = {
        "model": {
            "w": torch.ones(3, 2),
            "half": torch.ones(2, dtype=torch.float16),
            "bf16": torch.ones(2, dtype=torch.bfloat16),
            "ids": torch.arange(3),
            "mask": torch.ones(2, dtype=torch.bool),
            "conv": torch.ones(1, 2, 3, 3).to(memory_format=torch.channels_last),
        },
        "optimizer": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "name": "x"}]},
        "epoch": 4,
    }
    template = {
        "model": {name: torch.zeros_like(value) for name, value in state["model"].items()},
        "optimizer": {"param_groups": [{"lr": 0.0, "betas": (0.0, 0.0), "name": ""}]},
        "epoch": 0,
    }
    load_files(to_files(state), template)
    assert template["epoch"] == 4 and template["optimizer"]["param_groups"][0]["lr"] == 0.1
    assert all(bool((template["model"][n] == v).all()) for n, v in state["model"].items())
