"""Figures for notebook 01 (batching, scheduling, queues): decode-step time and
per-request cost against the batch size, the latency / throughput trade-off of
``max_num_seqs``, who sits in the batch when, and how queue length and TTFT grow
once the arrival rate passes the service rate (the queue-length figure is reused
by notebook 06).
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from tinyserve.book.plots.common import ensure_axes, finish, plain_log_labels, SMALL, TITLE


def plot_step_time_vs_batch(batch_sizes, measured_ms, predicted_ms=None, ax=None,
                            title="Decode step time vs batch size", measured_label="measured",
                            also_measured=None):
    """Measured decode-step time (points) and predictions (lines), log batch axis.

    ``predicted_ms`` maps a label (e.g. "max(read, compute)") to one value per batch size;
    ``also_measured`` maps a label to a second measured curve (grey squares).
    """
    ax = ensure_axes(ax, (5, 3.5))
    for (label, values), style in zip((predicted_ms or {}).items(), ("--", ":", "-.", "-")):
        ax.plot(batch_sizes, values, style, lw=1.8, label=f"predicted: {label}")
    for label, values in (also_measured or {}).items():
        ax.plot(batch_sizes, values, "s-", color="0.55", lw=1.0, ms=4, label=label)
    ax.plot(batch_sizes, measured_ms, "o-", color="black", lw=1.2, label=measured_label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
    ax.set_ylim(bottom=0)
    return finish(ax, title, xlabel="batch size B (requests per step)", ylabel="step time (ms)")


def plot_per_request_time(batch_sizes, measured_ms, predicted_ms=None, ax=None,
                          title="Cost per request per token", measured_label="measured"):
    """Step time / B against B on log-log axes, with a 1/B guide through the first point."""
    ax = ensure_axes(ax, (5, 3.5))
    b = np.asarray(batch_sizes, dtype=float)
    per = np.asarray(measured_ms, dtype=float) / b
    ax.plot(b, per[0] / b, color="0.7", lw=4, alpha=0.6, label="1/B (perfect sharing)")
    for (label, values), style in zip((predicted_ms or {}).items(), ("--", ":", "-.", "-")):
        ax.plot(b, np.asarray(values, dtype=float) / b, style, lw=1.8, label=f"predicted: {label}")
    ax.plot(b, per, "o-", color="black", lw=1.2, label=measured_label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(batch_sizes, [str(x) for x in batch_sizes])
    return finish(ax, title, xlabel="batch size B (requests per step)",
                  ylabel="step time / B (ms per request)", grid="both")


def plot_tradeoff_bars(configs, measured, predicted=None, axes=None, xlabel="max_num_seqs"):
    """One panel per metric: measured bars, predicted values as black diamonds.

    ``measured`` and ``predicted`` map a metric label (with its unit) to one value per config.
    """
    metrics = list(measured)
    if axes is None:
        _, axes = plt.subplots(1, len(metrics), figsize=(3.3 * len(metrics), 3.2))
    axes = np.atleast_1d(axes)
    x = np.arange(len(configs))
    for ax, metric, color in zip(axes, metrics, ("tab:blue", "tab:orange", "tab:red", "tab:green")):
        ax.bar(x, measured[metric], width=0.6, color=color, alpha=0.75, label="measured")
        if predicted and metric in predicted:
            ax.plot(x, predicted[metric], "D", color="black", ms=6, label="predicted")
        ax.set_xticks(x, [str(c) for c in configs])
        ax.set_xlabel(xlabel)
        ax.set_title(metric, fontsize=TITLE)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=SMALL)
    axes[0].figure.tight_layout()
    return axes


def plot_request_timeline(spans, ax=None, title="Who is in the batch, and when"):
    """One row per request: queued (light bar) then in the batch (solid bar).

    ``spans`` is a list of ``(arrival, first_scheduled, finished, kind)`` in seconds,
    ``kind`` a short label ("long", "short") that picks the colour.
    """
    ax = ensure_axes(ax, figsize=(5, 3.5))
    colors = {}
    palette = ("tab:red", "tab:blue", "tab:green", "tab:purple")
    for row, (arrival, start, end, kind) in enumerate(spans):
        color = colors.setdefault(kind, palette[len(colors) % len(palette)])
        ax.barh(row, start - arrival, left=arrival, color=color, alpha=0.2, height=0.8)
        ax.barh(row, end - start, left=start, color=color, height=0.8,
                label=kind if row == [s[3] for s in spans].index(kind) else None)
    ax.invert_yaxis()
    ax.set_xlabel("time since the first arrival (s)")
    ax.set_ylabel("request (queue order)")
    ax.set_title(title, fontsize=TITLE)
    ax.legend(fontsize=SMALL, title="solid: in batch\npale: queued", title_fontsize=SMALL, loc="upper right")
    return ax


def plot_queue_length(traces, predicted=None, ax=None, title="Queue length over time",
                      source="measured", xlabel="time since the trace started (s)", title_size=None):
    """Queue length (waiting requests) against time, one line per arrival rate.

    ``traces`` maps a label to ``(times_s, queue_lengths)``, drawn as steps and named
    ``"{source} {label}"`` (notebook 06 passes ``source="simulated"``, its simulator's
    clock as ``xlabel`` and ``title_size=TITLE``); ``predicted`` maps a label to
    ``(times_s, values)``, e.g. the ``(lambda - mu) t`` growth line, drawn dashed in
    the same colour.
    """
    ax = ensure_axes(ax, (5.5, 3.5))
    for i, (label, (t, q)) in enumerate(traces.items()):
        color = f"C{i}"
        ax.step(t, q, where="post", color=color, lw=1.3, label=f"{source} {label}")
        if predicted and label in predicted:
            pt, pq = predicted[label]
            ax.plot(pt, pq, "--", color=color, lw=2, alpha=0.8, label=f"predicted {label}")
    return finish(ax, title, xlabel=xlabel, ylabel="requests waiting", title_size=title_size)


def plot_ttft_vs_arrival(series, ax=None, title="TTFT by arrival time"):
    """Each request's TTFT against when it arrived, one colour per arrival rate.

    ``series`` maps a label to ``(arrival_offsets_s, ttfts_s)``.
    """
    ax = ensure_axes(ax, (5, 3.5))
    for i, (label, (t, ttft)) in enumerate(series.items()):
        ax.plot(t, np.asarray(ttft) * 1e3, ".", color=f"C{i}", ms=3, label=label)
    ax.set_yscale("log")
    plain_log_labels(ax.yaxis)
    ax.set_xlabel("arrival time (s)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=SMALL, markerscale=3)
    return ax
