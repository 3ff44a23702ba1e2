"""What every figure module shares: the axes to draw on, and how a figure ends.

Each plotting function in :mod:`tinyserve.book.plots` takes data (lists, dicts,
step stats) and an optional matplotlib ``ax``, draws, and returns the axes;
:func:`ensure_axes` gives it the caller's axes or a new, small figure of its own
(small figures keep the notebooks light), and :func:`finish` puts on the labels,
title, grid and legend most of them end with.
"""

from __future__ import annotations

import matplotlib.pyplot as plt


def ensure_axes(ax, figsize=(5, 3.5)):
    """The given axes, or new ones of ``figsize`` (small figures keep notebooks light)."""
    if ax is None:
        _, ax = plt.subplots(figsize=figsize, dpi=90)
    return ax


def finish(ax, title=None, xlabel=None, ylabel=None, *, title_size=None, grid="major", legend=8):
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
