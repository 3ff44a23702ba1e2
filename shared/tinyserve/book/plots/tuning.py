"""Figures for notebook 08 (tuning order): a metric before and after each fix,
the waiting queue over time, and predicted vs measured service capacity
against the arrival rate (the notebook's inter-token-latency CDF is
:func:`tinyserve.book.plots.policies.cdf`).
"""

from __future__ import annotations

import numpy as np

from tinyserve.book.plots.common import ensure_axes, finish


def plot_before_after(scenarios, before, after, ylabel, ax=None, slo=None, log=False,
                      title="Before and after the fix", labels=("before", "after")):
    """Paired bars, one pair per scenario: a metric before and after its fix (``slo``: a dashed line)."""
    ax = ensure_axes(ax, (6, 3.2))
    x = np.arange(len(scenarios))
    ax.bar(x - 0.2, before, 0.4, color="tab:red", alpha=0.8, label=labels[0])
    ax.bar(x + 0.2, after, 0.4, color="tab:green", alpha=0.8, label=labels[1])
    if slo is not None:
        ax.axhline(slo, ls="--", color="black", lw=1, label="SLO")
    if log:
        ax.set_yscale("log")
    ax.set_xticks(x, scenarios, fontsize=8)
    return finish(ax, title, ylabel=ylabel, grid="y")


def plot_waiting_queue(runs, ax=None, title="Waiting queue over time"):
    """Waiting-queue length against time for each run; ``runs`` maps a label to its step stats."""
    ax = ensure_axes(ax, (5.5, 3.2))
    for label, steps in runs.items():
        ax.plot([s.start for s in steps], [s.num_waiting for s in steps], lw=1.2, label=label)
    return finish(ax, title, xlabel="time (s)", ylabel="requests waiting")


def plot_capacity(labels, predicted, measured, arrival_rate, ax=None,
                  title="Service capacity vs arrival rate"):
    """Predicted and measured capacity (requests/s) per configuration against the arrival rate."""
    ax = ensure_axes(ax, (5.5, 3.2))
    x = np.arange(len(labels))
    ax.bar(x - 0.2, predicted, 0.4, color="tab:blue", alpha=0.5, label="predicted")
    ax.bar(x + 0.2, measured, 0.4, color="tab:blue", label="measured")
    ax.axhline(arrival_rate, color="tab:red", ls="--", lw=1.2, label=f"arrival rate {arrival_rate:g}/s")
    ax.set_xticks(x, labels, fontsize=8)
    return finish(ax, title, ylabel="requests per second", grid="y")
