"""Every figure the notebooks show, as plain functions of measured data.

Each function takes data (lists, dicts, step stats) and an optional matplotlib
``ax``, draws, and returns the axes, so notebooks, widgets and labs share them.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np


def _axes(ax, figsize=(5, 3.5)):
    """The given axes, or new ones of ``figsize`` (small figures keep notebooks light)."""
    if ax is None:
        _, ax = plt.subplots(figsize=figsize, dpi=90)
    return ax


# ---- notebook 01: batching, scheduling, queues ------------------------------------

def plot_step_time_vs_batch(batch_sizes, measured_ms, predicted_ms=None, ax=None,
                            title="Decode step time vs batch size"):
    """Measured decode-step time (points) and predictions (lines), log batch axis.

    ``predicted_ms`` maps a label (e.g. "max(read, compute)") to one value per batch size.
    """
    ax = _axes(ax, (5, 3.5))
    for (label, values), style in zip((predicted_ms or {}).items(), ("--", ":", "-.", "-")):
        ax.plot(batch_sizes, values, style, lw=1.8, label=f"predicted: {label}")
    ax.plot(batch_sizes, measured_ms, "o-", color="black", lw=1.2, label="measured")
    ax.set_xscale("log", base=2)
    ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("batch size B (requests per step)")
    ax.set_ylabel("step time (ms)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def plot_per_request_time(batch_sizes, measured_ms, predicted_ms=None, ax=None,
                          title="Cost per request per token"):
    """Step time / B against B on log-log axes, with a 1/B guide through the first point."""
    ax = _axes(ax, (5, 3.5))
    b = np.asarray(batch_sizes, dtype=float)
    per = np.asarray(measured_ms, dtype=float) / b
    ax.plot(b, per[0] / b, color="0.7", lw=4, alpha=0.6, label="1/B (perfect sharing)")
    for (label, values), style in zip((predicted_ms or {}).items(), ("--", ":", "-.", "-")):
        ax.plot(b, np.asarray(values, dtype=float) / b, style, lw=1.8, label=f"predicted: {label}")
    ax.plot(b, per, "o-", color="black", lw=1.2, label="measured")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(batch_sizes, [str(x) for x in batch_sizes])
    ax.set_xlabel("batch size B (requests per step)")
    ax.set_ylabel("step time / B (ms per request)")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return ax


def plot_tradeoff_bars(configs, measured, predicted=None, axes=None, xlabel="max_num_seqs"):
    """One panel per metric: measured bars, predicted values as black diamonds.

    ``measured`` and ``predicted`` map a metric label (with its unit) to one value per config.
    """
    metrics = list(measured)
    if axes is None:
        _, axes = plt.subplots(1, len(metrics), figsize=(3.3 * len(metrics), 3.2), dpi=90)
    axes = np.atleast_1d(axes)
    x = np.arange(len(configs))
    for ax, metric, color in zip(axes, metrics, ("tab:blue", "tab:orange", "tab:red", "tab:green")):
        ax.bar(x, measured[metric], width=0.6, color=color, alpha=0.75, label="measured")
        if predicted and metric in predicted:
            ax.plot(x, predicted[metric], "D", color="black", ms=6, label="predicted")
        ax.set_xticks(x, [str(c) for c in configs])
        ax.set_xlabel(xlabel)
        ax.set_title(metric, fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8)
    axes[0].figure.tight_layout()
    return axes


def plot_request_timeline(spans, ax=None, title="Who is in the batch, and when"):
    """One row per request: queued (light bar) then in the batch (solid bar).

    ``spans`` is a list of ``(arrival, first_scheduled, finished, kind)`` in seconds,
    ``kind`` a short label ("long", "short") that picks the colour.
    """
    ax = _axes(ax, figsize=(5, 3.5))
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
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, title="solid: in batch\npale: queued", title_fontsize=7, loc="upper right")
    return ax


def plot_queue_length(traces, predicted=None, ax=None, title="Queue length over time"):
    """Queue length (waiting requests) against time, one line per arrival rate.

    ``traces`` maps a label to ``(times_s, queue_lengths)``; ``predicted`` maps a
    label to ``(times_s, values)`` drawn dashed in the same colour.
    """
    ax = _axes(ax, (5, 3.5))
    for i, (label, (t, q)) in enumerate(traces.items()):
        color = f"C{i}"
        ax.step(t, q, where="post", color=color, lw=1.3, label=f"measured {label}")
        if predicted and label in predicted:
            pt, pq = predicted[label]
            ax.plot(pt, pq, "--", color=color, lw=2, alpha=0.8, label=f"predicted {label}")
    ax.set_xlabel("time since the trace started (s)")
    ax.set_ylabel("requests waiting")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def plot_ttft_vs_arrival(series, ax=None, title="TTFT by arrival time"):
    """Each request's TTFT against when it arrived, one colour per arrival rate.

    ``series`` maps a label to ``(arrival_offsets_s, ttfts_s)``.
    """
    ax = _axes(ax, (5, 3.5))
    for i, (label, (t, ttft)) in enumerate(series.items()):
        ax.plot(t, np.asarray(ttft) * 1e3, ".", color=f"C{i}", ms=3, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("arrival time (s)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, markerscale=3)
    return ax


# ---- notebook 03: continuous batching ------------------------------------------------

def _batch_ids(step):
    """Request ids of one step, given as ids or as (id, num_new_tokens) pairs."""
    return [item[0] if isinstance(item, (tuple, list)) else item for item in step]


def assign_seats(step_batches):
    """Seat of every request: the lowest seat free at its first step, kept to its last.

    ``step_batches`` is one list per step of the request ids in that step's
    batch (or ``(id, num_new_tokens)`` pairs, as in ``StepStats.batch``).
    Returns ``({id: seat}, {id: (first_step, last_step)})``.
    """
    spans = {}
    for step, batch in enumerate(step_batches):
        for rid in _batch_ids(batch):
            first, _ = spans.get(rid, (step, step))
            spans[rid] = (first, step)
    seats, busy_until = {}, []          # busy_until[seat] = last step of its occupant
    for rid, (first, last) in spans.items():    # in order of first appearance
        free = [s for s, until in enumerate(busy_until) if until < first]
        seat = free[0] if free else len(busy_until)
        if seat == len(busy_until):
            busy_until.append(last)
        else:
            busy_until[seat] = last
        seats[rid] = seat
    return seats, spans


def gantt(step_batches, ax=None, num_seats=None, title=None, label_min_steps=4):
    """Seats x steps: each request is a coloured bar in the seat it holds, empty seats grey.

    A request occupies its seat from its first to its last scheduled step (a
    static batch keeps finished members' seats empty until the batch ends).
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 2.4), dpi=90)
    seats, spans = assign_seats(step_batches)
    used = max(seats.values(), default=-1) + 1
    num_seats = max(num_seats or 0, used)
    num_steps = len(step_batches)
    # Empty seat-steps: the grey background shows through wherever no request sits.
    ax.barh(range(num_seats), [num_steps] * num_seats, left=0, height=0.9,
            color="#e6e6e6", edgecolor="none")
    cmap = plt.get_cmap("tab20")
    for index, (rid, seat) in enumerate(seats.items()):
        first, last = spans[rid]
        width = last - first + 1
        ax.barh(seat, width, left=first, height=0.9, color=cmap(index % 20),
                edgecolor="white", linewidth=0.5)
        if width >= label_min_steps:
            ax.text(first + width / 2, seat, str(rid), ha="center", va="center", fontsize=6)
    ax.set_xlim(0, num_steps)
    ax.set_ylim(num_seats - 0.5, -0.5)
    ax.set_yticks(range(num_seats))
    ax.set_ylabel("seat")
    ax.set_xlabel("step")
    busy = sum(len(_batch_ids(b)) for b in step_batches)
    util = busy / (num_seats * num_steps) if num_steps else 0.0
    ax.set_title(f"{title + ': ' if title else ''}{num_steps} steps, "
                 f"seats busy {util:.0%} of the time", fontsize=10)
    return ax


def kv_blocks_timeline(series, exits=None, capacity=None, ax=None):
    """KV blocks held at each step, one line per batcher; markers where requests exit.

    ``series``: {label: [blocks held during step s]}; ``exits``: {label: [(step,
    blocks held after that step's exits)]}, drawn as downward triangles where
    the freed blocks went back to the pool.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 3), dpi=90)
    colors = {}
    for label, held in series.items():
        (line,) = ax.step(range(len(held)), held, where="post", label=label, linewidth=1.3)
        colors[label] = line.get_color()
    for label, points in (exits or {}).items():
        if points:
            xs, ys = zip(*points)
            ax.scatter([x + 1 for x in xs], ys, marker="v", s=14, color=colors.get(label),
                       zorder=3, label=f"{label}: request exits, blocks freed")
    if capacity is not None:
        ax.axhline(capacity, color="black", linestyle=":", linewidth=1, label="num_kv_blocks")
    ax.set_xlabel("step")
    ax.set_ylabel("KV blocks in use")
    top = max([capacity or 0] + [max(held, default=0) for held in series.values()])
    ax.set_ylim(0, top * 1.45 + 1)          # headroom for the legend above the curves
    ax.legend(fontsize=7, loc="upper right", ncol=2)
    return ax


def predicted_vs_measured(labels, predicted, measured, ax=None, ylabel="", title=None,
                          fmt="{:.0f}"):
    """Side-by-side bars: a prediction and the measurement, for each label."""
    if ax is None:
        _, ax = plt.subplots(figsize=(5, 3), dpi=90)
    xs = range(len(labels))
    width = 0.38
    for offset, values, name, color in [(-width / 2, predicted, "predicted", "#9ecae1"),
                                        (width / 2, measured, "measured", "#3182bd")]:
        bars = ax.bar([x + offset for x in xs], values, width, label=name, color=color)
        for bar, v in zip(bars, values):
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), fmt.format(v),
                    ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels)
    ax.set_ylabel(ylabel)
    ax.margins(y=0.15)
    if title:
        ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    return ax


def step_cost_fit(points, model, ax=None, xlabel="tokens in the step"):
    """Measured step times, with the lines of a fitted step-cost model.

    ``points``: {label: (x values, measured ms)}; ``model``: {label: (x values, model ms)}.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(5, 3), dpi=90)
    for label, (x, y) in points.items():
        (dots,) = ax.plot(x, y, "o", markersize=4, label=f"{label} (measured)")
        if label in model:
            mx, my = model[label]
            ax.plot(mx, my, "-", color=dots.get_color(), linewidth=1, label=f"{label} (model)")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("step time (ms)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    return ax


# ---- notebook 02: kernel fusion ------------------------------------------------------

def bytes_moved_bars(labels, unfused, fused, ax=None, title="Bytes moved per call",
                     unit=2**20, unit_name="MiB"):
    """Grouped bars: bytes an unfused chain and the fused kernel move, for each shape in ``labels``."""
    ax = _axes(ax, (5, 3.2))
    x = np.arange(len(labels))
    width = 0.38
    for offset, values, name, color in [(-width / 2, unfused, "unfused (eager)", "tab:red"),
                                        (width / 2, fused, "fused", "tab:green")]:
        vals = np.asarray(values, dtype=float) / unit
        bars = ax.bar(x + offset, vals, width, label=name, color=color, alpha=0.8)
        for bar, v in zip(bars, vals):
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{v:.3g}",
                    ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, labels)
    ax.set_yscale("log")
    ax.set_ylabel(f"bytes read + written ({unit_name})")
    ax.set_title(title, fontsize=10)
    ax.margins(y=0.2)
    ax.legend(fontsize=7)
    return ax


def bandwidth_bars(rows, copy_gbps, ax=None, title="Achieved bandwidth", label_key="variant"):
    """Bars of GB/s (bytes moved by each variant / its median time), the copy bandwidth as a line.

    ``rows`` are dicts with at least ``GBps`` and ``label_key`` (``tinyserve.bench`` rows);
    the bar text gives the speed-up over eager where the row has one.
    """
    ax = _axes(ax, (5, 3.2))
    labels = [str(r[label_key]) for r in rows]
    values = [r["GBps"] for r in rows]
    colors = ["tab:green" if any(k in lab for k in ("compile", "triton", "fused")) else "tab:red"
              for lab in labels]
    bars = ax.bar(range(len(rows)), values, color=colors, alpha=0.8)
    for bar, r in zip(bars, rows):
        s = r.get("speedup_vs_eager")
        text = f"{r['GBps']:.0f}" + (f"\n{s:.1f}x" if s and abs(s - 1) > 1e-9 else "")
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), text,
                ha="center", va="bottom", fontsize=7)
    ax.axhline(copy_gbps, color="black", ls="--", lw=1.2, label=f"copy: {copy_gbps:.0f} GB/s")
    ax.set_xticks(range(len(rows)), [lab.replace(", ", "\n") for lab in labels], fontsize=7)
    ax.set_ylabel("GB/s (bytes moved / time)")
    ax.set_title(title, fontsize=10)
    ax.margins(y=0.2)
    ax.legend(fontsize=7, loc="upper right")
    return ax


def bytes_vs_context(contexts, series, ax=None, title="Decode attention: bytes per step",
                     unit=2**20, unit_name="MiB"):
    """Bytes moved against context length (log-log), one line per variant in ``series``."""
    ax = _axes(ax, (5, 3.2))
    styles = [("o-", "tab:red"), ("s-", "tab:green"), ("^--", "0.45"), ("d:", "0.6"), ("v-.", "0.3")]
    for i, (label, values) in enumerate(series.items()):
        style, color = styles[i % len(styles)]
        ax.plot(contexts, np.asarray(values, dtype=float) / unit, style, color=color, ms=4, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(contexts, [f"{c // 1024}k" if c >= 1024 else str(c) for c in contexts])
    ax.set_xlabel("context length (tokens per request)")
    ax.set_ylabel(f"bytes read + written ({unit_name})")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    return ax


# ---- notebook 04: batch-size crossover -----------------------------------------------

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
        _, ax = plt.subplots(1, 2, figsize=(10, 3.6), dpi=90)
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
    left.set_xlabel("batch size B")
    left.set_ylabel("decode step time (ms)")
    left.set_title(f"{model.name}, {dtype} on {hw.name}", fontsize=10)
    left.grid(alpha=0.3, which="both")
    left.legend(fontsize=7)

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
    right.set_title("Throughput per user and in total", fontsize=10)
    right.grid(alpha=0.3)
    lines = right.get_lines()[:1] + twin.get_lines()
    right.legend(lines, [line.get_label() for line in lines], fontsize=7, loc="center left")
    left.figure.tight_layout()
    return left, right


def roofline(peak_flops, bandwidth, points=None, ax=None, title="Roofline", intensity_range=(0.5, 2000)):
    """Attainable FLOP/s = min(peak, intensity x bandwidth), log-log; ``points`` maps a
    label to an arithmetic intensity (FLOPs/byte), drawn on the roof."""
    ax = _axes(ax, (5, 3.5))
    x = np.geomspace(*intensity_range, 300)
    ax.plot(x, np.minimum(peak_flops, x * bandwidth) / 1e12, color="black", lw=2, label="roof")
    ridge = peak_flops / bandwidth
    ax.axvline(ridge, color="gray", ls="--", lw=1, label=f"ridge point {ridge:.0f} FLOP/byte")
    for label, ai in (points or {}).items():
        y = min(peak_flops, ai * bandwidth) / 1e12
        ax.plot([ai], [y], "o", ms=7, label=f"{label} (I={ai:.3g})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("attainable TFLOP/s")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    return ax


def measured_vs_roofline(batch_sizes, measured_s, predicted_s, fit=None, ax=None,
                         title="Decode step: measured vs roofline", predicted_label="roofline"):
    """Measured step times (points), roofline prediction (line) and the fitted hinge
    (``hardware.KneeFit``, dashed, knee marked), in ms against a log batch axis."""
    ax = _axes(ax, (5, 3.5))
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
    ax.set_xlabel("batch size B")
    ax.set_ylabel("step time (ms)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    return ax


def latency_throughput(curves, ax=None, title="Latency vs throughput as the batch grows",
                       annotate=(1, 16, 64, 256)):
    """Per-user tok/s (y) against total tok/s (x); ``curves`` maps a label to
    ``(batch_sizes, step_times_s)``. Batch sizes in ``annotate`` are labelled. Log-log."""
    ax = _axes(ax, (5, 3.5))
    for label, (b, t) in curves.items():
        b, t = np.asarray(b, dtype=float), np.asarray(t, dtype=float)
        line, = ax.plot(b / t, 1 / t, "o-", ms=3, label=label)
        for x, y, bb in zip(b / t, 1 / t, b):
            if bb in annotate:
                ax.annotate(f"B={bb:.0f}", (x, y), fontsize=7, color=line.get_color(),
                            xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("total tokens/s (all users)")
    ax.set_ylabel("per-user tokens/s")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    return ax


# ---- notebook 05: a request's journey -------------------------------------------------

WATERFALL_STAGES = ("tokenize", "queued", "prefill", "first token", "decode", "detokenize",
                    "finish / release")


def waterfall_spans(metrics):
    """(stage, start_s, duration_s) for one finished request, times relative to arrival.

    ``metrics`` is a RequestMetrics (or a RequestOutput, whose .metrics is used).
    Prefill chunks and decode steps come from ``schedule_log``: the last
    ``len(token_times)`` entries are the steps that sampled a token (they end at
    that token's time); earlier entries are prefill chunks that end when the
    next step starts. Detokenization is interleaved with decoding; its total is
    drawn after the last token.
    """
    m = getattr(metrics, "metrics", metrics)
    t0 = m.arrival_time
    spans = [("tokenize", 0.0, m.tokenize_time)]
    first = m.first_scheduled_time if m.first_scheduled_time is not None else t0
    spans.append(("queued", m.tokenize_time, max(0.0, first - t0 - m.tokenize_time)))
    log, times = list(m.schedule_log), list(m.token_times)
    num_sampling = min(len(times), len(log))
    num_chunks = len(log) - num_sampling + (1 if num_sampling else 0)
    for k, (start, _) in enumerate(log):
        j = k - (len(log) - num_sampling)
        end = times[j] if j >= 0 else log[k + 1][0]
        stage = "prefill" if k < num_chunks else "decode"
        spans.append((stage, start - t0, end - start))
    if m.first_token_time is not None:
        spans.append(("first token", m.first_token_time - t0, 0.0))
    last = (times[-1] if times else first) - t0
    spans.append(("detokenize", last, m.detokenize_time))
    if m.finished_time is not None:
        spans.append(("finish / release", m.finished_time - t0, 0.0))
    return spans


def waterfall(output, ax=None, title="One request's journey through the engine"):
    """Horizontal bars, one row per stage, for one finished request (times in ms)."""
    ax = _axes(ax, (8, 3.2))
    spans = waterfall_spans(output)
    rows = {s: i for i, s in enumerate(WATERFALL_STAGES)}
    colors = {"tokenize": "tab:gray", "queued": "tab:orange", "prefill": "tab:blue",
              "decode": "tab:green", "detokenize": "tab:purple"}
    chunk = 0
    for stage, start, dur in spans:
        y = rows[stage]
        if stage in ("first token", "finish / release"):
            ax.plot([start * 1e3], [y], marker="D" if stage == "first token" else "X",
                    color="tab:red", markersize=8)
            ax.axvline(start * 1e3, color="tab:red", lw=0.6, ls=":")
            continue
        width = max(dur * 1e3, 1e-3)
        shade = colors[stage]
        if stage == "prefill":
            shade = ("tab:blue", "tab:cyan")[chunk % 2]
            chunk += 1
        ax.barh(y, width, left=start * 1e3, height=0.6, color=shade, edgecolor="black", lw=0.3)
        if stage == "prefill":
            n_tok = getattr(output, "metrics", output).schedule_log[chunk - 1][1]
            ax.text(start * 1e3 + width / 2, y, f"{n_tok}", ha="center", va="center", fontsize=7)
        if stage in ("tokenize", "queued", "detokenize"):
            ax.annotate(f"{dur * 1e3:.2f} ms", (start * 1e3 + width, y), xytext=(3, 0),
                        textcoords="offset points", va="center", fontsize=7)
    ax.set_yticks(range(len(WATERFALL_STAGES)), WATERFALL_STAGES)
    ax.invert_yaxis()
    ax.set_xlabel("time since arrival (ms); numbers in prefill bars = tokens per chunk")
    ax.set_title(title)
    ax.grid(axis="x", alpha=0.3)
    return ax


def itl_spikes(series, arrival_step=None, predicted=None, ax=None,
               title="Inter-token latency of running decodes"):
    """series: {label: [(token_index or time, itl_ms), ...]}; predicted: {label: spike_ms}."""
    ax = _axes(ax, figsize=(8, 3.2))
    styles = ["tab:red", "tab:blue", "tab:green", "tab:purple"]
    for (label, pts), color in zip(series.items(), styles):
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker=".", color=color, label=f"measured: {label}")
        if predicted and label in predicted:
            ax.axhline(predicted[label], color=color, ls="--", lw=1,
                       label=f"predicted peak: {label}")
    if arrival_step is not None:
        ax.axvline(arrival_step, color="gray", ls=":", label="long prompt arrives")
    ax.set_xlabel("decode step of the running requests")
    ax.set_ylabel("ITL (ms)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend(fontsize=7)
    return ax


def refcount_map(steps, refcounts, cached=None, ax=None, title="KV block refcounts over time"):
    """refcounts: 2-D array [step, block]; cached: same shape, True where the block is hashed."""
    ax = _axes(ax, figsize=(8, 3.2))
    data = np.asarray(refcounts, dtype=float).T
    shown = np.where(data > 0, data, np.nan)
    top = max(1, int(np.nanmax(data)))
    cmap = plt.get_cmap("viridis", top)
    im = ax.imshow(shown, aspect="auto", origin="lower", cmap=cmap, interpolation="nearest",
                   vmin=0.5, vmax=top + 0.5,
                   extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, data.shape[0] - 0.5))
    ever = np.nonzero((data > 0).any(axis=1) | (np.asarray(cached).T.any(axis=1)
                                                 if cached is not None else False))[0]
    if len(ever):
        ax.set_ylim(-0.5, ever.max() + 1.5)
    if cached is not None:
        free_cached = (np.asarray(cached).T) & (data == 0)
        ys, xs = np.nonzero(free_cached)
        ax.scatter(np.asarray(steps)[xs], ys, s=6, marker="s", color="lightgray",
                   label="free but still cached (refcount 0)")
        ax.legend(fontsize=7, loc="upper right")
    plt.colorbar(im, ax=ax, label="refcount", ticks=range(1, top + 1))
    ax.set_xlabel("engine step")
    ax.set_ylabel("physical block id")
    ax.set_title(title)
    return ax


def tokenizer_vs_engine(concurrency, engine_rates, tokenizer_rate, ax=None,
                        title="Who limits the prompt path: tokenizer or engine?"):
    """engine_rates: {label: [tokens/s at each concurrency]}; tokenizer_rate: {label: tokens/s}."""
    ax = _axes(ax, figsize=(8, 3.5))
    for label, rates in engine_rates.items():
        ax.plot(concurrency[:len(rates)], rates, marker="o", label=f"engine: {label}")
    for (label, rate), ls in zip(tokenizer_rate.items(), ("--", ":", "-.")):
        ax.axhline(rate, color="black", ls=ls, lw=1.2, label=f"1 tokenizer thread: {label}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrent prompts in one step")
    ax.set_ylabel("prompt tokens / s")
    ax.set_title(title)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    return ax


# ---- notebook 06: scheduling policies ----------------------------------------------

def cdf(series, ax=None, title="CDF", xlabel="seconds", log=True, marks=None):
    """Empirical CDFs, one line per label. ``series`` maps a label to values; ``marks``
    maps a label to an x value drawn as a dotted vertical line (e.g. an SLO)."""
    ax = _axes(ax, (5, 3.5))
    for i, (label, values) in enumerate(series.items()):
        v = np.sort(np.asarray([x for x in values if x is not None], dtype=float))
        if v.size:
            ax.step(v, np.arange(1, v.size + 1) / v.size, where="post", color=f"C{i}", lw=1.5, label=label)
    for label, x in (marks or {}).items():
        ax.axvline(x, color="gray", ls=":", lw=1)
        ax.annotate(label, (x, 0.03), fontsize=7, color="gray", rotation=90, ha="right")
    if log:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return ax


def starvation_vs_aging(agings, long_waits, short_ttfts, fcfs=None, predicted=None, ax=None,
                        title="Aging bounds the wait of long requests"):
    """Max queue wait of long requests (left axis) and median TTFT of short ones (right
    axis) against the aging rate; ``fcfs`` = (wait, ttft) drawn as horizontal lines;
    ``predicted`` = (agings, waits) drawn dashed."""
    ax = _axes(ax, (5.5, 3.5))
    x = np.asarray(agings, dtype=float)
    ax.plot(x, long_waits, "o-", color="C3", label="long: max queue wait")
    if predicted is not None:
        ax.plot(*predicted, "--", color="C3", alpha=0.6, label="long: predicted bound")
    if fcfs is not None:
        ax.axhline(fcfs[0], color="C3", ls=":", lw=1, label="long: FCFS")
    ax.set_xscale("symlog", linthresh=max(1.0, float(np.min(x[x > 0])) if (x > 0).any() else 1.0))
    ax.set_xlabel("aging (tokens of priority per second waited)")
    ax.set_ylabel("max queue wait of long requests (s)", color="C3")
    right = ax.twinx()
    right.plot(x, np.asarray(short_ttfts) * 1e3, "s-", color="C0", label="short: median TTFT")
    if fcfs is not None:
        right.axhline(fcfs[1] * 1e3, color="C0", ls=":", lw=1, label="short: FCFS")
    right.set_ylabel("median TTFT of short requests (ms)", color="C0")
    lines = ax.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7, loc="center right")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    return ax


def metric_bars(labels, panels, axes=None, title=None):
    """Side-by-side bar panels: ``panels`` maps a panel title to one value per label
    (or to ``(measured, predicted)`` lists, the prediction drawn as a hollow bar)."""
    if axes is None:
        _, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.2), dpi=90)
    axes = np.atleast_1d(axes)
    x = np.arange(len(labels))
    for ax, (name, values) in zip(axes, panels.items()):
        if isinstance(values, tuple):
            measured, predicted = values
            ax.bar(x - 0.2, measured, 0.4, color=[f"C{i}" for i in range(len(labels))], label="measured")
            ax.bar(x + 0.2, predicted, 0.4, fill=False, edgecolor="k", hatch="//", label="predicted")
            ax.legend(fontsize=7)
        else:
            measured = values
            ax.bar(x, measured, 0.6, color=[f"C{i}" for i in range(len(labels))])
        for xi, v in zip(x, measured):
            ax.annotate(f"{v:.3g}", (xi - (0.2 if isinstance(values, tuple) else 0), v), ha="center",
                        va="bottom", fontsize=7)
        ax.set_xticks(x, labels, rotation=20, fontsize=8)
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    if title:
        axes[0].figure.suptitle(title, fontsize=10)
    axes[0].figure.tight_layout()
    return axes


def goodput_heatmap(table, policies, workloads, ax=None, title="Goodput under SLOs (requests/s)",
                    fmt="{:.2f}"):
    """``table[policy][workload]`` as a heatmap; each column's best policy is boxed."""
    ax = _axes(ax, (1.6 * len(workloads) + 2, 0.5 * len(policies) + 1.5))
    data = np.array([[table[p][w] for w in workloads] for p in policies], dtype=float)
    # Colour each column by its own range: the workloads' absolute goodputs differ.
    lo, hi = data.min(axis=0), data.max(axis=0)
    scaled = (data - lo) / np.where(hi > lo, hi - lo, 1.0)
    ax.imshow(scaled, cmap="YlGn", aspect="auto", vmin=-0.2, vmax=1.1)
    for i in range(len(policies)):
        for j in range(len(workloads)):
            best = data[i, j] == hi[j]
            ax.text(j, i, fmt.format(data[i, j]), ha="center", va="center", fontsize=8,
                    fontweight="bold" if best else "normal")
    ax.set_xticks(range(len(workloads)), workloads, fontsize=8)
    ax.set_yticks(range(len(policies)), policies, fontsize=8)
    ax.set_title(title + "\n(colour: rank within each workload; bold: best)", fontsize=9)
    return ax


def scheduling_dashboard(result, label=None, axes=None, ttft_slo=None, tpot_slo=None):
    """One simulated run at a glance: TTFT CDF, TPOT CDF, queue length over time.
    ``result`` is a ``tinyserve.sim.SimResult`` (or a dict label -> SimResult to compare)."""
    runs = result if isinstance(result, dict) else {label or result.config.get("policy", "run"): result}
    if axes is None:
        _, axes = plt.subplots(1, 3, figsize=(12, 3.3), dpi=90)
    ttft = {k: [m.ttft for m in r.metrics if m.ttft is not None] for k, r in runs.items()}
    tpot = {k: [m.tpot * 1e3 for m in r.metrics if m.tpot is not None] for k, r in runs.items()}
    cdf(ttft, ax=axes[0], title="TTFT", xlabel="TTFT (s)",
        marks={"SLO": ttft_slo} if ttft_slo else None)
    cdf(tpot, ax=axes[1], title="TPOT", xlabel="TPOT (ms)",
        marks={"SLO": tpot_slo * 1e3} if tpot_slo else None)
    for i, (k, r) in enumerate(runs.items()):
        axes[2].step([s.start for s in r.steps], [s.num_waiting for s in r.steps], where="post",
                     color=f"C{i}", lw=1.2, label=k)
    axes[2].set_xlabel("simulated time (s)")
    axes[2].set_ylabel("requests waiting")
    axes[2].set_title("Queue length", fontsize=10)
    axes[2].grid(alpha=0.3)
    axes[2].legend(fontsize=8)
    axes[0].figure.tight_layout()
    return axes


def queue_vs_capacity(traces, predicted=None, ax=None, title="Queue length over time"):
    """Measured queue length (solid) and the predicted (lambda - mu) line (dashed) per
    arrival rate. ``traces`` / ``predicted`` map a label to ``(times_s, lengths)``."""
    ax = _axes(ax, (5.5, 3.5))
    for i, (label, (t, q)) in enumerate(traces.items()):
        ax.step(t, q, where="post", color=f"C{i}", lw=1.3, label=f"simulated {label}")
        if predicted and label in predicted:
            ax.plot(*predicted[label], "--", color=f"C{i}", lw=2, alpha=0.7, label=f"predicted {label}")
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("requests waiting")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def simulator_vs_engine(rows, ax=None, title="Simulator vs real engine (this CPU)"):
    """Bars of engine vs simulator per metric (rows from ``sim_bench.fidelity``), errors on top."""
    import numpy as np
    ax = _axes(ax, (7, 3.2))
    rows = [r for r in rows if r["metric"] != "steps"]
    x = np.arange(len(rows))
    engine = [1.0] * len(rows)
    simulated = [r["simulator"] / r["engine"] for r in rows]
    ax.bar(x - 0.2, engine, 0.4, label="real engine (= 1)")
    ax.bar(x + 0.2, simulated, 0.4, label="simulator / engine")
    for xi, r in zip(x, rows):
        ax.text(xi + 0.2, r["simulator"] / r["engine"] + 0.02, f"{100 * r['error']:+.0f}%",
                ha="center", fontsize=8)
    ax.axhspan(0.8, 1.2, color="grey", alpha=0.15, label="within 20%")
    ax.set_xticks(x, [r["metric"] for r in rows], fontsize=8)
    ax.set_ylabel("ratio to the real engine")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="lower right")
    return ax


# ---- notebook 08: tuning order ------------------------------------------------------

def plot_before_after(scenarios, before, after, ylabel, ax=None, slo=None, log=False,
                      title="Before and after the fix", labels=("before", "after")):
    """Paired bars, one pair per scenario: a metric before and after its fix (``slo``: a dashed line)."""
    ax = _axes(ax, (6, 3.2))
    x = np.arange(len(scenarios))
    ax.bar(x - 0.2, before, 0.4, color="tab:red", alpha=0.8, label=labels[0])
    ax.bar(x + 0.2, after, 0.4, color="tab:green", alpha=0.8, label=labels[1])
    if slo is not None:
        ax.axhline(slo, ls="--", color="black", lw=1, label="SLO")
    if log:
        ax.set_yscale("log")
    ax.set_xticks(x, scenarios, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    return ax


def plot_waiting_queue(runs, ax=None, title="Waiting queue over time"):
    """Waiting-queue length against time for each run; ``runs`` maps a label to its step stats."""
    ax = _axes(ax, (5.5, 3.2))
    for label, steps in runs.items():
        ax.plot([s.start for s in steps], [s.num_waiting for s in steps], lw=1.2, label=label)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("requests waiting")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def plot_itl_cdf(runs, ax=None, slo=None, title="Inter-token latency (CDF)"):
    """Empirical CDF of inter-token gaps (seconds, shown in ms); ``runs`` maps a label to gaps."""
    ax = _axes(ax, (5, 3.2))
    for label, gaps in runs.items():
        values = np.sort(np.asarray(gaps, dtype=float)) * 1e3
        ax.plot(values, np.arange(1, len(values) + 1) / len(values), lw=1.5, label=label)
    if slo is not None:
        ax.axvline(slo * 1e3, ls="--", color="black", lw=1, label="TPOT SLO")
    ax.set_xscale("log")
    ax.set_xlabel("gap between two tokens (ms)")
    ax.set_ylabel("share of gaps")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return ax


def plot_capacity(labels, predicted, measured, arrival_rate, ax=None,
                  title="Service capacity vs arrival rate"):
    """Predicted and measured capacity (requests/s) per configuration against the arrival rate."""
    ax = _axes(ax, (5.5, 3.2))
    x = np.arange(len(labels))
    ax.bar(x - 0.2, predicted, 0.4, color="tab:blue", alpha=0.5, label="predicted")
    ax.bar(x + 0.2, measured, 0.4, color="tab:blue", label="measured")
    ax.axhline(arrival_rate, color="tab:red", ls="--", lw=1.2, label=f"arrival rate {arrival_rate:g}/s")
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("requests per second")
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    return ax


# ---- notebook 07: engines and orchestration ----------------------------------------

def routing_policy_bars(policies, hit_rates, ttft_ms, predicted_hit=None, axes=None,
                        title=None, ttft_label="mean TTFT (ms)"):
    """Two panels per routing policy: prefix-cache hit rate (with predictions) and TTFT."""
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(9, 3.2), dpi=90)
    x = np.arange(len(policies))
    colors = [f"C{i}" for i in range(len(policies))]
    axes[0].bar(x, hit_rates, 0.6, color=colors, label="measured")
    if predicted_hit is not None:
        axes[0].plot(x, predicted_hit, "k_", ms=28, mew=2.5, label="predicted")
        axes[0].legend(fontsize=8)
    axes[0].set_ylabel("prefix-cache hit rate")
    axes[0].set_ylim(0, 1)
    axes[1].bar(x, ttft_ms, 0.6, color=colors)
    axes[1].set_ylabel(ttft_label)
    for ax in axes:
        ax.set_xticks(x, policies, fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    if title:
        axes[0].figure.suptitle(title, fontsize=10)
    return axes


def routing_vs_replicas(num_replicas, series, predicted_hit=None, axes=None,
                        title="Routing policies as the fleet grows (simulated A100s)"):
    """Hit rate, mean TTFT and load imbalance against the number of replicas.

    ``series`` maps a policy to ``{"hit_rate": [...], "mean_ttft_ms": [...], "load_imbalance": [...]}``;
    ``predicted_hit`` maps a policy to one predicted hit rate per fleet size (dashed).
    """
    if axes is None:
        _, axes = plt.subplots(1, 3, figsize=(12, 3.3), dpi=90)
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
    axes[0].legend(fontsize=7)
    axes[0].figure.suptitle(title, fontsize=10)
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
        _, axes = plt.subplots(rows, 3, figsize=(12, 2.9 * rows), dpi=90, squeeze=False)
    x = np.arange(len(labels))
    colors = ["0.3" if i == highlight else "C0" for i in range(len(labels))]
    names = [("goodput", "goodput (req/s)"), ("mean_ttft_ms", "mean TTFT (ms)"),
             ("mean_tpot_ms", "mean TPOT (ms)")]
    for r, (workload, values) in enumerate(panels.items()):
        for c, (key, ylabel) in enumerate(names):
            ax = axes[r][c]
            ax.bar(x, values[key], 0.65, color=colors)
            ax.set_xticks(x, labels, fontsize=8)
            ax.set_ylabel(ylabel, fontsize=8)
            ax.grid(alpha=0.3, axis="y")
            if key == "mean_ttft_ms" and max(values[key]) > 20 * min(values[key]):
                ax.set_yscale("log")
            slo = {"mean_ttft_ms": ttft_slo_ms, "mean_tpot_ms": tpot_slo_ms}.get(key)
            if slo is not None:
                ax.axhline(slo, color="C3", ls="--", lw=1.2, label="SLO")
                ax.legend(fontsize=7)
            if c == 0:
                ax.set_title(workload, fontsize=9, loc="left")
    axes[0][0].figure.suptitle(title, fontsize=10)
    return axes


def kv_transfer_scatter(prompt_lens, predicted_ms, measured_ms, ax=None,
                        title="Gap between token 1 and token 2 (disaggregated)"):
    """Measured first-to-second-token gap against the predicted KV transfer time, by prompt length."""
    ax = _axes(ax, (5, 3.5))
    order = np.argsort(prompt_lens)
    p = np.asarray(prompt_lens)[order]
    ax.plot(p, np.asarray(predicted_ms)[order], "-", color="C3", lw=2,
            label="predicted transfer: prompt x KV bytes / link")
    ax.plot(prompt_lens, measured_ms, ".", color="black", ms=4, alpha=0.6, label="measured gap")
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("ms")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return ax
