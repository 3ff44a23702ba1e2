"""Checks over a built site (``make book-check``), reading only the HTML on disk.

- every relative link and image of every page resolves to a file (and its
  ``#fragment`` to an id on that page);
- nothing a page needs for rendering (scripts, style sheets, images, fonts
  through them) comes from another host;
- a link to a notebook goes to its page, never to the ``.ipynb`` file, except
  the explicit download links;
- every image has alt text;
- Sphinx's search index holds the terms a reader searches for.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

SEARCH_TERMS = ("交叉点", "前缀缓存", "队头阻塞")
# Attributes that load something into the page, and those that only navigate.
LOADS = {("script", "src"), ("link", "href"), ("img", "src"), ("source", "src"), ("iframe", "src")}
NAVIGATES = {("a", "href")}


@dataclass
class Page:
    """What one HTML file links to and which ids it defines."""

    path: Path
    ids: set[str] = field(default_factory=set)
    refs: list[tuple[str, str, dict]] = field(default_factory=list)   # (tag, url, attrs)


class _Collector(HTMLParser):
    def __init__(self, page: Page):
        super().__init__(convert_charrefs=True)
        self.page = page

    def handle_starttag(self, tag, attrs):
        a = {k: (v or "") for k, v in attrs}
        for key in ("id", "name"):
            if key in a and (key == "id" or tag == "a"):
                self.page.ids.add(a[key])
        for t, attr in LOADS | NAVIGATES:
            if tag == t and attr in a:
                if tag == "link" and "stylesheet" not in a.get("rel", "") and "icon" not in a.get("rel", "") \
                        and "preload" not in a.get("rel", ""):
                    # <link rel="index|search|next|prev"> navigates
                    self.page.refs.append(("a", a[attr], a))
                else:
                    self.page.refs.append((tag, a[attr], a))


def read_page(path: Path) -> Page:
    page = Page(path)
    _Collector(page).feed(path.read_text(encoding="utf-8", errors="replace"))
    return page


def is_external(url: str) -> bool:
    return bool(urlsplit(url).scheme) or url.startswith("//")


def is_download(attrs: dict) -> bool:
    """An explicit download: Sphinx's download links, the theme's "download source" button."""
    return "download" in attrs or "btn-download-source-button" in attrs.get("class", "").split()


def pages_of(html_dir: Path) -> list[Path]:
    """The site's pages (``_static`` holds the theme's template fragments, not pages)."""
    return sorted(p for p in html_dir.rglob("*.html") if "_static" not in p.relative_to(html_dir).parts)


def problems(html_dir: Path | str) -> list[str]:
    """Everything wrong with the built site in ``html_dir``, one line each (empty: all good)."""
    html_dir = Path(html_dir).resolve()
    files = pages_of(html_dir)
    if not files:
        return [f"{html_dir}: no HTML pages (run make book first)"]
    pages = {p: read_page(p) for p in files}
    found = []
    for path, page in pages.items():
        where = path.relative_to(html_dir).as_posix()
        for tag, url, attrs in page.refs:
            if not url or url.startswith(("mailto:", "javascript:", "data:")):
                continue
            if is_external(url):
                if tag != "a":
                    found.append(f"{where}: <{tag}> loads {url} from another host")
                continue
            parts = urlsplit(url)
            target = path if not parts.path else (path.parent / unquote(parts.path)).resolve()
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                found.append(f"{where}: <{tag}> {url} does not exist")
                continue
            if html_dir not in target.parents and target != html_dir:
                found.append(f"{where}: <{tag}> {url} leaves the site")
                continue
            if tag == "a" and target.suffix == ".ipynb" and not is_download(attrs):
                found.append(f"{where}: <a> {url} links to a notebook file, not its page")
            if parts.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else read_page(target).ids
                if unquote(parts.fragment) not in ids:
                    found.append(f"{where}: <{tag}> {url}: no id {unquote(parts.fragment)!r} on that page")
            if tag == "img" and not attrs.get("alt", "").strip():
                found.append(f"{where}: <img> {url} has no alt text")
    return found


# ------------------------------------------------------------------ the search index


def search_index(html_dir: Path | str) -> dict:
    """Sphinx's ``searchindex.js`` as a dict (``docnames``, ``titles``, ``terms``, ...)."""
    text = (Path(html_dir) / "searchindex.js").read_text(encoding="utf-8")
    match = re.fullmatch(r"\s*Search\.setIndex\((.*)\)\s*;?\s*", text, re.DOTALL)
    if not match:
        raise ValueError("searchindex.js is not a Search.setIndex(...) call")
    return json.loads(match.group(1))


def pages_with_term(index: dict, term: str) -> list[str]:
    """The pages (docnames) whose text or headings hold ``term`` as a search-index word
    (Sphinx files a word of a heading under ``titleterms`` only)."""
    found = set()
    for table in ("terms", "titleterms"):
        hits = index[table].get(term, [])
        found.update([hits] if isinstance(hits, int) else hits)
    return sorted(index["docnames"][i] for i in found)


def missing_terms(html_dir: Path | str, terms=SEARCH_TERMS) -> list[str]:
    index = search_index(html_dir)
    return [f"the search index has no page for {t!r}" for t in terms if not pages_with_term(index, t)]


def main_check(args) -> int:
    found = problems(args.html) + missing_terms(args.html)
    for line in found:
        print(line)
    pages = len(pages_of(Path(args.html).resolve()))
    print(f"{pages} pages checked: " + (f"{len(found)} problems" if found else
                                       "every internal link and image resolves, nothing loads from another "
                                       f"host, and the search index finds {', '.join(SEARCH_TERMS)}"))
    return 1 if found else 0
