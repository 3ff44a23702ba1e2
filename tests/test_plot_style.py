"""One figure style for the whole book, set in ``tinyserve.book.plots.common``.

Figures were drawn at 90 dpi with 6-7 pt text, unreadable on a classroom
projector, and each module and notebook chose its own numbers. Now the style is
set once: these tests fail if a figure comes out at another dpi, or if a plotting
module, lab check or notebook writes its own dpi or font size as a number again.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from tinyserve.book import plots  # noqa: E402  (sets the style)
from tinyserve.book.plots import common  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OWN_NUMBERS = re.compile(r"\b(dpi|fontsize|title_fontsize|labelsize|title_size|legend)\s*=\s*\d")


def test_a_figure_from_the_plots_package_has_the_books_dpi_and_legend_size():
    ax = plots.ensure_axes(None)
    ax.plot([0, 1], [0, 1], label="line")
    legend = plots.finish(ax, "t", "x", "y").get_legend()
    assert ax.figure.dpi == common.DPI >= 100
    assert legend.get_texts()[0].get_fontsize() == common.SMALL >= 8
    matplotlib.pyplot.close(ax.figure)


def test_no_module_or_notebook_sets_its_own_dpi_or_font_size():
    sources = {p: p.read_text(encoding="utf-8")
               for p in (ROOT / "shared" / "tinyserve").rglob("*.py") if p != Path(common.__file__)}
    for nb in [*ROOT.glob("chapters/*/*.ipynb"), *ROOT.glob("solutions/*.ipynb")]:
        cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
        sources[nb] = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    offenders = [f"{path.relative_to(ROOT)}: {m.group(0)}"
                 for path, text in sources.items() for m in OWN_NUMBERS.finditer(text)]
    assert not offenders, "use plots.common's DPI / SMALL / MEDIUM / TITLE instead:\n" + "\n".join(offenders)


def test_a_cdf_names_its_slo_in_the_legend_not_on_the_curves():
    ax = plots.cdf({"fcfs": [0.1, 0.2, 0.5, 1.0, 2.0]}, marks={"SLO": 0.5})
    assert not ax.texts                                   # no label written inside the axes
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["fcfs", "SLO (0.5)"]
    matplotlib.pyplot.close(ax.figure)


def test_a_saved_playground_shows_a_sentence_not_its_widget_tree():
    import pytest

    pytest.importorskip("ipywidgets")
    from tinyserve.book import widgets

    box = widgets.scheduling_playground(rate=5.0, num_requests=20)
    data = box._repr_mimebundle_()
    data = data[0] if isinstance(data, tuple) else data
    assert data["text/plain"] == widgets.PLAYGROUND_TEXT       # not VBox(children=(...))
    matplotlib.pyplot.close("all")
