"""Checks for lab 03 (the batch-size crossover).

Lab 03 asks for four functions (seconds, bytes, FLOP/s, as in tinyserve.hardware):

* ``weight_read_time(hw, model, dtype)``: every parameter read once, bytes / bandwidth.
* ``per_request_compute_time(hw, model, dtype)``: 2 FLOPs per parameter at peak.
* ``crossover_batch(hw, model, dtype)``: the ratio of the two.
* ``find_knee(batch_sizes, step_times) -> float``: the knee of a flat-then-linear fit;
  ``max(batch_sizes)`` when the curve does not rise; ValueError on bad input.

The references are ``tinyserve.hardware``'s functions of the same names
(``find_knee`` via ``fit_knee``). The last check, ``check_my_machine``
(``tinyserve.labs.lab03_machine``), measures the student's own machine:
ceilings with ``measure_device``, then a sweep of a stack of matmuls.
"""

from __future__ import annotations

from tinyserve.labs.hints import NOT_WRITTEN, call, fail

__all__ = ["check_weight_read_time", "check_per_request_compute_time", "check_crossover",
           "check_find_knee"]


def _lab03_cases():
    """(label, hw, model, dtype): the chapter's case first, then ones that catch shortcuts."""
    from tinyserve import hardware as H
    toy = H.HardwareSpec("toy-accelerator", {"fp32": 1.3e12, "fp16": 5.2e12, "int8": 10.4e12},
                         memory_bandwidth=37e9, memory_size=16e9)
    return [
        ("A100 + 7B, fp16", H.A100_SXM_80GB, H.LLAMA_7B, "fp16"),
        ("A100 + 7B, fp32", H.A100_SXM_80GB, H.LLAMA_7B, "fp32"),
        ("H200 + 7B, fp16", H.H200, H.LLAMA_7B, "fp16"),
        ("H100 + 70B, bf16", H.H100_SXM, H.LLAMA_70B, "bf16"),
        ("H200 + 13B, fp8", H.H200, H.LLAMA_13B, "fp8"),
        ("toy + 13B, int8", toy, H.LLAMA_13B, "int8"),
    ]


def _as_number(value, name, label):
    import math
    try:
        x = float(value)
    except (TypeError, ValueError):
        fail(f"[{label}] {name} 应返回一个数（float），得到的是 {type(value).__name__}: {value!r}",
             f"[{label}] {name} must return a number (a float), got {type(value).__name__}: {value!r}")
    if not math.isfinite(x):
        fail(f"[{label}] {name} 返回了 {x}", f"[{label}] {name} returned {x}")
    return x


def student_call(fn, name, label, *args):
    """The student's ``fn(*args)`` on the case ``label``."""
    return call(fn, name, *args, where=(f"[{label}] ",) * 2, stub=NOT_WRITTEN)


def student_number(fn, name, label, *args) -> float:
    """The student's ``fn(*args)`` on the case ``label``, which must be a finite number."""
    return _as_number(student_call(fn, name, label, *args), name, label)


def _fmt_time(seconds: float) -> str:
    a = abs(seconds)
    if a >= 1:
        return f"{seconds:.3g} s"
    if a >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    if a >= 1e-6:
        return f"{seconds * 1e6:.3g} µs"
    return f"{seconds:.3g} s"


def _check_formula(fn, name, reference, mistakes, fmt):
    """``fn`` against ``reference`` on every case; on a wrong value, the hint of the mistake that gives it.

    ``mistakes(hw, model, dtype, got, want)`` returns ([(wrong value, zh, en), ...], (zh, en) of the
    formula), the formula for the hint when no typical mistake matches.
    """
    for label, hw, model, dtype in _lab03_cases():
        got = student_number(fn, name, label, hw, model, dtype)
        want = reference(hw, model, dtype)
        if abs(got - want) <= 5e-4 * want:      # float rounding, and the chapter's rounded 153
            continue
        hints, formula = mistakes(hw, model, dtype, got, want)
        for value, zh, en in hints:
            if value is not None and abs(value - want) > 1e-9 * abs(want) and abs(got - value) <= 1e-6 * abs(value):
                fail(f"[{label}] {name} 得到 {fmt(got)}，应为 {fmt(want)}：{zh}",
                     f"[{label}] {name}: got {fmt(got)}, expected {fmt(want)}: {en}")
        fail(f"[{label}] {name} 得到 {fmt(got)}，应为 {fmt(want)}（{formula[0]}）",
             f"[{label}] {name}: got {fmt(got)}, expected {fmt(want)} ({formula[1]})")


def check_weight_read_time(weight_read_time):
    """``weight_read_time(hw, model, dtype)`` = parameters x bytes per parameter / bandwidth, in seconds."""
    from tinyserve import hardware as H
    _check_formula(weight_read_time, "weight_read_time", H.weight_read_time, _weight_read_mistakes, _fmt_time)
    a100 = H.weight_read_time(H.A100_SXM_80GB, H.LLAMA_7B, "fp16")
    print(f"✓ weight_read_time 通过：A100 上 7B fp16 每步读权重 {a100 * 1e3:.2f} ms（本章的 6.9 ms），"
          f"{len(_lab03_cases())} 组硬件/模型/dtype 都对 "
          f"/ weight_read_time passed: {a100 * 1e3:.2f} ms per step for 7B fp16 on an A100")


def _weight_read_mistakes(hw, model, dtype, got, want):
    from tinyserve import hardware as H
    n, bw, e = model.num_parameters, hw.memory_bandwidth, H.bytes_per_element(dtype)
    hints = [
        (n / bw, "是不是把每个参数的字节数算成了 1？字节数取决于 dtype：hardware.bytes_per_element(dtype)",
         "did you count 1 byte per parameter? It depends on dtype: hardware.bytes_per_element(dtype)"),
        (2 * n / bw, f"每个参数固定算了 2 字节？{dtype} 每个参数 {e} 字节：用 hardware.bytes_per_element(dtype)",
         f"did you hard-code 2 bytes per parameter? {dtype} has {e}: use hardware.bytes_per_element(dtype)"),
        (4 * n / bw, f"每个参数固定算了 4 字节？{dtype} 每个参数 {e} 字节：用 hardware.bytes_per_element(dtype)",
         f"did you hard-code 4 bytes per parameter? {dtype} has {e}: use hardware.bytes_per_element(dtype)"),
        (want * 1e3, "这是毫秒，不是秒：返回秒（不要乘 1000）",
         "that is in milliseconds: return seconds (do not multiply by 1000)"),
        (want * 1e6, "这是微秒，不是秒：返回秒", "that is in microseconds: return seconds"),
        (want * 1e9, "带宽按 GB/s 的数值用了？hw.memory_bandwidth 已经是字节每秒",
         "did you use the bandwidth in GB/s? hw.memory_bandwidth is already in bytes per second"),
        (bw / (n * e), "除反了：时间 = 字节数 / 带宽", "upside down: time = bytes / bandwidth"),
        (2 * n / hw.peak_flops(dtype), "这是计算时间（2 FLOPs × 参数量 / 峰值算力），不是读权重的时间：字节数 / 带宽",
         "that is the compute time (2 FLOPs x parameters / peak): the read time is bytes / bandwidth"),
    ]
    return hints, (f"{n:.3g} 个参数 × {e} 字节 / {bw / 1e9:.4g} GB/s",
                   f"{n:.3g} parameters x {e} bytes / {bw / 1e9:.4g} GB/s")


def check_per_request_compute_time(per_request_compute_time):
    """``per_request_compute_time(hw, model, dtype)`` = 2 x parameters / peak FLOP/s of dtype, in seconds."""
    from tinyserve import hardware as H
    _check_formula(per_request_compute_time, "per_request_compute_time", H.per_request_compute_time,
                   _compute_time_mistakes, _fmt_time)
    a100 = H.per_request_compute_time(H.A100_SXM_80GB, H.LLAMA_7B, "fp16")
    print(f"✓ per_request_compute_time 通过：A100 上 7B fp16 每多一条请求多算 {a100 * 1e6:.1f} µs（本章的 45 µs）"
          f" / per_request_compute_time passed: {a100 * 1e6:.1f} µs per extra request for 7B fp16 on an A100")


def _compute_time_mistakes(hw, model, dtype, got, want):
    from tinyserve import hardware as H
    n, peak = model.num_parameters, hw.peak_flops(dtype)
    hints = [
        (n / peak, "少了因子 2：每个参数对一个新 token 做一次乘法和一次加法，是 2 FLOPs",
         "a factor 2 is missing: each parameter does a multiply and an add per new token, 2 FLOPs"),
        (want * 1e3, "这是毫秒，不是秒：返回秒", "that is in milliseconds: return seconds"),
        (want * 1e6, "这是微秒，不是秒：返回秒（不要乘 1e6）",
         "that is in microseconds: return seconds (do not multiply by 1e6)"),
        (2 * n / hw.flops.get("fp16", float("nan")),
         f"总是用了 fp16 的峰值：要用这个 dtype 的峰值 hw.peak_flops(dtype)（{dtype}）",
         f"you always used the fp16 peak: use the peak of this dtype, hw.peak_flops(dtype) ({dtype})"),
        (2 * n * H.bytes_per_element(dtype) / peak, "计算量与字节数无关：每个参数 2 FLOPs，不要乘每个参数的字节数",
         "FLOPs do not depend on bytes: 2 FLOPs per parameter, do not multiply by bytes per parameter"),
        (peak / (2 * n), "除反了：时间 = FLOPs / 峰值算力", "upside down: time = FLOPs / peak FLOP/s"),
    ]
    return hints, (f"2 × {n:.3g} FLOPs / {peak / 1e12:.4g} TFLOP/s", f"2 x {n:.3g} FLOPs / {peak / 1e12:.4g} TFLOP/s")


def check_crossover(crossover_batch):
    """``crossover_batch(hw, model, dtype)`` = weight_read_time / per_request_compute_time
    (153 for the chapter's A100 + 7B fp16, about 206 on an H200)."""
    from tinyserve import hardware as H
    _check_formula(crossover_batch, "crossover_batch", H.crossover_batch, _crossover_mistakes, lambda x: f"{x:.4g}")
    a100 = H.crossover_batch(H.A100_SXM_80GB, H.LLAMA_7B, "fp16")
    h200 = H.crossover_batch(H.H200, H.LLAMA_7B, "fp16")
    fp32 = H.crossover_batch(H.A100_SXM_80GB, H.LLAMA_7B, "fp32")
    print(f"✓ crossover_batch 通过：A100 + 7B fp16 为 {a100:.0f}（本章的 153），H200 约 {h200:.0f}；"
          f"A100 fp32 只有 {fp32:.1f}（fp32 没有张量核心，峰值低得多，字节却多一倍）\n"
          f"  / crossover_batch passed: {a100:.0f} for 7B fp16 on an A100 (the chapter's 153), about {h200:.0f} "
          f"on an H200, {fp32:.1f} in fp32 on an A100")


def _crossover_mistakes(hw, model, dtype, got, want):
    from tinyserve import hardware as H
    e = H.bytes_per_element(dtype)
    ridge = hw.ridge_point(dtype)          # peak / bandwidth = crossover x 2 / e
    hints = [
        # A hard-coded 153, the chapter's answer, is named before any other mistake.
        (got if abs(got - 153.0) < 1.5 and abs(want - 153.0) > 1.5 else None,
         "153 只对本章的 A100 + fp16 成立，要从 hw、model、dtype 算出来，不要写死",
         "153 holds only for the chapter's A100 in fp16; compute it from hw, model and dtype instead of hard-coding it"),
        (ridge / 2, "是不是把每个参数的字节数算成了 1？交叉点 = 峰值/带宽 × 每参数字节数 / 2",
         "did you count 1 byte per parameter? crossover = peak / bandwidth x bytes per parameter / 2"),
        (ridge * 2 / 2 if e != 2 else None,
         f"每个参数固定算了 2 字节（或直接返回了算力带宽比 peak/bandwidth）？两者只在 2 字节的 dtype 下相等；{dtype} 每个参数 {e} 字节",
         f"did you hard-code 2 bytes per parameter (or return the ridge point peak / bandwidth)? They agree only "
         f"for 2-byte dtypes; {dtype} has {e}"),
        (want * 2, "大了一倍：是不是每个参数的计算量只算了 1 FLOP（应为 2：一次乘、一次加）？"
                   "或者每个参数的字节数算多了一倍？",
         "twice too large: did you count 1 FLOP per parameter (it is 2: a multiply and an add), "
         "or twice the bytes per parameter?"),
        (ridge * 4 / 2 if e != 4 else None,
         f"每个参数固定算了 4 字节？{dtype} 每个参数 {e} 字节：用 hardware.bytes_per_element(dtype)",
         f"did you hard-code 4 bytes per parameter? {dtype} has {e}: use hardware.bytes_per_element(dtype)"),
        (want / 2, "小了一半：是不是每个参数的字节数算少了一半，或者算成了 4 FLOPs？",
         "half of it: too few bytes per parameter, or 4 FLOPs per parameter?"),
        (1 / want, "除反了：交叉点 = 读权重的时间 / 每条请求的计算时间",
         "upside down: crossover = weight read time / compute time per request"),
        (want * 1e3, "单位不一致：两个时间要都用秒", "mixed units: both times must be in seconds"),
        (want / 1e3, "单位不一致：两个时间要都用秒", "mixed units: both times must be in seconds"),
        (want * 1e6, "单位不一致：两个时间要都用秒", "mixed units: both times must be in seconds"),
        (want / 1e6, "单位不一致：两个时间要都用秒", "mixed units: both times must be in seconds"),
    ]
    return hints, ("= 读权重的时间 / 每条请求的计算时间；先让前面两个检查通过",
                   "= weight read time / compute time per request; make the two checks above pass first")


# -- find_knee --

def _hinge_curve(b, knee, floor):
    import numpy as np
    return floor * np.maximum(1.0, np.asarray(b, dtype=float) / knee)


def _knee_cases():
    """(label, batch_sizes, step_times, true knee or None for flat), seeded."""
    import numpy as np
    rng = np.random.default_rng(2024)
    geo = np.unique(np.round(np.geomspace(1, 1024, 24)))
    pow2 = 2.0 ** np.arange(0, 11)
    cases = [("clean, knee 153", geo, _hinge_curve(geo, 153, 6.9e-3), 153.0)]
    for knee, b, noise in ((16, geo, 0.05), (153, geo, 0.05), (184, geo, 0.05),
                           (153, pow2, 0.03), (40, np.arange(4, 129, 4.0), 0.05)):
        for rep in range(2):
            t = _hinge_curve(b, knee, 6.9e-3) * (1 + noise * rng.standard_normal(b.size))
            cases.append((f"knee {knee}, {noise:.0%} noise, {b.size} points ({rep + 1})", b, t, float(knee)))
    for b in (pow2[:7], geo[:12]):
        for rep in range(2):
            t = 0.03 * (1 + 0.03 * rng.standard_normal(b.size))
            cases.append((f"flat, 3% noise, B = 1..{b.max():.0f} ({rep + 1})", b, t, None))
    return cases


def best_hinge_at(b, t, knee):
    """Weighted (relative-error) least-squares floor and slope for a given knee, and the residual."""
    import numpy as np
    x = np.maximum(b - knee, 0.0)
    a = np.stack([np.ones_like(b), x], 1) / t[:, None]
    coef, *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    floor, slope = float(coef[0]), max(float(coef[1]), 0.0)
    resid = float((((t - floor - slope * x) / t) ** 2).sum())
    return floor, slope, resid


def _line_only_knees(b, t):
    """What typical 'one straight line' attempts return."""
    import numpy as np
    s, a = np.polyfit(b, t, 1)
    out = []
    if s > 0:
        out += [(t.min() - a) / s, (t[0] - a) / s, -a / s, (t[:3].mean() - a) / s]
    return [float(v) for v in out]


def check_find_knee(find_knee):
    """``find_knee(batch_sizes, step_times) -> float`` on seeded noisy flat-then-linear curves,
    flat curves (the convention: return max(batch_sizes)) and bad input (ValueError)."""
    student_call(find_knee, "find_knee", "probe", [1.0, 2.0, 4.0, 8.0], [1.0, 1.0, 2.0, 4.0])
    worst = 0.0
    for label, b, t, true in _knee_cases():
        error = _check_knee(find_knee, label, b, t, true)
        if error is not None:
            worst = max(worst, error)
    _check_bad_input(find_knee)
    n = len(_knee_cases())
    print(f"✓ find_knee 通过：{n} 条合成曲线（拐点 16、40、153、184，噪声 3–5%，以及平的曲线），"
          f"最大相对误差 {worst:.0%}；坏输入都抛出 ValueError "
          f"/ find_knee passed {n} synthetic curves (worst relative error {worst:.0%}) and rejects bad input")


def _check_knee(find_knee, label, b, t, true):
    """One curve: the knee must be within 30% of ``true`` (or 25% of ``fit_knee``'s), and
    max(batch_sizes) for a flat curve. Returns the relative error (None when flat)."""
    from tinyserve.measure import fit_knee

    got = student_number(find_knee, "find_knee", label, b.copy(), t.copy())
    ref = fit_knee(b, t)
    b_max = float(b.max())
    if true is None:
        assert ref.flat, f"internal: {label} should be flat for measure.fit_knee"
        if abs(got - b_max) <= 1e-9 * b_max:
            return None
        fail(f"[{label}] 这条曲线是平的（测到的最大批 {b_max:.0f} 时还没拐），应返回 max(batch_sizes) = {b_max:.0f}，"
             f"你返回了 {got:.4g}。拟合出的折线在测量范围内上升不到地板的 10% 时，就当作没有拐点",
             f"[{label}] this curve is flat (no knee up to the largest batch, {b_max:.0f}): return "
             f"max(batch_sizes) = {b_max:.0f}, got {got:.4g}. When the fitted hinge rises by less than "
             "10% of the floor over the measured range, there is no knee in it")
    lo, hi = 0.7 * true, 1.3 * true
    if lo <= got <= hi or (not ref.flat and 0.75 * ref.knee <= got <= 1.25 * ref.knee):
        return abs(got / true - 1)
    _explain_knee(label, b, t, true, got, ref)


def _explain_knee(label, b, t, true, got, ref):
    """Raise with the mistake behind a knee ``got`` far from ``true`` (``ref`` is fit_knee's fit)."""
    import numpy as np

    b_min, b_max = float(b.min()), float(b.max())
    floor_ref = float(np.median(t[b <= true])) if (b <= true).any() else float(t.min())
    if got < 1 and got < b_min and abs(got - floor_ref) <= 0.5 * floor_ref:
        fail(f"[{label}] 你返回了 {got:.4g}，像是地板的步时（秒），不是批大小。要返回拐点所在的批大小（这里约 {true:.0f}）",
             f"[{label}] got {got:.4g}, which looks like the floor step time (seconds), not a batch size. "
             f"Return the batch size at the knee (about {true:.0f} here)")
    if got < 1 and got > 0:
        fail(f"[{label}] 你返回了 {got:.4g}：这是斜率或时间吗？要返回拐点所在的批大小（这里约 {true:.0f}）",
             f"[{label}] got {got:.4g}: a slope or a time? Return the batch size at the knee (about {true:.0f} here)")
    if not (b_min - 1e-9 <= got <= b_max + 1e-9):
        line = any(abs(got - v) <= 1e-6 * max(abs(v), 1) for v in _line_only_knees(b, t))
        extra_zh = "看起来是对所有点拟合了一条直线再求交点：" if line else ""
        extra_en = "it looks like one straight line fitted through every point: " if line else ""
        fail(f"[{label}] 你返回了 {got:.4g}，不在测量范围 [{b_min:.0f}, {b_max:.0f}] 内（真实拐点约 {true:.0f}）。"
             f"{extra_zh}候选拐点只在测到的批大小范围里取，每个候选都分别拟合“平的一段”和“斜的一段”",
             f"[{label}] got {got:.4g}, outside the measured range [{b_min:.0f}, {b_max:.0f}] (the knee is near "
             f"{true:.0f}). {extra_en}take candidate knees within the measured batch sizes and fit both the "
             "flat part and the rising part for each")
    if any(abs(got - v) <= 1e-6 * max(abs(v), 1) for v in _line_only_knees(b, t)):
        fail(f"[{label}] 你返回了 {got:.4g}（真实拐点约 {true:.0f}）：这是一条直线穿过所有点得到的。"
             "一条直线描述不了“先平后升”：对每个候选拐点 k 拟合 t = floor + slope·max(B − k, 0)，取残差最小的 k",
             f"[{label}] got {got:.4g} (the knee is near {true:.0f}): that comes from one straight line through "
             "every point. A line cannot be flat and then rise: for each candidate knee k fit "
             "t = floor + slope * max(B - k, 0) and keep the k with the smallest residual")
    _, _, r_got = best_hinge_at(b, t, got)
    _, _, r_ref = best_hinge_at(b, t, ref.knee)
    if abs(got - b_max) <= 1e-9 * b_max:
        fail(f"[{label}] 你返回了 max(batch_sizes) = {b_max:.0f}，当成了平的曲线，但它在 {true:.0f} 附近明显拐了。"
             "只有拟合出的折线在测量范围内上升不到地板的 10% 时才算平",
             f"[{label}] got max(batch_sizes) = {b_max:.0f}, i.e. a flat curve, but it clearly bends near "
             f"{true:.0f}. Call it flat only when the fitted hinge rises by less than 10% of the floor")
    if r_got > 1.5 * r_ref:
        fail(f"[{label}] 你返回了 {got:.4g}，真实拐点约 {true:.0f}（参考实现 {ref.knee:.4g}）。在你的拐点上，"
             f"最好的“先平后升”折线的相对残差是参考拐点处的 {r_got / r_ref:.1f} 倍：要试足够多的候选拐点"
             "（例如 np.geomspace(B_min, B_max, 500)），每个都用最小二乘求 floor 和 slope，保留残差最小的",
             f"[{label}] got {got:.4g}; the knee is near {true:.0f} (reference {ref.knee:.4g}). At your knee the "
             f"best flat-then-linear fit has {r_got / r_ref:.1f}x the relative residual of the reference: try "
             "enough candidate knees (e.g. np.geomspace(B_min, B_max, 500)), fit floor and slope by least "
             "squares for each, keep the smallest residual")
    fail(f"[{label}] 你返回了 {got:.4g}，真实拐点约 {true:.0f}（参考实现 {ref.knee:.4g}），超出 ±30%。"
         "最小化相对误差（每行除以 t）：否则后面又高又吵的点会把拐点拉偏",
         f"[{label}] got {got:.4g}; the knee is near {true:.0f} (reference {ref.knee:.4g}), off by more than "
         "30%. Minimise the relative error (divide each row by t): otherwise the tall, noisy tail drags the knee")


def _check_bad_input(find_knee):
    bad = [
        ("长度不同 / lengths differ", [1, 2, 4, 8], [1.0, 1.0, 2.0]),
        ("少于 3 个点 / fewer than 3 points", [1, 2], [1.0, 2.0]),
        ("批大小为 0 / a batch size of 0", [0, 2, 4, 8], [1.0, 1.0, 2.0, 4.0]),
        ("步时为负 / a negative step time", [1, 2, 4, 8], [1.0, -1.0, 2.0, 4.0]),
        ("含 NaN / a NaN", [1, 2, 4, 8], [1.0, float("nan"), 2.0, 4.0]),
    ]
    for what, b, t in bad:
        try:
            find_knee(b, t)
        except ValueError:
            continue
        except NotImplementedError:
            raise
        except Exception as e:
            fail(f"输入有问题（{what}）时应抛出 ValueError，你抛出了 {type(e).__name__}: {e}",
                 f"bad input ({what}) must raise ValueError, got {type(e).__name__}: {e}")
        fail(f"输入有问题（{what}）时应抛出 ValueError，你的函数却返回了结果。先检查输入再拟合",
             f"bad input ({what}) must raise ValueError, but your function returned. Validate before fitting")
