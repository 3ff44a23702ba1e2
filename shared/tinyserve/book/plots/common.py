"""What every figure module shares: the axes to draw on, and how a figure ends.

Each plotting function in :mod:`tinyserve.book.plots` takes data (lists, dicts,
step stats) and an optional matplotlib ``ax``, draws, and returns the axes;
:func:`ensure_axes` gives it the caller's axes or a new, small figure of its own
(small figures keep the notebooks light), and :func:`finish` puts on the labels,
title, grid and legend most of them end with.

The book's one figure style is set here, once, when the plots package is imported:
``DPI`` for every figure, and three text sizes that every module and notebook use
instead of numbers of its own (``SMALL`` for legends, tick and value labels,
``MEDIUM`` for panel titles, ``TITLE`` for a figure's title). 110 dpi and nothing
under 8 pt keep a figure readable on a classroom projector.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import FuncFormatter

DPI = 110
SMALL, MEDIUM, TITLE = 8, 9, 10
plt.rcParams.update({"figure.dpi": DPI, "savefig.dpi": DPI,
                     "legend.fontsize": SMALL, "legend.title_fontsize": SMALL,
                     "axes.titlesize": TITLE, "figure.titlesize": TITLE})


def ensure_axes(ax, figsize=(5, 3.5)):
    """The given axes, or new ones of ``figsize`` (small figures keep notebooks light)."""
    if ax is None:
        _, ax = plt.subplots(figsize=figsize)
    return ax


def finish(ax, title=None, xlabel=None, ylabel=None, *, title_size=None, grid="major", legend=SMALL):
    """Title and label ``ax``, draw a light grid and the legend: how most figures end.

    Labels left None are not set; ``title_size`` None keeps matplotlib's title size.
    ``grid`` is "major", "both" (minor ticks too, for log axes), "x" or "y" (lines
    across one axis only), or None for no grid; ``legend`` is the legend's font
    size, or None for no legend. Returns ``ax``.
    """
    if xlabel is not None:
        ax.set_xlabel(xlabel)
    if ylabel is not None:
        ax.set_ylabel(ylabel)
    if title is not None:
        ax.set_title(title, **({} if title_size is None else {"fontsize": title_size}))
    if grid in ("x", "y"):
        ax.grid(alpha=0.3, axis=grid)
    elif grid is not None:
        ax.grid(alpha=0.3, which=grid)
    if legend is not None:
        ax.legend(fontsize=legend)
    return ax


def plain_number(value, _=None) -> str:
    """A log axis's tick label as a plain number: "60", not "6x10^1"."""
    return f"{value:g}"


def two_and_five(value, _=None) -> str:
    """Minor tick labels of a log axis that spans little: only the 2s and 5s of each decade."""
    mantissa = round(value / 10 ** np.floor(np.log10(value)))
    return f"{value:g}" if mantissa in (2, 5) else ""


def plain_log_labels(axis) -> None:
    """A log axis labelled "600", "20", "50", not "6x10^2": plain decades, and the 2s and 5s
    between them (which matplotlib otherwise labels in scientific form when it spans little)."""
    axis.set_major_formatter(FuncFormatter(plain_number))
    axis.set_minor_formatter(FuncFormatter(two_and_five))
