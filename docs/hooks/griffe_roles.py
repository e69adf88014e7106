"""A griffe extension for the API reference: the docstrings' Sphinx roles as code.

The docstrings cross-reference with Sphinx's roles (``:func:`~prefect_ml.train```), which
mkdocstrings would print as they are. Each becomes inline code of the name a reader sees: the
last component with ``~``, the whole path without.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|exc|obj):`(?P<tilde>~?)(?P<path>[^`]+)`")


def plain(text: str) -> str:
    """``text`` with every Sphinx role replaced by inline code."""

    def code(match: re.Match[str]) -> str:
        path = match["path"]
        return f"`{path.rsplit('.', 1)[-1] if match['tilde'] else path}`"

    return ROLE.sub(code, text)


class SphinxRolesAsCode(griffe.Extension):
    """Rewrites the docstring of every object griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = plain(obj.docstring.value)
