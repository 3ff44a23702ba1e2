"""Figures for notebook 08 (tuning order): a metric before and after each fix,
the waiting queue over time, and predicted vs measured service capacity
against the arrival rate (the notebook's inter-token-latency CDF is
:func:`tinyserve.book.plots.policies.cdf`).
"""

from __future__ import annotations

import itertools

import numpy as np

from tinyserve.book.plots.common import ensure_axes, finish, SMALL


def plot_before_after(scenarios, before, after, ylabel, ax=None, slo=None, log=False,
                      title="Before and after the fix", labels=("before", "after")):
    """Paired bars, one pair per scenario: a metric before and after its fix (``slo``: a dashed
    line). Each bar carries its value, so a bar too short to see still says what it is."""
    ax = ensure_axes(ax, (6, 3.2))
    x = np.arange(len(scenarios))
    for offset, values, color, label in ((-0.2, before, "tab:red", labels[0]), (0.2, after, "tab:green", labels[1])):
        bars = ax.bar(x + offset, values, 0.4, color=color, alpha=0.8, label=label)
        # On a white patch above the SLO line: a value next to the line stays readable.
        ax.bar_label(bars, [_short(v) for v in values], fontsize=SMALL, padding=1, zorder=3,
                     bbox=dict(facecolor="white", edgecolor="none", pad=0.5, alpha=0.85))
    if slo is not None:
        ax.axhline(slo, ls="--", color="black", lw=1, label="SLO")
    if log:
        ax.set_yscale("log")
    ax.margins(y=0.15)
    ax.set_xticks(x, scenarios, fontsize=SMALL)
    return finish(ax, title, ylabel=ylabel, grid="y")


def _short(v: float) -> str:
    """A bar's value in three significant digits at most (0.04, 7.3, 102)."""
    return f"{v:.2g}" if abs(v) < 10 else f"{v:.0f}"


def plot_waiting_queue(runs, ax=None, title="Waiting queue over time"):
    """Waiting-queue length against time for each run; ``runs`` maps a label to its step stats."""
    ax = ensure_axes(ax, (5.5, 3.2))
    # Runs that sit at 0 lie on one another: a line style each keeps every one visible.
    for (label, steps), style in zip(runs.items(), itertools.cycle(["-", "--", ":", "-."])):
        ax.plot([s.start for s in steps], [s.num_waiting for s in steps], lw=1.6, ls=style, label=label)
    return finish(ax, title, xlabel="time (s)", ylabel="requests waiting")


def plot_capacity(labels, predicted, measured, arrival_rate, ax=None,
                  title="Service capacity vs arrival rate"):
    """Predicted and measured capacity (requests/s) per configuration against the arrival rate."""
    ax = ensure_axes(ax, (5.5, 3.2))
    x = np.arange(len(labels))
    ax.bar(x - 0.2, predicted, 0.4, color="tab:blue", alpha=0.5, label="predicted")
    ax.bar(x + 0.2, measured, 0.4, color="tab:blue", label="measured")
    ax.axhline(arrival_rate, color="tab:red", ls="--", lw=1.2, label=f"arrival rate {arrival_rate:g}/s")
    ax.set_xticks(x, labels, fontsize=SMALL)
    return finish(ax, title, ylabel="requests per second", grid="y")
