"""Figures for notebook 04 (batch-size crossover): the roofline of one decode
step against the batch size and where it turns compute-bound (also behind the
``widgets.crossover_calculator`` explorer), the classic roofline, measured step
times against it, and the latency / throughput curve as the batch grows.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import FuncFormatter

from tinyserve.book.plots.common import ensure_axes, finish, plain_number, two_and_five, SMALL, TITLE


def crossover_with_context(hw, model, dtype, context_len=0):
    """Batch where the roofline turns compute-bound once each request also reads
    ``context_len`` tokens of KV cache (inf if it never does); equals
    ``hardware.crossover_batch`` at context 0."""
    from tinyserve import hardware as hwm

    floor = hwm.weight_read_time(hw, model, dtype)
    compute = hwm.decode_step_flops(model, 1, context_len) / hw.peak_flops(dtype)
    kv = context_len * hwm.kv_bytes_per_token(model, dtype) / hw.memory_bandwidth
    return floor / (compute - kv) if compute > kv else float("inf")


def crossover_explorer(hw, model, dtype="fp16", context_len=0, ax=None, max_batch=1024):
    """Roofline of one decode step: step time (left) and tokens/s (right) against batch size.

    ``hw`` is a ``hardware.HardwareSpec``, ``model`` a ``hardware.ModelSpec``.
    Left: step time with the weight-read floor and the crossover batch marked;
    right: per-user tokens/s (falls past the crossover) and total tokens/s (stops
    growing there). ``ax``: a pair of axes, or None for a new figure. Returns the axes.
    """
    from tinyserve import hardware as hwm

    if ax is None:
        _, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    left, right = ax
    b = np.unique(np.geomspace(1, max_batch, 200).round())
    step = np.array([hwm.decode_step_time(hw, model, x, dtype, context_len) for x in b])
    floor = hwm.weight_read_time(hw, model, dtype)
    cross = crossover_with_context(hw, model, dtype, context_len)
    left.plot(b, step * 1e3, lw=2, label=f"roofline step time (context {context_len})")
    left.axhline(floor * 1e3, color="gray", ls="--", lw=1, label=f"weight-read floor {floor * 1e3:.2f} ms")
    if np.isfinite(cross):
        left.axvline(cross, color="tab:red", ls=":", lw=1.5, label=f"crossover B = {cross:.0f}")
    else:
        left.plot([], [], " ", label="no crossover: KV reads grow as fast as compute")
    left.set_xscale("log", base=2)
    left.set_ylim(bottom=0)
    finish(left, f"{model.name}, {dtype} on {hw.name}", xlabel="batch size B",
           ylabel="decode step time (ms)", title_size=TITLE, grid="both")

    per_user, total = 1 / step, b / step
    right.plot(b, per_user, color="tab:blue", lw=2, label="per-user tok/s")
    right.set_xscale("log", base=2)
    right.set_xlabel("batch size B")
    right.set_ylabel("per-user tokens/s", color="tab:blue")
    if np.isfinite(cross):
        right.axvline(cross, color="tab:red", ls=":", lw=1.5)
    twin = right.twinx()
    twin.plot(b, total, color="tab:orange", lw=2, label="total tok/s")
    twin.set_ylabel("total tokens/s", color="tab:orange")
    right.set_ylim(bottom=0)
    twin.set_ylim(bottom=0)
    right.set_title("Throughput per user and in total", fontsize=TITLE)
    right.grid(alpha=0.3)
    lines = right.get_lines()[:1] + twin.get_lines()
    right.legend(lines, [line.get_label() for line in lines], fontsize=SMALL, loc="center left")
    left.figure.tight_layout()
    return left, right


def roofline(peak_flops, bandwidth, points=None, ax=None, title="Roofline", intensity_range=(0.5, 2000)):
    """Attainable FLOP/s = min(peak, intensity x bandwidth), log-log; ``points`` maps a
    label to an arithmetic intensity (FLOPs/byte), drawn on the roof."""
    ax = ensure_axes(ax, (5, 3.5))
    x = np.geomspace(*intensity_range, 300)
    ax.plot(x, np.minimum(peak_flops, x * bandwidth) / 1e12, color="black", lw=2, label="roof")
    ridge = peak_flops / bandwidth
    ax.axvline(ridge, color="gray", ls="--", lw=1, label=f"ridge point {ridge:.0f} FLOP/byte")
    for label, ai in (points or {}).items():
        y = min(peak_flops, ai * bandwidth) / 1e12
        ax.plot([ai], [y], "o", ms=7, label=f"{label} (I={ai:.3g})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    return finish(ax, title, xlabel="arithmetic intensity (FLOP / byte)", ylabel="attainable TFLOP/s",
                  title_size=TITLE, grid="both")


def measured_vs_roofline(batch_sizes, measured_s, predicted_s, fit=None, ax=None,
                         title="Decode step: measured vs roofline", predicted_label="roofline"):
    """Measured step times (points), roofline prediction (line) and the fitted hinge
    (``hardware.KneeFit``, dashed, knee marked), in ms against a log batch axis."""
    ax = ensure_axes(ax, (5, 3.5))
    b = np.asarray(batch_sizes, dtype=float)
    ax.plot(b, np.asarray(predicted_s) * 1e3, "-", lw=2, color="tab:blue", label=predicted_label)
    ax.plot(b, np.asarray(measured_s) * 1e3, "o", color="black", label="measured")
    if fit is not None:
        grid = np.geomspace(b.min(), b.max(), 200)
        ax.plot(grid, fit.predict(grid) * 1e3, "--", color="tab:orange", lw=1.5, label="hinge fit")
        ax.axvline(fit.knee, color="tab:orange", ls=":", lw=1.5,
                   label=f"fitted knee {'>= ' if fit.flat else ''}{fit.knee:.0f}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    return finish(ax, title, xlabel="batch size B", ylabel="step time (ms)",
                  title_size=TITLE, grid="both")


def latency_throughput(curves, ax=None, title="Latency vs throughput as the batch grows",
                       annotate=(1, 16, 64, 256)):
    """Per-user tok/s (y) against total tok/s (x); ``curves`` maps a label to
    ``(batch_sizes, step_times_s)``. Batch sizes in ``annotate`` are labelled. Log-log."""
    ax = ensure_axes(ax, (5, 3.5))
    for k, (label, (b, t)) in enumerate(curves.items()):
        b, t = np.asarray(b, dtype=float), np.asarray(t, dtype=float)
        line, = ax.plot(b / t, 1 / t, "o-", ms=3, label=label)
        for x, y, bb in zip(b / t, 1 / t, b):
            if bb in annotate:       # the first curve labels above its points, the next below
                up = k % 2 == 0
                ax.annotate(f"B={bb:.0f}", (x, y), fontsize=SMALL, color=line.get_color(),
                            xytext=(3, 4) if up else (4, -5), textcoords="offset points",
                            va="bottom" if up else "top")
    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(FuncFormatter(plain_number))
        axis.set_minor_formatter(FuncFormatter(two_and_five))
    return finish(ax, title, xlabel="total tokens/s (all users)", ylabel="per-user tokens/s",
                  title_size=TITLE, grid="both")
