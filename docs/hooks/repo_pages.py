"""Repository files on the site, and links between the repository and the site.

An mkdocs hook (``hooks:`` in mkdocs.yml). A page may include a file of the repository with a
line ``<!-- include: BENCHMARKS.md -->``: the file stays where tools and readers of the checkout
look for it, and the site shows the one copy. Links are written for the checkout (they work on
a code host and in an editor) and translated here for the site:

* a link to a Markdown file under ``docs/`` becomes a link to its page;
* a link to an included file becomes a link to the page that includes it;
* a link to any other file of the repository (a module, a test, a Makefile) becomes its path in
  code font, since the site does not carry the sources;
* a link to a path that does not exist is a warning, which ``mkdocs build --strict`` fails on.
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DOCS = "docs"

log = logging.getLogger("mkdocs.hooks.repo_pages")

INCLUDE = re.compile(r"^<!-- include: (?P<path>\S+) -->$", re.MULTILINE)
LINK = re.compile(r"(?P<bang>!?)\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")
EXTERNAL = re.compile(r"^([a-z][a-z0-9+.-]*:|#)", re.IGNORECASE)

# repo path of an included file -> repo path of the docs page that includes it
_included_by: dict[str, str] = {}


def includes(docs_dir: Path) -> dict[str, str]:
    """Every ``<!-- include: FILE -->`` under ``docs_dir``: FILE -> the including page, both as
    repository paths."""
    found = {}
    for page in sorted(docs_dir.rglob("*.md")):
        for match in INCLUDE.finditer(page.read_text()):
            found[match["path"]] = page.relative_to(ROOT).as_posix()
    return found


def rewrite_links(markdown: str, source: str, page: str, included_by: dict[str, str]) -> str:
    """The links of ``markdown``, written relative to the repository file ``source``, made to
    work on the site page whose repository path is ``page``."""
    page_dir = posixpath.dirname(page)

    def rewrite(match: re.Match[str]) -> str:
        target = match["target"]
        if EXTERNAL.match(target):
            return match[0]
        path, _, anchor = target.partition("#")
        resolved = posixpath.normpath(posixpath.join(posixpath.dirname(source), path))
        fragment = f"#{anchor}" if anchor else ""
        if resolved in included_by:
            resolved = included_by[resolved]
        if resolved.startswith(f"{DOCS}/"):
            relative = posixpath.relpath(resolved, page_dir)
            return f"{match['bang']}[{match['text']}]({relative}{fragment})"
        if not (ROOT / resolved).exists():
            log.warning(f"{source}: link to {target}, which is not in the repository")
            return match[0]
        if match["bang"]:
            log.warning(f"{source}: image {target} is outside {DOCS}/; the site lacks it")
            return match[0]
        text = match["text"].strip("`")
        return f"`{resolved}`" if text == resolved else f"{match['text']} (`{resolved}`)"

    lines, in_fence = [], False
    for line in markdown.splitlines(keepends=True):
        if FENCE.match(line):
            in_fence = not in_fence
        lines.append(line if in_fence else LINK.sub(rewrite, line))
    return "".join(lines)


def expand_includes(markdown: str, page: str, included_by: dict[str, str]) -> str:
    """Each include line replaced by the file's text, its links made to work on ``page``. A page
    that has its own title before the include drops the file's first ``# `` title."""

    def include(match: re.Match[str]) -> str:
        path = match["path"]
        file = ROOT / path
        if not file.is_file():
            log.warning(f"{page}: includes {path}, which is not in the repository")
            return ""
        text = file.read_text()
        if re.search(r"^# ", markdown[: match.start()], re.MULTILINE):
            text = re.sub(r"\A\s*# .*\n", "", text)
        return rewrite_links(text, path, page, included_by)

    return INCLUDE.sub(include, markdown)


def on_files(files: Any, config: Any) -> Any:
    _included_by.clear()
    _included_by.update(includes(Path(config["docs_dir"])))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    docs_dir = Path(config["docs_dir"]).relative_to(ROOT).as_posix()
    source = f"{docs_dir}/{page.file.src_uri}"
    markdown = rewrite_links(markdown, source, source, _included_by)
    return expand_includes(markdown, source, _included_by)


def on_serve(server: Any, config: Any, builder: Any) -> Any:
    """``make docs-serve`` rebuilds when an included file changes, too."""
    for path in includes(Path(config["docs_dir"])):
        server.watch(os.fspath(ROOT / path))
    return server
