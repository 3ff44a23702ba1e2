"""What the website holds, and one Sphinx build of it.

The site is built from the committed, executed notebooks as they are (nothing is
executed). Sphinx reads a staging folder, ``BUILD/src``, that mirrors the
repository's layout with copies of the pages and of the files they link to (so
every relative link resolves exactly as it does on disk and in ``make lab``), plus
two generated files: the claims page
(from ``tinyserve.book.claims.CHAPTER``) and jieba's word list for the Chinese
search index (the README's glossary). The HTML lands in ``BUILD/html``.

Every build is a fresh one, with warnings as errors: an incremental Sphinx build
reports the warnings of the pages it re-reads only, and a page left over from a
teacher's build must never stay in a reader's site.
"""

from __future__ import annotations

import io
import json
import os
import posixpath
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[4]
CHAPTER_DIR = "chapters/ch05_engine_and_scheduling"
CLAIMS_PAGE = "claims.md"
# Where "在 JupyterLab 中打开" points: `make lab` serves the repository root there.
LAB_URL = "http://127.0.0.1:8888/lab/tree/"


@dataclass(frozen=True)
class Section:
    """One group of the sidebar: a caption and its pages (repository-relative paths)."""

    caption: str
    pages: tuple[str, ...]


def sections(root: Path = ROOT, teacher: bool = False) -> list[Section]:
    """The sidebar in reading order; the answers and the instructor guide only for a teacher."""
    found = [
        Section("本章笔记本", tuple(sorted(p.relative_to(root).as_posix()
                                      for p in (root / CHAPTER_DIR).glob("[0-9][0-9]_*.ipynb")))),
        Section("实验", tuple(sorted(p.relative_to(root).as_posix() for p in (root / "labs").glob("lab*.ipynb")))),
        Section("参考", (CLAIMS_PAGE, "shared/README.md")),
    ]
    if teacher:
        found.append(Section("教师版", ("solutions/INSTRUCTOR.md", *sorted(
            p.relative_to(root).as_posix() for p in (root / "solutions").glob("lab*.ipynb")))))
    return found


def all_pages(root: Path = ROOT) -> set[str]:
    """Every page the site can have (a teacher's build), by repository path."""
    return {"README.md", *(p for s in sections(root, teacher=True) for p in s.pages)}


def docname(page: str) -> str:
    """Sphinx's name of a page: its repository path without the suffix."""
    return page.rsplit(".", 1)[0]


def repo_path(page: str, target: str) -> str:
    """A link's ``target`` (relative to ``page``, fragment dropped) as a repository path."""
    target = target.split("#", 1)[0]
    return posixpath.normpath(posixpath.join(posixpath.dirname(page), target))


# ------------------------------------------------------------------ generated pages


def claims_page(chapter_dir: str = CHAPTER_DIR, root: Path = ROOT) -> str:
    """The chapter's claims as a page: the registry's table, each notebook linked."""
    from tinyserve.book.claims import CHAPTER, markdown_table

    names = {p.name[:2]: p.name for p in (root / chapter_dir).glob("[0-9][0-9]_*.ipynb")}
    table = markdown_table(lambda nb: f"{chapter_dir}/{names[nb]}" if nb in names else None)
    return (f"# 本章的 {len(CHAPTER)} 个论断\n\n"
            "教材第 5 章的每个论断在这里都有编号，并落到某一篇笔记本里：先从第一性原理预测，再在本机测量"
            "（或在模拟器里、按数据手册推算），笔记本里打印 ✓ 或 ✗ 以及数字。下表由论断的登记表"
            "（`tinyserve.book.claims.CHAPTER`）在构建网站时生成。\n\n"
            "在你自己的机器上逐条测一遍：`make claims`（打印这台机器上的结论表，并写出 `claims.json`）。\n\n"
            f"{table}\n")


GLOSSARY_HEADING = "## 术语表"


def glossary_terms(readme: str) -> list[str]:
    """The Chinese terms of the README's glossary (its first column), for jieba's word list."""
    if GLOSSARY_HEADING not in readme:
        raise ValueError(f"README.md has no {GLOSSARY_HEADING!r} section to take search terms from")
    block = readme.split(GLOSSARY_HEADING, 1)[1].split("\n## ", 1)[0]
    terms = []
    for line in block.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or set(cells[0]) <= set("- ") or cells[0] == "中文":
            continue
        for term in re.split(r"\s*/\s*", cells[0]):
            if re.fullmatch(r"[\u4e00-\u9fff]{2,}", term) and term not in terms:
                terms.append(term)
    return terms


# ------------------------------------------------------------------ staging


# [text](target), ![alt](target) and href=/src= in a page's Markdown; code spans are not links.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)|(?:href|src)=[\"']([^\"']+)[\"']")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.DOTALL)


def markdown_of(path: Path) -> str:
    """A page's Markdown: the file itself, or a notebook's markdown cells."""
    text = path.read_text(encoding="utf-8")
    if path.suffix != ".ipynb":
        return text
    return "\n\n".join("".join(c["source"]) if isinstance(c["source"], list) else c["source"]
                       for c in json.loads(text)["cells"] if c["cell_type"] == "markdown")


def relative_links(markdown: str) -> list[str]:
    """The relative link targets of a Markdown text (no URLs, no in-page anchors, no fragments)."""
    found = []
    for m in LINK.finditer(CODE.sub("", markdown)):
        target = (m.group(1) or m.group(2)).split("#", 1)[0]
        if target and not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):
            found.append(target)
    return found


def stage(build_dir: Path, groups: list[Section], root: Path = ROOT) -> Path:
    """``build_dir/src``: copies of the pages and of the files they link to (at their
    repository paths), the claims page, and jieba's word list beside it. Returns the folder.

    Copies, not symlinks: Sphinx resolves symlinks when it follows a link, and a page
    reached through one is no longer found as a page."""
    src = build_dir / "src"
    if src.is_symlink() or src.is_file():
        src.unlink()
    elif src.exists():
        shutil.rmtree(src)
    src.mkdir(parents=True)
    pages = ["README.md", *(p for s in groups for p in s.pages if p != CLAIMS_PAGE)]
    everything = all_pages(root)
    files = set(pages)
    for page in pages:
        for target in relative_links(markdown_of(root / page)):
            path = repo_path(page, unquote(target))
            if path not in everything and not path.startswith("..") and (root / path).is_file():
                files.add(path)          # a file a page links to (a download), not a page
    for path in sorted(files):
        (src / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / path, src / path)
    if any(CLAIMS_PAGE in s.pages for s in groups):
        (src / CLAIMS_PAGE).write_text(claims_page(root=root), encoding="utf-8")
    words = glossary_terms((root / "README.md").read_text(encoding="utf-8"))
    (build_dir / "search_words.txt").write_text("".join(f"{w} 1000\n" for w in words), encoding="utf-8")
    return src


def config(build_dir: Path, groups: list[Section], lab_url: str, root: Path = ROOT) -> dict:
    """The Sphinx configuration (there is no conf.py: this dict is all of it)."""
    pages = ["README.md", *(p for s in groups for p in s.pages)]
    return {
        "project": "tinyserve：第 5 章《引擎与调度》配套实践",
        "author": "tinyserve",
        "copyright": "tinyserve contributors (MIT)",
        "language": "zh_CN",
        "root_doc": "README",
        "extensions": [
            "myst_nb",                    # .ipynb and .md pages (MyST), outputs as committed
            "sphinx_copybutton",
            "sphinx.ext.mathjax",
            "sphinx-mathjax-offline",     # MathJax 3 served from _static/mathjax, no CDN
            "sphinx.ext.githubpages",     # .nojekyll
            "tinyserve.book.site.extension",
        ],
        "include_patterns": pages,
        "exclude_patterns": [],
        "nb_execution_mode": "off",
        "nb_output_stderr": "show",
        "nb_render_markdown_format": "myst",   # notebook 00's claims table links the notebooks
        "myst_enable_extensions": ["dollarmath", "amsmath"],
        "myst_heading_anchors": 3,
        "myst_heading_slug_func": "github",  # the README's #anchors are GitHub's
        "html_theme": "sphinx_book_theme",
        "html_title": "tinyserve · 第 5 章 引擎与调度",
        "html_theme_options": {
            "home_page_in_toc": True,
            "show_navbar_depth": 1,
            "show_toc_level": 2,
            "toc_title": "本页内容",
            "use_download_button": True,
            "use_fullscreen_button": False,
        },
        "html_copy_source": True,
        "html_show_sourcelink": False,
        "html_last_updated_fmt": None,
        "html_search_language": "zh",
        "html_search_options": {"dict": str(build_dir / "search_words.txt")},
        # Copy what a reader types (cell inputs, commands in the README), not outputs.
        "copybutton_selector": "div:not(.output) > div.highlight pre",
        "copybutton_exclude": ".linenos, .gp, .go",
        "tinyserve_sections": [(s.caption, [docname(p) for p in s.pages]) for s in groups],
        "tinyserve_lab_url": lab_url,
        "tinyserve_root": str(root),
        "tinyserve_all_pages": sorted(all_pages(root)),
    }


REDIRECT = """<!DOCTYPE html>
<html lang="zh-CN"><head><meta charset="utf-8"><title>tinyserve</title>
<meta http-equiv="refresh" content="0; url=README.html"></head>
<body><p><a href="README.html">tinyserve：第 5 章《引擎与调度》配套实践</a></p></body></html>
"""


def build(build_dir: Path | str = ROOT / "_build", teacher: bool = False, pages: list[str] | None = None,
          lab_url: str = LAB_URL, root: Path = ROOT, quiet: bool = False) -> Path:
    """Build the site into ``build_dir/html`` with warnings as errors; returns that folder.

    ``pages``: only these repository-relative pages besides the README (a small
    build with the same configuration, for the tests); links to the other pages
    then show as plain text."""
    from sphinx.application import Sphinx

    build_dir = Path(build_dir).resolve()
    groups = sections(root, teacher)
    if pages is not None:
        unknown = set(pages) - {p for s in groups for p in s.pages}
        if unknown:
            raise ValueError(f"pages: not pages of this site: {sorted(unknown)}")
        groups = [Section(s.caption, tuple(p for p in s.pages if p in pages)) for s in groups]
    groups = [s for s in groups if s.pages]
    src = stage(build_dir, groups, root)
    html, doctrees = build_dir / "html", build_dir / "doctrees"
    for d in (html, doctrees):
        shutil.rmtree(d, ignore_errors=True)
    warnings = io.StringIO()
    app = Sphinx(str(src), None, str(html), str(doctrees), "html",
                 confoverrides=config(build_dir, groups, lab_url, root),
                 status=None if quiet else sys.stdout, warning=_Tee(warnings, sys.stderr),
                 freshenv=True, warningiserror=True, keep_going=True)
    app.build()
    if app.statuscode or warnings.getvalue().strip():
        raise BuildFailed(warnings.getvalue() or f"sphinx exited with status {app.statuscode}")
    (html / "index.html").write_text(REDIRECT, encoding="utf-8")
    return html


class BuildFailed(RuntimeError):
    """The build printed warnings (each one is an error here)."""


class _Tee(io.TextIOBase):
    def __init__(self, *streams):
        self.streams = streams

    def write(self, s):
        for stream in self.streams:
            stream.write(s)
        return len(s)


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when it lies inside it."""
    return os.path.relpath(path) if Path.cwd() in path.parents else str(path)


def main_build(args) -> int:
    try:
        html = build(args.build_dir, teacher=args.teacher, pages=args.pages, lab_url=args.lab_url)
    except BuildFailed:
        print("the site was not built: the warnings above are errors", file=sys.stderr)
        return 1
    print(f"built {html}{' (teacher: answers and the instructor guide included)' if args.teacher else ''}; "
          f"view it: python -m http.server -d {_shown(html)}")
    return 0
