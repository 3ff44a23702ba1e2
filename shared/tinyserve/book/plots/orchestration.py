"""Figures for notebook 07 (engines and orchestration): one request traced
through the four software layers, routing policies'
prefix-cache hit rates and TTFT, how they change as the fleet grows,
colocated vs disaggregated prefill/decode pools, and the KV transfer gap of a
disaggregated request (also used by the routing lab check).
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from tinyserve.book.plots.common import ensure_axes, finish, SMALL, MEDIUM, TITLE


def layer_trace(rows, ax=None, title="One request through the four layers", xlabel="ms"):
    """One lane per layer, top to bottom: ``rows`` is {label: [(start_ms, end_ms), ...]}."""
    ax = ensure_axes(ax, (9, 3.2))
    colors = plt.get_cmap("tab10")
    for y, (label, spans) in enumerate(rows.items()):
        ax.broken_barh([(a, max(b - a, 1e-3)) for a, b in spans], (y - 0.35, 0.7),
                       facecolor=colors(y % 10), edgecolor="black", linewidth=0.2)
    ax.set_yticks(range(len(rows)), list(rows))
    ax.set_ylim(len(rows) - 0.5, -0.5)
    return finish(ax, title, xlabel=xlabel, grid="x", legend=None)


def routing_policy_bars(policies, hit_rates, ttft_ms, predicted_hit=None, axes=None,
                        title=None, ttft_label="mean TTFT (ms)"):
    """Two panels per routing policy: prefix-cache hit rate (with predictions) and TTFT."""
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    x = np.arange(len(policies))
    colors = [f"C{i}" for i in range(len(policies))]
    axes[0].bar(x, hit_rates, 0.6, color=colors, label="measured")
    if predicted_hit is not None:
        axes[0].plot(x, predicted_hit, "k_", ms=28, mew=2.5, label="predicted")
        axes[0].legend(fontsize=SMALL)
    axes[0].set_ylabel("prefix-cache hit rate")
    axes[0].set_ylim(0, 1)
    axes[1].bar(x, ttft_ms, 0.6, color=colors)
    axes[1].set_ylabel(ttft_label)
    for ax in axes:
        ax.set_xticks(x, policies, fontsize=SMALL)
        ax.grid(alpha=0.3, axis="y")
    if title:
        axes[0].figure.suptitle(title, fontsize=TITLE)
    return axes


def routing_vs_replicas(num_replicas, series, predicted_hit=None, axes=None,
                        title="Routing policies as the fleet grows (simulated A100s)"):
    """Hit rate, mean TTFT and load imbalance against the number of replicas.

    ``series`` maps a policy to ``{"hit_rate": [...], "mean_ttft_ms": [...], "load_imbalance": [...]}``;
    ``predicted_hit`` maps a policy to one predicted hit rate per fleet size (dashed).
    """
    if axes is None:
        _, axes = plt.subplots(1, 3, figsize=(12, 3.3))
    keys = [("hit_rate", "prefix-cache hit rate"), ("mean_ttft_ms", "mean TTFT (ms)"),
            ("load_imbalance", "max / min requests per replica")]
    for i, (policy, values) in enumerate(series.items()):
        for ax, (key, _) in zip(axes, keys):
            ax.plot(num_replicas, values[key], "o-", color=f"C{i}", label=policy)
        if predicted_hit and policy in predicted_hit:
            axes[0].plot(num_replicas, predicted_hit[policy], "--", color=f"C{i}", alpha=0.7,
                         label=f"{policy} (predicted)")
    for ax, (_, label) in zip(axes, keys):
        ax.set_xscale("log", base=2)
        ax.set_xticks(num_replicas, [str(n) for n in num_replicas])
        ax.set_xlabel("replicas")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylim(0, 1)
    axes[0].legend(fontsize=SMALL)
    axes[0].figure.suptitle(title, fontsize=TITLE)
    return axes


def disaggregation_bars(labels, panels, axes=None, highlight=0, ttft_slo_ms=None, tpot_slo_ms=None,
                        title="Colocated vs prefill/decode pools at equal GPU count"):
    """One row of bar charts per workload: goodput, mean TTFT, mean TPOT for each split.

    ``panels`` maps a workload name to ``{"goodput": [...], "mean_ttft_ms": [...],
    "mean_tpot_ms": [...]}`` with one value per label; ``highlight`` is the label
    index drawn in a darker colour (the colocated baseline); the SLOs, when
    given, are drawn as dashed lines.
    """
    rows = len(panels)
    if axes is None:
        _, axes = plt.subplots(rows, 3, figsize=(12, 2.9 * rows), squeeze=False)
    x = np.arange(len(labels))
    colors = ["0.3" if i == highlight else "C0" for i in range(len(labels))]
    names = [("goodput", "goodput (req/s)"), ("mean_ttft_ms", "mean TTFT (ms)"),
             ("mean_tpot_ms", "mean TPOT (ms)")]
    for r, (workload, values) in enumerate(panels.items()):
        for c, (key, ylabel) in enumerate(names):
            ax = axes[r][c]
            ax.bar(x, values[key], 0.65, color=colors)
            ax.set_xticks(x, labels, fontsize=SMALL)
            ax.set_ylabel(ylabel, fontsize=SMALL)
            ax.grid(alpha=0.3, axis="y")
            if key == "mean_ttft_ms" and max(values[key]) > 20 * min(values[key]):
                ax.set_yscale("log")
            slo = {"mean_ttft_ms": ttft_slo_ms, "mean_tpot_ms": tpot_slo_ms}.get(key)
            if slo is not None:
                ax.axhline(slo, color="C3", ls="--", lw=1.2, label="SLO")
                ax.legend(fontsize=SMALL)
            if c == 0:
                ax.set_title(workload, fontsize=MEDIUM, loc="left")
    axes[0][0].figure.suptitle(title, fontsize=TITLE)
    return axes


def kv_transfer_scatter(prompt_lens, predicted_ms, measured_ms, ax=None,
                        title="Gap between token 1 and token 2 (disaggregated)"):
    """Measured first-to-second-token gap against the predicted KV transfer time, by prompt length."""
    ax = ensure_axes(ax, (5, 3.5))
    order = np.argsort(prompt_lens)
    p = np.asarray(prompt_lens)[order]
    ax.plot(p, np.asarray(predicted_ms)[order], "-", color="C3", lw=2,
            label="predicted transfer: prompt x KV bytes / link")
    ax.plot(prompt_lens, measured_ms, ".", color="black", ms=4, alpha=0.6, label="measured gap")
    ax.set_ylim(bottom=0)
    return finish(ax, title, xlabel="prompt length (tokens)", ylabel="ms")
