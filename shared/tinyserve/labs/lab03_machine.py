"""Checks for lab 03 (the batch-size crossover), on the student's own machine.

``check_my_machine(find_knee, crossover_batch)`` measures this CPU's ceilings
with ``tinyserve.measure.measure_device``, then the step time of a stack of
matmuls against batch size; it fits the knee with the student's ``find_knee``
and compares it with the student's ``crossover_batch`` on the measured
ceilings. The other checks of lab 03 are in ``tinyserve.labs.lab03``.
"""

from __future__ import annotations

from tinyserve.labs.hints import fail
from tinyserve.labs.lab03 import best_hinge_at, student_call, student_number
from tinyserve.book.plots.common import SMALL, TITLE

__all__ = ["check_my_machine"]

# How close the measured knee must come to the predicted crossover to call it a match.
PAYOFF_FACTOR = 1.5


def _sweep_matmul_stack(batch_sizes, hidden, layers, budget_s, device="cpu"):
    """Median step time of ``layers`` chained [B, hidden] @ [hidden, hidden] fp32 matmuls, per batch size.

    One warm-up step per batch size tells how long a round takes; the largest
    batch sizes are dropped (down to 8) if three rounds would not fit
    ``budget_s``. The batch sizes are then timed round-robin, 3 to 7 rounds, so
    that a burst of other work on the machine spreads over all of them instead
    of bending one. Returns (batch sizes kept, median times).
    """
    import statistics
    import time

    import torch

    from tinyserve.packed_gemm import prepacked_linear

    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(hidden, hidden, generator=gen).div_(hidden ** 0.5).to(device) for _ in range(layers)]
    xs = {b: torch.randn(b, hidden, generator=gen).to(device) for b in batch_sizes}
    # Each weight packed once per batch size, as a compiled engine does (compiled_step):
    # an eager small-batch matmul re-packs the weight on every call and never sits flat.
    layers_for = {b: [prepacked_linear(w, b) or (lambda x, w=w: x @ w.T) for w in weights]
                  for b in batch_sizes}

    def step(x):
        t0 = time.perf_counter()
        for layer in layers_for[x.shape[0]]:
            x = layer(x)
        return time.perf_counter() - t0

    start = time.perf_counter()
    step(xs[batch_sizes[0]])                      # allocator, thread pool
    warm = {b: step(xs[b]) for b in batch_sizes}  # also the cost of one round
    kept = list(batch_sizes)
    left = lambda: budget_s - (time.perf_counter() - start)             # noqa: E731
    while len(kept) > 8 and 3 * sum(warm[b] for b in kept) > left():
        kept.pop()
    rounds = int(min(7, max(3, left() / max(sum(warm[b] for b in kept), 1e-9))))
    samples = {b: [] for b in kept}
    for _ in range(rounds):
        for b in kept:
            samples[b].append(step(xs[b]))
    return kept, [statistics.median(samples[b]) for b in kept]


def check_my_machine(find_knee, crossover_batch, plot=True, budget_s: float = 10.0):
    """Measure this CPU's ceilings and the step time of a matmul stack against batch size; fit the
    knee with the student's ``find_knee``; compare it with the student's ``crossover_batch`` on the
    measured ceilings. Asserts only what always holds (a knee inside the sweep, consistent arithmetic);
    returns the data for the discussion."""
    import torch

    from tinyserve import hardware as H

    # Fail fast, before measuring anything, when a function is still a stub.
    student_call(crossover_batch, "crossover_batch", "probe", H.A100_SXM_80GB, H.LLAMA_7B, "fp16")
    student_call(find_knee, "find_knee", "probe", [1.0, 2.0, 4.0, 8.0], [1.0, 1.0, 2.0, 4.0])

    # One thread for the ceilings and the sweep alike: the ratio stays that of one core, and a
    # machine shared with other work (a laptop, CI) does not stall on a thread that lost its core.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _my_machine(find_knee, crossover_batch, plot, budget_s)
    finally:
        torch.set_num_threads(threads)


def _my_machine(find_knee, crossover_batch, plot, budget_s):
    import time

    import numpy as np

    from tinyserve import hardware as H
    from tinyserve import measure as M

    start = time.perf_counter()
    spec = M.measure_device("cpu", seconds=min(1.5, budget_s / 6), copy_mib=128, matmul_size=1024)
    hidden, layers = 1024, 32                        # 32 x 4 MiB = 128 MiB of fp32 weights: past any cache
    model = H.ModelSpec(f"{layers} x [{hidden}x{hidden}] matmuls", float(layers * hidden * hidden),
                        hidden_size=hidden, num_layers=layers, num_kv_heads=1, head_dim=hidden, vocab_size=0)
    floor_s = H.weight_read_time(spec, model, "fp32")
    per_s = H.per_request_compute_time(spec, model, "fp32")
    # Sweep to about 8x the predicted crossover (at least 32, at most 256).
    top = min(256, max(32, 8 * floor_s / per_s))
    batch_sizes = [b for b in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256) if b <= top]
    left = max(budget_s - (time.perf_counter() - start), 2.0)
    batch_sizes, step_times = _sweep_matmul_stack(batch_sizes, hidden, layers, left)
    b = np.asarray(batch_sizes, dtype=float)
    t = np.asarray(step_times, dtype=float)

    knee = student_number(find_knee, "find_knee", "your machine", b.copy(), t.copy())
    predicted = student_number(crossover_batch, "crossover_batch", "your machine", spec, model, "fp32")
    want = H.crossover_batch(spec, model, "fp32")
    if abs(predicted - want) > 1e-6 * want:
        fail(f"在测出的 {spec.name} 上，crossover_batch 得到 {predicted:.4g}，应为 {want:.4g}",
             f"on the measured {spec.name}, crossover_batch gave {predicted:.4g}, expected {want:.4g}")
    if not (b.min() - 1e-9 <= knee <= b.max() + 1e-9):
        fail(f"find_knee 返回了 {knee:.4g}，不在扫描范围 [{b.min():.0f}, {b.max():.0f}] 内",
             f"find_knee returned {knee:.4g}, outside the sweep [{b.min():.0f}, {b.max():.0f}]")
    floor, slope, _ = best_hinge_at(b, t, knee)
    flat = abs(knee - b.max()) <= 1e-9 * b.max()

    if plot:
        _plot_machine(spec, model, b, t, knee, predicted, floor, slope)
    _report_machine(spec, b, t, floor_s, knee, predicted, flat, start)
    return {"spec": spec, "model": model, "batch_sizes": batch_sizes, "step_times": step_times,
            "knee": knee, "predicted": predicted, "floor": floor, "slope": slope,
            "weight_read_floor": floor_s}


def _plot_machine(spec, model, b, t, knee, predicted, floor, slope):
    """The measured step times, the student's hinge fit and the roofline from the measured ceilings."""
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    import numpy as np

    from tinyserve import hardware as H

    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(b, t * 1e3, "o", color="C0", label="measured step time")
    bb = np.geomspace(b.min(), b.max(), 200)
    ax.plot(bb, (floor + slope * np.maximum(bb - knee, 0)) * 1e3, "-", color="C0", alpha=0.7,
            label=f"your hinge fit (knee {knee:.0f})")
    roof = [H.decode_step_time(spec, model, x, "fp32") for x in bb]
    ax.plot(bb, np.asarray(roof) * 1e3, "--", color="C1", label="roofline from measured ceilings")
    ax.axvline(knee, color="C0", ls=":", lw=1)
    ax.axvline(predicted, color="C1", ls=":", lw=1)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_ylim(0, 1.15 * max(t.max(), max(roof)) * 1e3)
    top = ax.get_ylim()[1]
    ax.annotate(f"your knee {knee:.0f}", (knee, top), xytext=(3, -12),
                textcoords="offset points", color="C0", fontsize=SMALL)
    ax.annotate(f"predicted crossover {predicted:.0f}", (predicted, top), xytext=(3, -24),
                textcoords="offset points", color="C1", fontsize=SMALL)
    ax.set_xlabel("batch size B (rows per matmul)")
    ax.set_ylabel("step time (ms)")
    ax.set_title(f"{model.name}, fp32, one thread of this CPU", fontsize=TITLE)
    ax.legend(fontsize=SMALL, loc="lower right")
    fig.tight_layout()
    plt.show()


def _report_machine(spec, b, t, floor_s, knee, predicted, flat, start):
    """Print the ceilings, the floor, the predicted crossover and the knee, side by side."""
    import time

    ratio = knee / predicted
    print(f"测出的上限 / measured ceilings: 带宽 bandwidth {spec.memory_bandwidth / 1e9:.1f} GB/s, "
          f"fp32 峰值 peak {spec.flops['fp32'] / 1e9:.0f} GFLOP/s")
    print(f"B=1 步时 / step at B=1: {t[0] * 1e3:.2f} ms，读权重的下限 / weight-read floor "
          f"{floor_s * 1e3:.2f} ms（{t[0] / floor_s:.2f}×）")
    print(f"预测的交叉点 / predicted crossover: {predicted:.1f}；你拟合的拐点 / your knee: {knee:.1f}"
          + ("（平的：拐点在扫描范围之外 / flat: beyond the sweep）" if flat else "")
          + f"；拐点/预测 = {ratio:.2f}")
    if 1 / PAYOFF_FACTOR <= ratio <= PAYOFF_FACTOR:
        print(f"✓ 拐点落在预测交叉点的 {PAYOFF_FACTOR} 倍以内：屋顶线在你的机器上成立 "
              f"/ the knee is within {PAYOFF_FACTOR}x of the predicted crossover")
    else:
        print(f"· 拐点与预测相差 {max(ratio, 1 / ratio):.1f} 倍（超出 {PAYOFF_FACTOR} 倍），原因见第 6 节 "
              f"/ the knee is {max(ratio, 1 / ratio):.1f}x off the prediction, see section 6")
    print(f"✓ 在你的机器上测完了：{len(b)} 个批大小，用时 {time.perf_counter() - start:.1f} s "
          f"/ measured your machine: {len(b)} batch sizes")
