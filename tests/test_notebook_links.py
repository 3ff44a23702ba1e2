"""What a reader clicks and sees: every relative link in every notebook (and in the
README, the package reference shared/README.md and the instructor guide) points at a
file that exists, and no code cell shows nbval's plumbing (its options are cell tags,
not ``# NBVAL_*`` comments).

`make lab` serves the repository root, so a link resolves exactly as it does on disk.
"""

import re
from pathlib import Path
from urllib.parse import unquote

import nbformat
import pytest

from tinyserve.book.notebooks import NBVAL_TAGS

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted([*ROOT.glob("chapters/**/*.ipynb"), *ROOT.glob("labs/*.ipynb"), *ROOT.glob("solutions/*.ipynb")])
DOCUMENTS = [p for p in (ROOT / "README.md", ROOT / "shared" / "README.md", ROOT / "solutions" / "INSTRUCTOR.md")
             if p.exists()]

# [text](target "title"), ![alt](target), and HTML href= / src= attributes.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)|(?:href|src)=[\"']([^\"']+)[\"']")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.DOTALL)  # links inside code are not links


def relative_links(markdown):
    """Targets of the relative links in a markdown text (no URLs, no in-page anchors)."""
    for m in LINK.finditer(CODE.sub("", markdown)):
        target = m.group(1) or m.group(2)
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
            continue
        yield target


def broken_links(path, texts):
    return [f"{path.relative_to(ROOT)}: {t}" for text in texts for t in relative_links(text)
            if not (path.parent / unquote(t.split("#")[0])).exists()]


def test_the_link_pattern_finds_what_a_reader_can_click():
    text = ('See [03](../chapters/03.ipynb), ![fig](img/a.png "A"), <a href="labs/x.ipynb">x</a>, '
            "[web](https://example.org), [top](#intro), `[not](a/link)` and\n```\n[nor](this)\n```")
    assert list(relative_links(text)) == ["../chapters/03.ipynb", "img/a.png", "labs/x.ipynb"]


@pytest.mark.parametrize("path", [pytest.param(p, id=str(p.relative_to(ROOT))) for p in NOTEBOOKS])
def test_every_relative_link_in_a_notebook_resolves(path):
    nb = nbformat.read(path, as_version=4)
    assert not broken_links(path, [c.source for c in nb.cells if c.cell_type == "markdown"])


@pytest.mark.parametrize("path", [pytest.param(p, id=str(p.relative_to(ROOT))) for p in DOCUMENTS])
def test_every_relative_link_in_a_document_resolves(path):
    assert not broken_links(path, [path.read_text(encoding="utf-8")])


@pytest.mark.parametrize("path", [pytest.param(p, id=str(p.relative_to(ROOT))) for p in NOTEBOOKS])
def test_nbval_options_are_cell_tags_not_comments(path):
    nb = nbformat.read(path, as_version=4)
    shown = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"
             and any(line.strip().lstrip("#").strip() in NBVAL_TAGS
                     for line in c.source.splitlines() if line.strip().startswith("#"))]
    assert not shown, (f"cells {shown} show a # NBVAL_* comment: run "
                       f"`python -m tinyserve.book.notebooks tags {path.relative_to(ROOT)}`")
