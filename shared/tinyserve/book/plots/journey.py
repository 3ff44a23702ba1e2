"""Figures for notebook 05 (a request's journey): the waterfall of one request's
stages through the engine, inter-token-latency spikes when a long prompt
arrives, KV block refcounts over time, and whether the tokenizer or the engine
limits the prompt path.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from tinyserve.book.plots.common import ensure_axes, finish, plain_log_labels, SMALL


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
    ax = ensure_axes(ax, (8, 3.2))
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
            ax.text(start * 1e3 + width / 2, y, f"{n_tok}", ha="center", va="center", fontsize=SMALL)
        if stage in ("tokenize", "queued", "detokenize"):
            ax.annotate(f"{dur * 1e3:.2f} ms", (start * 1e3 + width, y), xytext=(3, 0),
                        textcoords="offset points", va="center", fontsize=SMALL)
    ax.set_yticks(range(len(WATERFALL_STAGES)), WATERFALL_STAGES)
    ax.invert_yaxis()
    ax.set_xlabel("time since arrival (ms); numbers in prefill bars = tokens per chunk")
    ax.set_title(title)
    ax.grid(axis="x", alpha=0.3)
    return ax


def itl_spikes(series, arrival_step=None, predicted=None, ax=None,
               title="Inter-token latency of running decodes"):
    """series: {label: [(token_index or time, itl_ms), ...]}; predicted: {label: spike_ms}."""
    ax = ensure_axes(ax, figsize=(8, 3.2))
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
    plain_log_labels(ax.yaxis)
    ax.set_title(title)
    ax.legend(fontsize=SMALL, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)  # beside the data
    return ax


def refcount_map(steps, refcounts, cached=None, ax=None, title="KV block refcounts over time"):
    """refcounts: 2-D array [step, block]; cached: same shape, True where the block is hashed."""
    ax = ensure_axes(ax, figsize=(8, 3.2))
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
        # Below the axes: inside, the legend hid the highest blocks.
        ax.legend(fontsize=SMALL, loc="upper center", bbox_to_anchor=(0.5, -0.24))
    plt.colorbar(im, ax=ax, label="refcount", ticks=range(1, top + 1))
    ax.set_xlabel("engine step")
    ax.set_ylabel("physical block id")
    ax.set_title(title)
    return ax


def tokenizer_vs_engine(concurrency, engine_rates, tokenizer_rate, ax=None,
                        title="Who limits the prompt path: tokenizer or engine?"):
    """engine_rates: {label: [tokens/s at each concurrency]}; tokenizer_rate: {label: tokens/s}."""
    ax = ensure_axes(ax, figsize=(8, 3.5))
    for label, rates in engine_rates.items():
        ax.plot(concurrency[:len(rates)], rates, marker="o", label=f"engine: {label}")
    for (label, rate), ls in zip(tokenizer_rate.items(), ("--", ":", "-.")):
        ax.axhline(rate, color="black", ls=ls, lw=1.2, label=f"1 tokenizer thread: {label}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    plain_log_labels(ax.yaxis)
    finish(ax, title, xlabel="concurrent prompts in one step", ylabel="prompt tokens / s",
           grid="both", legend=None)
    ax.legend(fontsize=SMALL, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)   # below the data
    return ax
