"""Figures for notebook 03 (continuous batching): requests as bars in the
batch seats they hold step by step (``gantt``), KV blocks held over time, and
the predicted-vs-measured bars and step-cost fit that check the notebook's
numbers (also used by the continuous-batching lab check).
"""

from __future__ import annotations

import matplotlib.pyplot as plt

from tinyserve.book.plots.common import ensure_axes, SMALL, TITLE


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
    ax = ensure_axes(ax, (10, 2.4))
    seats, spans = assign_seats(step_batches)
    used = max(seats.values(), default=-1) + 1
    num_seats = max(num_seats or 0, used)
    num_steps = len(step_batches)
    # Empty seat-steps: the grey background shows through wherever no request sits.
    ax.barh(range(num_seats), [num_steps] * num_seats, left=0, height=0.9,
            color="#e6e6e6", edgecolor="none")
    # tab20 without its two greys (14, 15): a grey request would read as an empty seat.
    colors = [plt.get_cmap("tab20")(i) for i in range(20) if i not in (14, 15)]
    for index, (rid, seat) in enumerate(seats.items()):
        first, last = spans[rid]
        width = last - first + 1
        ax.barh(seat, width, left=first, height=0.9, color=colors[index % len(colors)],
                edgecolor="white", linewidth=0.5)
        if width >= label_min_steps:
            ax.text(first + width / 2, seat, str(rid), ha="center", va="center", fontsize=SMALL)
    ax.set_xlim(0, num_steps)
    ax.set_ylim(num_seats - 0.5, -0.5)
    ax.set_yticks(range(num_seats))
    ax.set_ylabel("seat")
    ax.set_xlabel("step")
    busy = sum(len(_batch_ids(b)) for b in step_batches)
    util = busy / (num_seats * num_steps) if num_steps else 0.0
    ax.set_title(f"{title + ': ' if title else ''}{num_steps} steps, "
                 f"seats busy {util:.0%} of the time", fontsize=TITLE)
    return ax


def kv_blocks_timeline(series, exits=None, capacity=None, ax=None):
    """KV blocks held at each step, one line per batcher; markers where requests exit.

    ``series``: {label: [blocks held during step s]}; ``exits``: {label: [(step,
    blocks held after that step's exits)]}, drawn as downward triangles where
    the freed blocks went back to the pool.
    """
    ax = ensure_axes(ax, (10, 3))
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
    ax.legend(fontsize=SMALL, loc="upper right", ncol=2)
    return ax


def predicted_vs_measured(labels, predicted, measured, ax=None, ylabel="", title=None,
                          fmt="{:.0f}"):
    """Side-by-side bars: a prediction and the measurement, for each label."""
    ax = ensure_axes(ax, (5, 3))
    xs = range(len(labels))
    width = 0.38
    for offset, values, name, color in [(-width / 2, predicted, "predicted", "#9ecae1"),
                                        (width / 2, measured, "measured", "#3182bd")]:
        bars = ax.bar([x + offset for x in xs], values, width, label=name, color=color)
        for bar, v in zip(bars, values):
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), fmt.format(v),
                    ha="center", va="bottom", fontsize=SMALL)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels)
    ax.set_ylabel(ylabel)
    ax.margins(y=0.15)
    if title:
        ax.set_title(title, fontsize=TITLE)
    ax.legend(fontsize=SMALL)
    return ax


def step_cost_fit(points, model, ax=None, xlabel="tokens in the step"):
    """Measured step times, with the lines of a fitted step-cost model.

    ``points``: {label: (x values, measured ms)}; ``model``: {label: (x values, model ms)}.
    """
    ax = ensure_axes(ax, (5, 3))
    for label, (x, y) in points.items():
        (dots,) = ax.plot(x, y, "o", markersize=4, label=f"{label} (measured)")
        if label in model:
            mx, my = model[label]
            ax.plot(mx, my, "-", color=dots.get_color(), linewidth=1, label=f"{label} (model)")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("step time (ms)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=SMALL, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)  # beside the data
    return ax
