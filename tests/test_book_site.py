"""The website (`make book`): what a reader of the built HTML gets.

By default the tests build a small site with the same configuration as
`make book`: the README, notebook 04 (math, figures, the interactive calculator)
and lab 03, which link to each other; `make book-check` runs them over the full build
instead (TINYSERVE_BOOK_HTML=_build/html). Every build treats warnings as errors.

The browser tests drive the system's chromium through chromium-driver (Debian's
packages; nothing is downloaded) and skip with the reason when either is missing.
Their screenshots land in _build/screenshots/.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NB04 = "chapters/ch05_engine_and_scheduling/04_batch_size_crossover.ipynb"
NB04_HTML = NB04.replace(".ipynb", ".html")
LAB03 = "labs/lab03_crossover.ipynb"
BOOK_HTML = os.environ.get("TINYSERVE_BOOK_HTML")
SCREENSHOTS = ROOT / "_build" / "screenshots"

MISSING = [m for m in ("sphinx", "myst_nb", "sphinx_book_theme", "sphinx_copybutton", "jieba")
           if __import__("importlib.util").util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"the book extra is not installed (no {', '.join(MISSING)}): "
                                                     "pip install -e '.[book]', or make book")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    if BOOK_HTML:
        html = Path(BOOK_HTML).resolve()
        if not (html / "README.html").exists():
            pytest.fail(f"TINYSERVE_BOOK_HTML={BOOK_HTML}: no built site there (run make book)")
        return html
    build_dir = tmp_path_factory.mktemp("book")
    run = subprocess.run([sys.executable, "-m", "tinyserve.book.site", "build", "--build-dir", str(build_dir),
                          "--pages", NB04, LAB03], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return build_dir / "html"


def page(site: Path, rel: str) -> str:
    return (site / rel).read_text(encoding="utf-8")


# ---------------------------------------------------------------- the built HTML


def test_every_internal_link_and_image_resolves_and_nothing_loads_from_a_cdn(site):
    from tinyserve.book.site.check import problems

    assert problems(site) == []


def test_every_link_between_pages_is_a_link_to_the_page(site):
    """Each Markdown link of a built page to another built page (a notebook, a lab, the
    README) is an <a> to that page's HTML, never plain text or the .ipynb file."""
    from tinyserve.book.site.build import markdown_of, relative_links

    checked = 0
    for html_path in [Path("README.html"), *map(Path, built_pages(site))]:
        source = next((ROOT / html_path.with_suffix(s) for s in (".md", ".ipynb")
                       if (ROOT / html_path.with_suffix(s)).exists()), None)
        if source is None:                      # the generated claims page
            continue
        hrefs = set(re.findall(r'href="([^"#]+)', page(site, html_path.as_posix())))
        for target in relative_links(markdown_of(source)):
            linked = Path(os.path.normpath(html_path.parent / target))
            if linked.with_suffix(".html") == html_path:   # a page naming itself: href="#"
                continue
            if linked.suffix in (".md", ".ipynb") and (site / linked.with_suffix(".html")).exists():
                want = os.path.relpath(linked.with_suffix(".html"), html_path.parent)
                assert want in hrefs, f"{html_path}: the link to {target} is not a link to {want}"
                checked += 1
    assert checked >= 2       # 04 -> lab 03 and back, in the small build


def test_the_search_index_finds_the_chapters_chinese_terms(site):
    from tinyserve.book.site.check import SEARCH_TERMS, pages_with_term, search_index

    index = search_index(site)
    for term in SEARCH_TERMS:
        assert pages_with_term(index, term), f"no page found for {term!r}"
    assert NB04.removesuffix(".ipynb") in pages_with_term(index, "交叉点")
    assert "README" in pages_with_term(index, "队头阻塞")     # the glossary


def test_the_sidebar_lists_the_pages_in_reading_order(site):
    html = page(site, "README.html")
    nav = html.split('class="bd-links bd-docs-nav"', 1)[1].split("</nav>", 1)[0]
    linked = re.findall(r'href="([^"#]+\.html)"', nav)
    assert linked == built_pages(site)
    captions = re.findall(r'<span class="caption-text">([^<]+)</span>', nav)
    assert captions[0] == "本章笔记本"


def built_pages(site):
    """The built pages in the sidebar's order, as paths of their HTML."""
    from tinyserve.book.site.build import sections

    return [p.rsplit(".", 1)[0] + ".html" for s in sections() for p in s.pages
            if (site / (p.rsplit(".", 1)[0] + ".html")).exists()]


def test_each_page_has_previous_and_next_links_and_a_page_toc(site):
    order = ["README.html", *built_pages(site)]
    here = order.index(NB04_HTML)
    html = page(site, NB04_HTML)
    prev = html.split('class="left-prev"', 1)[1][:300]
    assert f'href="{os.path.relpath(order[here - 1], Path(NB04_HTML).parent)}"' in prev
    if here + 1 < len(order):
        nxt = html.split('class="right-next"', 1)[1][:300]
        assert f'href="{os.path.relpath(order[here + 1], Path(NB04_HTML).parent)}"' in nxt
    assert 'id="pst-page-toc-nav"' in html or 'class="page-toc' in html
    toc = html.split("本页内容", 1)[1][:6000]
    assert "交叉点计算器" in toc


def test_a_notebook_page_offers_jupyterlab_and_the_notebook_download(site):
    html = page(site, NB04_HTML)
    links = html.split('class="notebook-links"', 1)[1].split("</p>", 1)[0]
    assert f'href="http://127.0.0.1:8888/lab/tree/{NB04}"' in links and "在 JupyterLab 中打开" in links
    download = re.search(r'download="" href="([^"]+\.ipynb)"', links)
    assert download and "下载 notebook" in links
    assert (site / Path(NB04_HTML).parent / download.group(1)).read_bytes() == (ROOT / NB04).read_bytes()


def test_outputs_are_shown_as_committed_with_alt_text(site):
    """Every figure the executed notebook stores is on its page, byte for byte, each with
    alt text naming its section."""
    html = page(site, NB04_HTML)
    shown = {}
    for alt, src in re.findall(r'<img alt="([^"]*)" src="([^"]+\.png)"', html):
        data = (site / Path(NB04_HTML).parent / src).resolve().read_bytes()
        shown[hashlib.sha256(data).hexdigest()] = alt
    nb = nbformat.read(ROOT / NB04, as_version=4)
    stored = [hashlib.sha256(base64.b64decode(o["data"]["image/png"])).hexdigest()
              for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert stored and set(stored) == set(shown)
    assert all(alt.startswith("图：") and len(alt) > 6 for alt in shown.values())
    assert any("交叉点计算器" in alt for alt in shown.values())


def test_the_calculator_shows_its_static_figure_and_a_note_that_it_is_live_in_jupyterlab(site):
    html = page(site, NB04_HTML)
    note = html.index("widget-note")
    assert "在 JupyterLab 中运行这一格" in html[note:note + 800]
    before = html[:note]
    assert before.rfind("<img ") > before.rfind("<h2"), "the static figure sits in the calculator's section"
    assert "VBox(" not in html


def test_math_is_rendered_by_a_local_mathjax(site):
    html = page(site, NB04_HTML)
    script = re.search(r'<script[^>]+src="([^"]*mathjax/tex-chtml\.js)"', html)
    assert script and (site / Path(NB04_HTML).parent / script.group(1)).resolve().is_file()
    assert '<span class="math notranslate nohighlight">' in html


def test_code_cells_get_copy_buttons_and_outputs_do_not(site):
    html = page(site, NB04_HTML)
    assert "copybutton.js" in html
    options = page(site, "_static/copybutton.js")
    assert "div:not(.output) > div.highlight pre" in options


def test_a_readers_site_has_no_answers(site):
    assert not list(site.glob("solutions/*.html"))
    readme = page(site, "README.html")
    assert "solutions/INSTRUCTOR" not in "".join(re.findall(r'href="([^"]+)"', readme))
    assert 'class="not-in-site"' in readme   # the guide's name stays, as text


# ---------------------------------------------------------------- the tools themselves


def test_a_warning_fails_the_build(tmp_path):
    """A broken link in a notebook's markdown stops `make book` (warnings are errors)."""
    from tinyserve.book.site.build import BuildFailed, build

    root = tmp_path / "repo"
    (root / "chapters" / "ch05_engine_and_scheduling").mkdir(parents=True)
    (root / "labs").mkdir()
    (root / "shared").mkdir()
    (root / "README.md").write_text("# 首页\n\n## 术语表\n\n| 中文 | English |\n| --- | --- |\n| 交叉点 | crossover |\n",
                                    encoding="utf-8")
    (root / "shared" / "README.md").write_text("# 参考\n", encoding="utf-8")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# 00 概览\n\n见 [下一篇](01_missing.ipynb)。")])
    nbformat.write(nb, root / "chapters" / "ch05_engine_and_scheduling" / "00_overview.ipynb")
    with pytest.raises(BuildFailed, match="01_missing"):
        build(tmp_path / "_build", root=root, quiet=True)


def test_the_glossary_gives_the_search_its_words():
    from tinyserve.book.site.build import glossary_terms

    words = glossary_terms((ROOT / "README.md").read_text(encoding="utf-8"))
    assert {"交叉点", "前缀缓存", "队头阻塞", "连续批处理"} <= set(words)
    assert all(re.fullmatch(r"[\u4e00-\u9fff]+", w) for w in words)


def test_the_checker_finds_what_is_broken(tmp_path):
    from tinyserve.book.site.check import problems

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.html").write_text('<p id="here">x</p>', encoding="utf-8")
    (tmp_path / "a" / "x.ipynb").write_text("{}", encoding="utf-8")
    (tmp_path / "page.html").write_text(
        '<a href="a/x.html#here">ok</a> <a href="a/x.html#gone">no id</a> <a href="a/y.html">missing</a>'
        '<a href="a/x.ipynb">raw notebook</a> <a href="a/x.ipynb" download>download</a>'
        '<img src="a/x.html" alt=""> <script src="https://cdn.example.org/m.js"></script>'
        '<a href="https://example.org">fine</a>', encoding="utf-8")
    found = problems(tmp_path)
    assert len(found) == 5, found
    assert any("no id 'gone'" in f for f in found) and any("a/y.html does not exist" in f for f in found)
    assert any("not its page" in f for f in found) and any("no alt text" in f for f in found)
    assert any("another host" in f for f in found)


# ---------------------------------------------------------------- in a real browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("no chromium and chromium-driver here (apt-get install chromium chromium-driver fonts-noto-cjk)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (the book extra)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,900", "--lang=zh-CN", "--hide-scrollbars"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def served(site):
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


def wait_for(driver, css, timeout=30):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout).until(ec.presence_of_element_located((By.CSS_SELECTOR, css)))


def set_width(driver, width, phone):
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": width, "height": 844 if phone else 900, "deviceScaleFactor": 2 if phone else 1,
                            "mobile": phone})


# Draws two different characters in the element's own font: with a font that has the
# glyphs they differ; as tofu (the missing-glyph box) they are the same picture.
GLYPHS_DIFFER = """
const el = arguments[0], a = arguments[1], b = arguments[2];
const font = getComputedStyle(el).font;
function draw(ch) {
  const c = document.createElement('canvas'); c.width = 64; c.height = 64;
  const g = c.getContext('2d'); g.font = font.replace(/\\d+(\\.\\d+)?px/, '40px'); g.fillStyle = '#000';
  g.fillText(ch, 4, 48); return Array.from(g.getImageData(0, 0, 64, 64).data).join(',');
}
return [draw(a) !== draw(b), draw(a) !== draw('\\u{10FFFD}'), font];
"""


def platform_fonts(driver, css):
    """The fonts chromium really used for an element's text (DevTools' CSS domain)."""
    driver.execute_cdp_cmd("DOM.enable", {})
    driver.execute_cdp_cmd("CSS.enable", {})
    doc = driver.execute_cdp_cmd("DOM.getDocument", {"depth": 0})
    node = driver.execute_cdp_cmd("DOM.querySelector", {"nodeId": doc["root"]["nodeId"], "selector": css})
    fonts = driver.execute_cdp_cmd("CSS.getPlatformFontsForNode", {"nodeId": node["nodeId"]})["fonts"]
    return {f["familyName"]: f["glyphCount"] for f in fonts}


def check_chinese_is_rendered(driver, css):
    from selenium.webdriver.common.by import By

    el = driver.find_element(By.CSS_SELECTOR, css)
    assert el.is_displayed() and el.size["width"] > 0 and re.search(r"[\u4e00-\u9fff]", el.text)
    chars = re.findall(r"[\u4e00-\u9fff]", el.text)
    differ, not_tofu, font = driver.execute_script(GLYPHS_DIFFER, el, chars[0], next(c for c in chars if c != chars[0]))
    assert differ and not_tofu, f"Chinese text in {css} draws as tofu ({font})"
    fonts = platform_fonts(driver, css)
    cjk = {name: n for name, n in fonts.items() if re.search(r"CJK|Hei|Song|Kai|Ming|WenQuanYi|Droid Sans Fallback|"
                                                             r"PingFang|YaHei|Noto Sans SC|Noto Serif SC", name)}
    assert cjk, f"no CJK font drew {css}: {fonts}"
    return fonts


def test_a_reader_follows_the_sidebar_to_notebook_04_and_searches(browser, served):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    set_width(browser, 1280, phone=False)
    browser.get(served)                      # index.html sends the reader to README.html
    wait_for(browser, "nav.bd-docs-nav")
    assert browser.current_url.endswith("/README.html")
    fonts = check_chinese_is_rendered(browser, "article.bd-article h1")
    browser.save_screenshot(str(SCREENSHOTS / "landing-desktop.png"))

    link = browser.find_element(By.CSS_SELECTOR, 'nav.bd-docs-nav a[href$="04_batch_size_crossover.html"]')
    link.click()
    wait_for(browser, "p.notebook-links")
    assert browser.current_url.endswith("/" + NB04_HTML)
    assert browser.find_element(By.CSS_SELECTOR, "article.bd-article h1").text.startswith("04")
    check_chinese_is_rendered(browser, "article.bd-article h1")
    wait_for(browser, "mjx-container")       # MathJax typeset the formulas
    copy_buttons = browser.find_elements(By.CSS_SELECTOR, "button.copybtn")
    assert copy_buttons and not browser.find_elements(By.CSS_SELECTOR, ".cell_output button.copybtn")
    browser.save_screenshot(str(SCREENSHOTS / "nb04-desktop.png"))

    browser.find_element(By.CSS_SELECTOR, ".bd-sidebar-primary button.search-button__button").click()
    box = wait_for(browser, "#pst-search-dialog[open] input[name=q]")
    box.send_keys("交叉点", Keys.ENTER)
    hit = wait_for(browser, f'#search-results a[href*="04_batch_size_crossover"]')
    assert "search.html" in browser.current_url
    assert hit.text.startswith("04")
    browser.save_screenshot(str(SCREENSHOTS / "search-desktop.png"))
    (SCREENSHOTS / "fonts.json").write_text(json.dumps(fonts, ensure_ascii=False), encoding="utf-8")


@pytest.mark.parametrize("rel", ["README.html", NB04_HTML])
def test_pages_fit_a_phone(browser, served, rel):
    """At 390 CSS pixels the page scrolls down, never sideways (wide tables and code
    scroll inside their own boxes), the sidebar folds away, and Chinese text renders."""
    set_width(browser, 390, phone=True)
    try:
        browser.get(served + rel)
        wait_for(browser, "article.bd-article h1")
        width = browser.execute_script("return [document.documentElement.scrollWidth, window.innerWidth]")
        assert width[0] <= width[1] + 1, f"{rel} is {width[0]} px wide on a {width[1]} px screen"
        assert not browser.execute_script(
            "const s = document.querySelector('.bd-sidebar-primary'); const r = s.getBoundingClientRect();"
            "return r.width > 0 && r.right > 0 && getComputedStyle(s).visibility !== 'hidden'")
        check_chinese_is_rendered(browser, "article.bd-article h1")
        name = "landing" if rel == "README.html" else "nb04"
        browser.save_screenshot(str(SCREENSHOTS / f"{name}-phone.png"))
    finally:
        set_width(browser, 1280, phone=False)
