"""The Sphinx extension behind ``make book``: what the site adds to the sources.

- the sidebar: a hidden toctree appended to the README (the root page) as it is
  read, so README.md itself stays plain Markdown;
- on each notebook page, under its title: 在 JupyterLab 中打开 / 下载 notebook;
- an interactive explorer's cell (``widgets.*(...)``, stored without widget
  state) shows a note that it is live in JupyterLab, beside its static figure;
- every output figure gets alt text: its section's title and what the plotting
  function draws (its docstring's first sentence, read from ``book/plots/``);
- a link to a page of the repository that this build leaves out (a teacher's
  page in a reader's build, any page in a partial build) becomes plain text
  instead of a broken reference or a download of the source file.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from docutils import nodes
from sphinx import addnodes
from sphinx.transforms import SphinxTransform

from tinyserve.book.site.build import docname as page_docname, repo_path

PAGE_SUFFIXES = (".md", ".ipynb")
WIDGET_CALL = re.compile(r"\bwidgets\.\w+\(")
CALL = re.compile(r"\b(\w+)\(")
WIDGET_NOTE = ("交互控件（ipywidgets）：在 JupyterLab 中运行这一格，就能拨动它的选项（本页开头的"
               "“在 JupyterLab 中打开”）。网页上显示的是保存的输出；上一格的图就是默认参数下的静态版本。")


def toctree_source(sections) -> str:
    """MyST for the sidebar: one hidden toctree per section."""
    blocks = []
    for caption, docs in sections:
        blocks.append("```{toctree}\n:hidden:\n:caption: " + caption + "\n\n" + "\n".join(docs) + "\n```\n")
    return "\n\n" + "\n".join(blocks)


def on_source_read(app, docname, source):
    if docname == app.config.root_doc:
        source[0] += toctree_source(app.config.tinyserve_sections)


def first_sentence(doc: str) -> str:
    text = " ".join(doc.strip().split("\n\n", 1)[0].split())
    text = text.replace("``", "")
    return re.split(r"(?<=[.;])\s", text, maxsplit=1)[0].rstrip(".;:")


@functools.cache  # the plot sources do not change during a build: read them once, not per page
def figure_descriptions() -> dict[str, str]:
    """What each plotting function of ``tinyserve.book.plots`` draws (its docstring's first
    sentence), by function name; the helpers of ``plots/common.py`` are left out. Read from
    the source, so the site builds without importing matplotlib or torch."""
    import ast

    found = {}
    for path in sorted((Path(__file__).resolve().parents[1] / "plots").glob("*.py")):
        if path.name in ("__init__.py", "common.py"):
            continue
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            doc = ast.get_docstring(node) if isinstance(node, ast.FunctionDef) else None
            if not doc or node.name.startswith("_"):
                continue
            sentence = first_sentence(doc)
            args = {a.arg for a in node.args.args + node.args.kwonlyargs}
            for arg in args:                              # what the figure shows, not how to call it
                sentence = sentence.split(f": {arg} ", 1)[0]
            if sentence.split(":", 1)[0] not in args:
                found[node.name] = sentence
    return found


class PageAdditions(SphinxTransform):
    """Read time, before the collectors (Sphinx's ``doctree-read`` transform is 880):
    out-of-build links, notebook links, widget notes and figure alt text."""

    default_priority = 870

    def apply(self, **kwargs):
        env = self.env
        docname = env.docname
        self.unlink_pages_not_built(docname)
        source = Path(env.doc2path(docname))
        if source.suffix == ".ipynb":
            self.add_notebook_links(docname, source.name)
            self.note_widgets()
            self.add_alt_text()

    # -- links to pages this build leaves out

    def unlink_pages_not_built(self, docname):
        """Plain text for a link to a page of the site that this build leaves out, or to a
        folder of the repository; any other unresolvable link is left to warn."""
        env = self.env
        repo = Path(env.config.tinyserve_root)
        all_pages = set(env.config.tinyserve_all_pages)
        for node in list(self.document.findall(addnodes.pending_xref)) + \
                list(self.document.findall(addnodes.download_reference)):
            if node.get("reftype") != "myst":
                continue
            if node.get("refdomain") == "doc":
                if node["reftarget"] in env.found_docs:
                    continue
                paths = [node["reftarget"] + s for s in PAGE_SUFFIXES]
            else:
                paths = [repo_path(docname, node["reftarget"])]
            left_out = any(p in all_pages and page_docname(p) not in env.found_docs for p in paths)
            a_folder = any(not p.startswith("..") and (repo / p).is_dir() for p in paths)
            if left_out or a_folder:
                node.replace_self(nodes.inline("", "", *[child.deepcopy() for child in node.children],
                                               classes=["not-in-site"]))

    # -- 在 JupyterLab 中打开 / 下载 notebook

    def add_notebook_links(self, docname, filename):
        section = next(iter(self.document.findall(nodes.section)), None)
        if section is None:
            return
        lab = nodes.reference("", "在 JupyterLab 中打开", refuri=self.config.tinyserve_lab_url + docname + ".ipynb",
                              classes=["open-in-jupyterlab"])
        download = addnodes.download_reference("", "", refdoc=docname, reftarget=filename, refexplicit=True,
                                               reftype="download", refdomain="", classes=["download-notebook"])
        download += nodes.inline("", "下载 notebook")
        para = nodes.paragraph("", "", lab, nodes.Text(" / "), download,
                               nodes.Text("（先在仓库根目录运行 "), nodes.literal("", "make lab"),
                               nodes.Text("；notebook 里保存着这里看到的全部输出）"), classes=["notebook-links"])
        title = section.next_node(nodes.title)
        section.insert(section.index(title) + 1 if title is not None else 0, para)

    # -- interactive explorers

    def note_widgets(self):
        for cell in self.cells():
            source, output = self.cell_parts(cell)
            if source is None or not WIDGET_CALL.search(source.astext()):
                continue
            note = nodes.note("", nodes.paragraph("", WIDGET_NOTE), classes=["widget-note"])
            if output is None:
                cell.append(note)
            else:
                output.children = []
                output.append(note)

    # -- alt text of output figures

    def add_alt_text(self):
        for cell in self.cells():
            source, output = self.cell_parts(cell)
            images = [i for i in (output.findall(nodes.image) if output is not None else []) if not i.get("alt")]
            if not images:
                continue
            descriptions = figure_descriptions()
            drawn = []
            for name in CALL.findall(source.astext() if source is not None else ""):
                if name in descriptions and descriptions[name] not in drawn:
                    drawn.append(descriptions[name])
            heading = self.section_title(cell) or self.section_title(self.document.next_node(nodes.section))
            bundles = {id(img.parent) for img in images}
            for i, img in enumerate(images, 1):
                alt = f"图：{heading}" + (f"（{'；'.join(drawn)}）" if drawn else "")
                if len(bundles) > 1:
                    alt += f"，第 {i} 张"
                img["alt"] = alt

    # -- helpers

    def cells(self):
        return [n for n in self.document.findall(nodes.container) if n.get("nb_element") == "cell_code"]

    @staticmethod
    def cell_parts(cell):
        source = next((c for c in cell.children if c.get("nb_element") == "cell_code_source"), None)
        output = next((c for c in cell.children if c.get("nb_element") == "cell_code_output"), None)
        return source, output

    @staticmethod
    def section_title(node):
        while node is not None and not isinstance(node, nodes.section):
            node = node.parent
        if node is None:
            return ""
        title = node.next_node(nodes.title)
        return title.astext() if title is not None else ""


# Sphinx's search shows each hit's text around the word, taken from the page's
# [role=main], which in this theme also holds the article's buttons ("System Settings
# 亮色 暗色") and the page's table of contents: drop those before it reads the text.
SEARCH_SNIPPETS_JS = """
document.addEventListener("DOMContentLoaded", () => {   // searchtools.js loads after this
  if (typeof Search === "undefined" || !Search.htmlToText) return;
  const pageText = Search.htmlToText;
  Search.htmlToText = (html, anchor) => {
    const page = new DOMParser().parseFromString(html, "text/html");
    page.querySelectorAll(".bd-header-article, .bd-sidebar-secondary, .notebook-links")
        .forEach((el) => el.remove());
    return pageText(page.documentElement.outerHTML, anchor);
  };
});
"""


def setup(app):
    app.add_config_value("tinyserve_sections", [], "env")
    app.add_config_value("tinyserve_lab_url", "", "env")
    app.add_config_value("tinyserve_root", "", "env")
    app.add_config_value("tinyserve_all_pages", [], "env")
    app.connect("source-read", on_source_read)
    app.add_transform(PageAdditions)
    app.add_js_file(None, body=SEARCH_SNIPPETS_JS, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
