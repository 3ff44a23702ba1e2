"""Figures for notebook 06 (scheduling policies): empirical CDFs (of TTFT,
TPOT, or inter-token gaps, as notebook 08 uses it), starvation against aging,
per-policy metric bars, the goodput heatmap, the one-run scheduling dashboard
behind ``widgets.scheduling_playground``, simulator-vs-engine fidelity, the
simulator's cost models against published vLLM measurements, and against a live
vLLM swept on this CPU.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import FuncFormatter, NullFormatter

from tinyserve.book.plots.common import ensure_axes, finish, plain_number, two_and_five, SMALL, MEDIUM, TITLE
from tinyserve.sim.fidelity import SPEED_METRICS


def cdf(series, ax=None, title="CDF", xlabel="seconds", ylabel="fraction of requests",
        log=True, marks=None, scale=1.0):
    """Empirical CDFs, one line per label; ``None`` values are skipped.

    ``series`` maps a label to values (TTFTs, TPOTs, inter-token gaps, ...);
    ``marks`` maps a label to an x value (e.g. an SLO) drawn as a dotted vertical
    line, named in the legend. Values and marks are in the same unit and multiplied by ``scale`` for
    the x axis (``scale=1e3`` to show seconds in ms).
    """
    ax = ensure_axes(ax, (5, 3.5))
    span = []
    for i, (label, values) in enumerate(series.items()):
        v = np.sort(np.asarray([x for x in values if x is not None], dtype=float)) * scale
        if v.size:
            ax.step(v, np.arange(1, v.size + 1) / v.size, where="post", color=f"C{i}", lw=1.5, label=label)
            span += [v[0], v[-1]]
    for label, x in (marks or {}).items():
        # Named in the legend, not written on the plot, where it would sit on some curve.
        ax.axvline(x * scale, color="gray", ls=":", lw=1.2, label=f"{label} ({x * scale:g})")
    if log:
        ax.set_xscale("log")
        # Plain numbers, not "3x10^1"; within less than two decades also 2x and 5x.
        ax.xaxis.set_major_formatter(FuncFormatter(plain_number))
        narrow = span and min(span) > 0 and max(span) / min(span) < 100
        ax.xaxis.set_minor_formatter(FuncFormatter(two_and_five) if narrow else NullFormatter())
    ax.set_ylim(0, 1.02)
    return finish(ax, title, xlabel=xlabel, ylabel=ylabel, title_size=TITLE, grid="both")


def starvation_vs_aging(agings, long_waits, short_ttfts, fcfs=None, predicted=None, ax=None,
                        title="Aging bounds the wait of long requests"):
    """Max queue wait of long requests (left axis) and median TTFT of short ones (right
    axis) against the aging rate; ``fcfs`` = (wait, ttft) drawn as horizontal lines;
    ``predicted`` = (agings, waits) drawn dashed."""
    ax = ensure_axes(ax, (5.5, 3.5))
    x = np.asarray(agings, dtype=float)
    ax.plot(x, long_waits, "o-", color="C3", label="long: max queue wait")
    if predicted is not None:
        ax.plot(*predicted, "--", color="C3", alpha=0.6, label="long: predicted bound")
    if fcfs is not None:
        ax.axhline(fcfs[0], color="C3", ls=":", lw=1, label="long: FCFS")
    ax.set_xscale("symlog", linthresh=max(1.0, float(np.min(x[x > 0])) if (x > 0).any() else 1.0))
    # Ticks at the swept rates only: symlog's own put "0" and "10^1" on top of each other.
    ax.set_xticks(x, [f"{v:g}" for v in x])
    ax.minorticks_off()
    ax.set_xlabel("aging (tokens of priority per second waited)")
    ax.set_ylabel("max queue wait of long requests (s)", color="C3")
    right = ax.twinx()
    right.plot(x, np.asarray(short_ttfts) * 1e3, "s-", color="C0", label="short: median TTFT")
    if fcfs is not None:
        right.axhline(fcfs[1] * 1e3, color="C0", ls=":", lw=1, label="short: FCFS")
    right.set_ylabel("median TTFT of short requests (ms)", color="C0")
    lines = ax.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    # Below the axes: inside, the legend sat on the curves.
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=SMALL, loc="upper center",
              bbox_to_anchor=(0.5, -0.3), ncol=2)
    ax.set_title(title, fontsize=TITLE)
    ax.grid(alpha=0.3)
    return ax


def metric_bars(labels, panels, axes=None, title=None):
    """Side-by-side bar panels: ``panels`` maps a panel title to one value per label
    (or to ``(measured, predicted)`` lists, the prediction drawn as a hollow bar)."""
    if axes is None:
        _, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.2))
    axes = np.atleast_1d(axes)
    x = np.arange(len(labels))
    for ax, (name, values) in zip(axes, panels.items()):
        if isinstance(values, tuple):
            measured, predicted = values
            ax.bar(x - 0.2, measured, 0.4, color=[f"C{i}" for i in range(len(labels))], label="measured")
            ax.bar(x + 0.2, predicted, 0.4, fill=False, edgecolor="k", hatch="//", label="predicted")
            ax.legend(fontsize=SMALL)
        else:
            measured = values
            ax.bar(x, measured, 0.6, color=[f"C{i}" for i in range(len(labels))])
        for xi, v in zip(x, measured):
            ax.annotate(f"{v:.3g}", (xi - (0.2 if isinstance(values, tuple) else 0), v), ha="center",
                        va="bottom", fontsize=SMALL)
        ax.set_xticks(x, labels, rotation=20, fontsize=SMALL)
        ax.set_title(name, fontsize=MEDIUM)
        ax.grid(alpha=0.3, axis="y")
    if title:
        axes[0].figure.suptitle(title, fontsize=TITLE)
    axes[0].figure.tight_layout()
    return axes


def goodput_heatmap(table, policies, workloads, ax=None, title="Goodput under SLOs (requests/s)",
                    fmt="{:.2f}"):
    """``table[policy][workload]`` as a heatmap; each column's best policy is boxed."""
    ax = ensure_axes(ax, (1.6 * len(workloads) + 2, 0.5 * len(policies) + 1.5))
    data = np.array([[table[p][w] for w in workloads] for p in policies], dtype=float)
    # Colour each column by its own range: the workloads' absolute goodputs differ.
    lo, hi = data.min(axis=0), data.max(axis=0)
    scaled = (data - lo) / np.where(hi > lo, hi - lo, 1.0)
    ax.imshow(scaled, cmap="YlGn", aspect="auto", vmin=-0.2, vmax=1.1)
    for i in range(len(policies)):
        for j in range(len(workloads)):
            best = data[i, j] == hi[j]
            ax.text(j, i, fmt.format(data[i, j]), ha="center", va="center", fontsize=SMALL,
                    fontweight="bold" if best else "normal",
                    color="white" if scaled[i, j] > 0.7 else "black")     # readable on dark green
    ax.set_xticks(range(len(workloads)), workloads, fontsize=SMALL)
    ax.set_yticks(range(len(policies)), policies, fontsize=SMALL)
    ax.set_title(title + "\n(colour: rank within each workload; bold: best)", fontsize=MEDIUM)
    return ax


def scheduling_dashboard(result, label=None, axes=None, ttft_slo=None, tpot_slo=None):
    """One simulated run at a glance: TTFT CDF, TPOT CDF, queue length over time.
    ``result`` is a ``tinyserve.sim.SimResult`` (or a dict label -> SimResult to compare)."""
    runs = result if isinstance(result, dict) else {label or result.config.get("policy", "run"): result}
    if axes is None:
        _, axes = plt.subplots(1, 3, figsize=(12, 3.3))
    ttft = {k: [m.ttft for m in r.metrics if m.ttft is not None] for k, r in runs.items()}
    tpot = {k: [m.tpot for m in r.metrics if m.tpot is not None] for k, r in runs.items()}
    cdf(ttft, ax=axes[0], title="TTFT", xlabel="TTFT (s)",
        marks={"SLO": ttft_slo} if ttft_slo else None)
    cdf(tpot, ax=axes[1], title="TPOT", xlabel="TPOT (ms)", scale=1e3,
        marks={"SLO": tpot_slo} if tpot_slo else None)
    for i, (k, r) in enumerate(runs.items()):
        axes[2].step([s.start for s in r.steps], [s.num_waiting for s in r.steps], where="post",
                     color=f"C{i}", lw=1.2, label=k)
    axes[2].set_ylim(bottom=0)
    finish(axes[2], "Queue length", xlabel="simulated time (s)", ylabel="requests waiting", title_size=TITLE)
    axes[0].figure.tight_layout()
    return axes


def simulator_vs_engine(rows, ax=None, title="Simulator vs real engine"):
    """Bars of engine vs simulator per metric (rows from ``sim_bench.fidelity``), errors on top."""
    ax = ensure_axes(ax, (7, 3.2))
    rows = [r for r in rows if r["metric"] != "steps"]
    x = np.arange(len(rows))
    engine = [1.0] * len(rows)
    simulated = [r["simulator"] / r["engine"] for r in rows]
    ax.bar(x - 0.2, engine, 0.4, label="real engine (= 1)")
    ax.bar(x + 0.2, simulated, 0.4, label="simulator / engine")
    for xi, r in zip(x, rows):
        ax.text(xi + 0.2, r["simulator"] / r["engine"] + 0.02, f"{100 * r['error']:+.0f}%",
                ha="center", fontsize=SMALL)
    ax.axhspan(0.8, 1.2, color="grey", alpha=0.15, label="within 20%")
    ax.set_xticks(x, [r["metric"] for r in rows], fontsize=SMALL)
    ax.set_ylabel("ratio to the real engine")
    ax.set_title(title)
    ax.legend(fontsize=SMALL, loc="lower right")
    return ax


def cost_models_vs_published(rows, sweep, axes=None, band=0.15):
    """Left: output throughput of a concurrency sweep (``sweep`` maps concurrency to a
    measurement id), measured and predicted by each cost model. Right: predicted /
    measured for every throughput-like metric (rows from ``sim.fidelity.compare``; one
    throughput per measurement), the ``band`` shaded, held-out points starred. Latency
    metrics are inverted so that > 1 always means "predicted faster than measured"."""
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [1, 1.6]})
    models = list(rows[0].predicted)
    by = {(r.id, r.metric): r for r in rows}
    conc = sorted(sweep)
    axes[0].plot(conc, [by[sweep[c], "output_throughput"].measured for c in conc], "ko", label="measured")
    for i, name in enumerate(models):
        axes[0].plot(conc, [by[sweep[c], "output_throughput"].predicted[name] for c in conc],
                     "--" if name == "roofline" else "-", color=f"C{i}", label=name)
    finish(axes[0], "RTX 4090, Mistral-7B, 256 in", xlabel="max concurrency", ylabel="output tokens/s",
           title_size=TITLE)
    # A measurement's request rate says what its token rate says: one of the two is enough.
    speed = [r for r in rows if r.metric in SPEED_METRICS
             and not (r.metric == "request_throughput" and (r.id, "output_throughput") in by)]
    x = np.arange(len(speed))
    width = 0.8 / len(models)
    for i, name in enumerate(models):
        ratio = [1 + r.speed_error(name) for r in speed]
        axes[1].bar(x + (i - (len(models) - 1) / 2) * width, ratio, width, color=f"C{i}", label=name)
    axes[1].axhspan(1 - band, 1 + band, color="grey", alpha=0.15, label=f"within {band:.0%}")
    axes[1].axhline(1, color="k", lw=0.8)
    axes[1].set_yscale("log")
    axes[1].yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axes[1].yaxis.set_minor_formatter(NullFormatter())
    axes[1].set_yticks([0.5, 0.75, 1, 1.5, 2, 3, 4, 6])
    short = {"output_throughput": "tok/s", "request_throughput": "req/s", "mean_tpot": "TPOT", "mean_e2e": "e2e"}
    labels = []
    for r in speed:
        name = r.id
        for part in ("-mistral7b", "-llama3-8b", "-qwen3-0.6b", "-sharegpt320", "-offline-256", "-laptop"):
            name = name.replace(part, "")
        labels.append(f"{'* ' if r.split == 'held-out' else ''}{name} {short[r.metric]}")
    axes[1].set_xticks(x, labels, fontsize=SMALL, rotation=40, ha="right")
    axes[1].set_ylabel("predicted speed / measured")
    axes[1].set_title("Every throughput-like point (* held out)", fontsize=TITLE)
    axes[1].legend(fontsize=SMALL, loc="upper right")
    axes[1].grid(alpha=0.3, axis="y")
    axes[0].figure.tight_layout()
    return axes


def live_vllm_sweep(lines, metrics=(("output_throughput", "output tokens/s", 1.0),
                                    ("median_tpot", "median TPOT (ms)", 1e3),
                                    ("median_ttft", "median TTFT (s)", 1.0)),
                    axes=None, title=None):
    """A live vLLM sweep against the simulator: one panel per metric, measured (dots) and
    predicted (lines) against max concurrency, one colour per length shape, the
    calibration shape dashed. ``lines``: the rows of ``bench.vllm_live.judge``'s report
    (points at a Poisson rate are left out: they have no concurrency)."""
    if axes is None:
        _, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 3.4))
    points = [r for r in lines if r["load"].startswith("c")]
    fitted_on = {r["shape"] for r in points if r["split"] == "calibration"}
    shapes = sorted({r["shape"] for r in points}, key=lambda s: (s not in fitted_on, s))    # the fitted one first
    for ax, (metric, label, scale) in zip(axes, metrics):
        for i, shape in enumerate(shapes):
            mine = sorted((int(r["load"][1:]), r) for r in points if r["shape"] == shape and r["metric"] == metric)
            conc = [c for c, _ in mine]
            fitted = mine[0][1]["split"] == "calibration"
            ax.plot(conc, [r["measured"] * scale for _, r in mine], "o", color=f"C{i}", label=f"{shape} measured")
            ax.plot(conc, [r["predicted"] * scale for _, r in mine], "--" if fitted else "-", color=f"C{i}",
                    label=f"{shape} predicted" + (" (fitted on it)" if fitted else ""))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(plain_number))
        ax.yaxis.set_major_formatter(FuncFormatter(plain_number))
        finish(ax, label, xlabel="max concurrency", title_size=MEDIUM, grid="both",
               legend=SMALL if ax is axes[0] else None)
    if title:
        axes[0].figure.suptitle(title, fontsize=TITLE)
    axes[0].figure.tight_layout()
    return axes
