"""The lab checks: they pass a correct scheduler and reject typical mistakes with a useful hint.

The reference below is the lab's solution written out again here (the package ships none;
its checks replay the engine's trace), so the checks are tested against an independent one.
"""

import re
import time
from collections import deque

import matplotlib
import pytest

matplotlib.use("Agg")

from tinyserve.labs import check_continuous_step, check_end_to_end, check_retire  # noqa: E402
from tinyserve.labs.lab01 import drive  # noqa: E402
from tinyserve.labs.lab01_trace import engine_trace, replayed_retire, replayed_step, workloads  # noqa: E402


def finished(request, config):
    return bool(request.output_token_ids) and request.check_stop(config.max_model_len) is not None


def retire(running, block_manager, config):
    done = [r for r in running if finished(r, config)]
    for r in done:
        running.remove(r)
        block_manager.free(r.request_id)
    return done


def continuous_step(running, waiting, block_manager, config):
    plan, budget = [], config.max_num_batched_tokens
    for r in running:
        if budget == 0:
            break
        n = min(r.num_tokens - r.num_computed_tokens, budget)
        block_manager.allocate(r.request_id, r.num_computed_tokens + n)
        plan.append((r, n))
        budget -= n
    while waiting and len(running) < config.max_num_seqs and budget > 0:
        r = waiting[0]
        n = min(r.num_tokens - r.num_computed_tokens, budget)
        if not block_manager.can_allocate(r.request_id, r.num_computed_tokens + n):
            break
        waiting.popleft()
        running.append(r)
        block_manager.allocate(r.request_id, r.num_computed_tokens + n)
        plan.append((r, n))
        budget -= n
    return plan


def make_step(*, budget=True, seats=True, blocks=True, fcfs=True, running_first=True):
    """The reference step with one rule left out."""
    def step(running, waiting, block_manager, config):
        plan, left = [], config.max_num_batched_tokens if budget else 10**9
        admitted = []
        if running_first:
            for r in running:
                if left == 0:
                    break
                n = min(r.num_tokens - r.num_computed_tokens, left)
                block_manager.allocate(r.request_id, r.num_computed_tokens + n)
                plan.append((r, n))
                left -= n
        for r in list(waiting):
            if seats and len(running) >= config.max_num_seqs or left <= 0:
                break
            n = min(r.num_tokens - r.num_computed_tokens, left)
            if blocks and not block_manager.can_allocate(r.request_id, r.num_computed_tokens + n):
                if fcfs:
                    break
                continue
            waiting.remove(r)
            running.append(r)
            admitted.append(r)
            block_manager.allocate(r.request_id, r.num_computed_tokens + n)
            plan.append((r, n))
            left -= n
        if not running_first:                      # admissions first, then the running ones
            for r in running:
                if r in admitted or left == 0:
                    continue
                n = min(r.num_tokens - r.num_computed_tokens, left)
                block_manager.allocate(r.request_id, r.num_computed_tokens + n)
                plan.append((r, n))
                left -= n
        return plan
    return step


# ---- the workloads exercise every limit --------------------------------------------

def test_workloads_never_preempt_and_each_limit_binds():
    ws = workloads()
    assert len(ws) >= 8
    for w in ws:
        assert engine_trace(w).num_preemptions == 0, w.name
    binding = set().union(*(w.binding for w in ws))
    assert {"seats", "budget", "blocks"} <= binding
    # Chunked prefill happens somewhere: a request is planned for fewer tokens than its prompt.
    assert any(n < len(s.prompt) for w in ws for step in engine_trace(w).steps
               for rid, n in step.plan for s in w.specs if s.request_id == rid and n > 1)


def test_the_engine_replayed_as_both_functions_is_the_engine():
    # The harness's partners (the engine's own decisions replayed) drive every workload to the
    # engine's outputs and blocks, so a failure in check_retire / check_continuous_step is the
    # student's function, never its partner.
    import tinyserve.labs.lab01_trace as trace_module
    assert not hasattr(trace_module, "reference_step") and not hasattr(trace_module, "reference_retire")
    for w in workloads():
        trace = engine_trace(w)
        assert drive(w, replayed_retire(trace), replayed_step(trace), trace) == len(trace.steps)


# ---- the reference passes -------------------------------------------------------------

def test_reference_passes_every_check(capsys):
    for check, args in [(check_retire, (retire,)), (check_continuous_step, (continuous_step,))]:
        started = time.perf_counter()
        check(*args)
        assert time.perf_counter() - started < 30      # meant to be ~1 s; generous for busy machines
    result = check_end_to_end(retire, continuous_step, plot=False)
    assert result["steps"] > 0 and len(result["batches"]) == result["steps"]
    out = capsys.readouterr().out
    assert out.count("✓") == 3


# ---- typical mistakes are caught, with a hint naming the right thing ---------------

def never_retires(running, block_manager, config):
    return []


def forgets_to_free(running, block_manager, config):
    done = [r for r in running if finished(r, config)]
    for r in done:
        running.remove(r)
    return done


def rebuilds_the_list(running, block_manager, config):
    done = [r for r in running if finished(r, config)]
    for r in done:
        block_manager.free(r.request_id)
    running = [r for r in running if r not in done]    # rebinds: the caller's list is unchanged
    return done


def retires_prefilling_requests(running, block_manager, config):
    done = [r for r in running if not r.output_token_ids or finished(r, config)]
    for r in done:
        running.remove(r)
        block_manager.free(r.request_id)
    return done


def ignores_eos(running, block_manager, config):
    done = [r for r in running if len(r.output_token_ids) >= r.sampling_params.max_tokens]
    for r in done:
        running.remove(r)
        block_manager.free(r.request_id)
    return done


@pytest.mark.parametrize("wrong, hint", [
    (never_retires, r"finished .* still in running"),
    (forgets_to_free, r"block_manager\.free"),
    (rebuilds_the_list, r"still in running"),
    (retires_prefilling_requests, r"not finished"),
    (ignores_eos, r"emitted EOS"),
])
def test_check_retire_rejects(wrong, hint):
    with pytest.raises(AssertionError, match=hint) as info:
        check_retire(wrong)
    assert re.search(r"[\u4e00-\u9fff]", str(info.value)), "the hint should also be in Chinese"


@pytest.mark.parametrize("wrong, hint", [
    (make_step(budget=False), r"max_num_batched_tokens"),
    (make_step(seats=False), r"max_num_seqs"),
    (make_step(blocks=False), r"can_allocate"),
    (make_step(fcfs=False), r"(?i)first come, first served"),
    (make_step(running_first=False), r"running requests first"),
])
def test_check_continuous_step_rejects(wrong, hint):
    with pytest.raises(AssertionError, match=hint) as info:
        check_continuous_step(wrong)
    assert re.search(r"[\u4e00-\u9fff]", str(info.value))


def test_check_continuous_step_names_the_step_and_the_request():
    def no_chunking(running, waiting, block_manager, config):
        # Admits only whole prompts: misses the chunked prefill the engine does.
        plan, budget = [], config.max_num_batched_tokens
        for r in running:
            if budget == 0:
                break
            n = min(r.num_tokens - r.num_computed_tokens, budget)
            block_manager.allocate(r.request_id, r.num_computed_tokens + n)
            plan.append((r, n))
            budget -= n
        while waiting and len(running) < config.max_num_seqs:
            r = waiting[0]
            n = r.num_tokens - r.num_computed_tokens
            if n > budget or not block_manager.can_allocate(r.request_id, n):
                break
            running.append(waiting.popleft())
            block_manager.allocate(r.request_id, n)
            plan.append((r, n))
            budget -= n
        return plan

    with pytest.raises(AssertionError, match=r"request \d+ should have been admitted") as info:
        check_continuous_step(no_chunking)
    assert "budget" in str(info.value)


def test_untouched_stubs_raise_not_implemented():
    def stub(*args):
        raise NotImplementedError("write your code here")

    for check, args in [(check_retire, (stub,)), (check_continuous_step, (stub,)),
                        (check_end_to_end, (stub, stub))]:
        with pytest.raises(NotImplementedError):
            check(*args)


def test_end_to_end_rejects_a_scheduler_that_never_retires():
    with pytest.raises(AssertionError, match=r"still in running"):
        check_end_to_end(never_retires, continuous_step, plot=False)


def test_end_to_end_leaves_torch_threads_alone():
    import torch

    before = torch.get_num_threads()
    check_end_to_end(retire, continuous_step, plot=False)
    assert torch.get_num_threads() == before


def test_checks_take_a_deque_for_waiting():
    seen = []

    def spy(running, waiting, block_manager, config):
        seen.append(type(waiting))
        return continuous_step(running, waiting, block_manager, config)

    check_continuous_step(spy)
    assert set(seen) == {deque}


# ---- lab 02: fused add + RMSNorm ---------------------------------------------------------
# Reference kernel and launcher written out again here, plus typical wrong kernels.

import importlib.util  # noqa: E402
import math  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from tinyserve import kernels as K  # noqa: E402  (sets TRITON_INTERPRET before any @triton.jit)
from tinyserve.labs import check_add_rmsnorm, check_add_rmsnorm_kernel, check_fused_bytes  # noqa: E402

needs_triton = pytest.mark.skipif(not K.HAS_TRITON, reason="Triton is not installed")

# The reference two-pass kernel over tiles; each wrong kernel is it with one typical mistake.
REF_KERNEL = """
@triton.jit
def kernel(x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr, n_cols, eps, BLOCK_N: tl.constexpr):
    base = tl.program_id(0) * n_cols
    sum_sq = 0.0
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = cols < n_cols
        x = tl.load(x_ptr + base + cols, mask=mask, other=0.0)
        h = x + tl.load(res_ptr + base + cols, mask=mask, other=0.0)
        tl.store(new_res_ptr + base + cols, h, mask=mask)
        sq = h.to(tl.float32) * h.to(tl.float32)
        sum_sq += tl.sum(sq, axis=0)
    rstd = 1.0 / tl.sqrt(sum_sq / n_cols + eps)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = cols < n_cols
        h32 = (tl.load(x_ptr + base + cols, mask=mask, other=0.0)
               + tl.load(res_ptr + base + cols, mask=mask, other=0.0)).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + base + cols, h32 * rstd * w, mask=mask)
"""
MISTAKES = {  # name: (text in REF_KERNEL, what a student wrote instead)
    "no_mask": ("mask = cols < n_cols", "mask = cols >= 0"),
    "fp16_norm": ("sq = h.to(tl.float32) * h.to(tl.float32)", "sq = h * h"),
    "eps_outside": ("1.0 / tl.sqrt(sum_sq / n_cols + eps)", "1.0 / (tl.sqrt(sum_sq / n_cols) + eps)"),
    "x_as_residual": ("tl.store(new_res_ptr + base + cols, h, mask=mask)", "tl.store(new_res_ptr + base + cols, x, mask=mask)"),
    "block_mean": ("sum_sq / n_cols", "sum_sq / BLOCK_N"),
    # notebook 02's kernel: one tile, right only when it holds the whole row
    "one_tile": ("range(0, n_cols, BLOCK_N)", "range(0, BLOCK_N, BLOCK_N)"),
    "per_tile_rstd": ("        w = tl.load(", "        rstd = 1.0 / tl.sqrt(tl.sum(h32 * h32, axis=0) / n_cols + eps)\n"
                      "        w = tl.load("),
}
_KERNEL_DIR = Path(tempfile.mkdtemp(prefix="tinyserve_lab02_kernels_"))


def lab02_kernel(mistake=None):
    """REF_KERNEL, or it with MISTAKES[mistake], compiled from a file (Triton reads a kernel's source)."""
    src = REF_KERNEL
    if mistake is not None:
        old, new = MISTAKES[mistake]
        assert old in src, old
        src = src.replace(old, new)
    path = _KERNEL_DIR / f"kernel_{mistake or 'ref'}.py"
    path.write_text("import triton\nimport triton.language as tl\n" + src, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.kernel


if K.HAS_TRITON:
    import triton
    import triton.language as tl

    ref_kernel = lab02_kernel()

    @triton.jit
    def stub_kernel(x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr, n_cols, eps, BLOCK_N: tl.constexpr):
        raise NotImplementedError("write your code here")


def ref_launcher(x, residual, weight, eps):
    n = x.shape[-1]
    x2, r2 = x.reshape(-1, n).contiguous(), residual.reshape(-1, n).contiguous()
    out, new_res = torch.empty_like(x2), torch.empty_like(x2)
    ref_kernel[(x2.shape[0],)](x2, r2, weight, out, new_res, n, eps, BLOCK_N=min(triton.next_power_of_2(n), 1024))
    return out.view(x.shape), new_res.view(x.shape)


def ref_fused_bytes(shape, dtype):
    n = shape[-1]
    mn = math.prod(shape)
    e = torch.empty((), dtype=dtype).element_size()
    return 4 * mn * e + n * e


@needs_triton
def test_lab02_reference_passes_every_check(capsys):
    check_fused_bytes(ref_fused_bytes)
    check_add_rmsnorm_kernel(ref_kernel)
    check_add_rmsnorm(ref_launcher)
    out = capsys.readouterr().out
    assert out.count("✓") == 3 and "bytes saved" in out and "MiB saved per call" in out


@needs_triton
@pytest.mark.filterwarnings("ignore::RuntimeWarning")       # the fp16 sum of squares overflows, as it should
@pytest.mark.parametrize("mistake, hint", [
    ("no_mask", r"wrote past the end.*mask=cols < n_cols"),
    ("fp16_norm", r"overflowed fp16.*tl\.float32"),
    ("eps_outside", r"eps is in the wrong place"),
    ("x_as_residual", r"new_residual holds x"),
    ("block_mean", r"divide by the real width n_cols"),
    ("one_tile", r"only the first 128 elements of each row.*Loop for start in range\(0, n_cols, BLOCK_N\)"),
    ("per_tile_rstd", r"each tile got its own rstd"),
])
def test_check_add_rmsnorm_kernel_rejects(mistake, hint):
    with pytest.raises(AssertionError, match=hint) as info:
        check_add_rmsnorm_kernel(lab02_kernel(mistake))
    assert re.search(r"[\u4e00-\u9fff]", str(info.value)), "the hint must also be in Chinese"


@needs_triton
def test_lab02_stubs_raise_not_implemented():
    with pytest.raises(NotImplementedError):
        check_add_rmsnorm_kernel(stub_kernel)

    def stub(*args):
        raise NotImplementedError("write your code here")

    with pytest.raises(NotImplementedError):
        check_fused_bytes(stub)
    with pytest.raises(NotImplementedError):
        check_add_rmsnorm(stub)


@pytest.mark.parametrize("wrong, hint", [
    (lambda shape, dtype: math.prod(shape) * 4 + shape[-1], r"elements, not bytes"),
    (lambda shape, dtype: ref_fused_bytes(shape, dtype) - shape[-1] * torch.empty((), dtype=dtype).element_size(),
     r"weight is missing"),
    (lambda shape, dtype: 3 * math.prod(shape) * torch.empty((), dtype=dtype).element_size()
     + shape[-1] * torch.empty((), dtype=dtype).element_size(), r"one write is missing"),
])
def test_check_fused_bytes_rejects(wrong, hint):
    with pytest.raises(AssertionError, match=hint):
        check_fused_bytes(wrong)


@needs_triton
def test_check_add_rmsnorm_rejects_a_launcher_that_drops_the_leading_dims():
    def flat(x, residual, weight, eps):
        out, new_res = ref_launcher(x, residual, weight, eps)
        return out.reshape(-1, x.shape[-1]), new_res.reshape(-1, x.shape[-1])

    with pytest.raises(AssertionError, match=r"\.view\(x\.shape\)"):
        check_add_rmsnorm(flat)


# ---- lab 03: the batch-size crossover ------------------------------------------------------
# Reference functions written out again here, plus typical wrong ones.

import numpy as np  # noqa: E402

from tinyserve.hardware import A100_SXM_80GB, H200, LLAMA_7B, bytes_per_element  # noqa: E402
from tinyserve.measure import fit_knee  # noqa: E402
from tinyserve.labs import (  # noqa: E402
    check_crossover, check_find_knee, check_my_machine, check_per_request_compute_time,
    check_weight_read_time,
)


def ref_weight_read_time(hw, model, dtype):
    return model.num_parameters * bytes_per_element(dtype) / hw.memory_bandwidth


def ref_per_request_compute_time(hw, model, dtype):
    return 2 * model.num_parameters / hw.peak_flops(dtype)


def ref_crossover_batch(hw, model, dtype):
    return ref_weight_read_time(hw, model, dtype) / ref_per_request_compute_time(hw, model, dtype)


def _hinge_search(b, t, relative=True, candidates=None):
    best = None
    for k in (np.geomspace(b.min(), b.max(), 400) if candidates is None else candidates):
        x = np.maximum(b - k, 0.0)
        a = np.stack([np.ones_like(b), x], axis=1)
        w = 1 / t if relative else np.ones_like(t)
        (floor, slope), *_ = np.linalg.lstsq(a * w[:, None], t * w, rcond=None)
        if slope < 0:
            continue
        resid = np.sum(((t - floor - slope * x) * w) ** 2)
        if best is None or resid < best[0]:
            best = (resid, float(k), float(floor), float(slope))
    return best


def ref_find_knee(batch_sizes, step_times):
    b = np.asarray(batch_sizes, dtype=float)
    t = np.asarray(step_times, dtype=float)
    if b.ndim != 1 or b.shape != t.shape or b.size < 3:
        raise ValueError("need two 1-D arrays of the same length, at least 3 points")
    if not (np.all(np.isfinite(b)) and np.all(np.isfinite(t)) and np.all(b > 0) and np.all(t > 0)):
        raise ValueError("positive, finite values only")
    best = _hinge_search(b, t)
    if best is None or best[3] * (b.max() - best[1]) < 0.1 * best[2]:
        return float(b.max())
    return best[1]


def test_lab03_reference_passes_every_check(capsys):
    check_weight_read_time(ref_weight_read_time)
    check_per_request_compute_time(ref_per_request_compute_time)
    check_crossover(ref_crossover_batch)
    check_find_knee(ref_find_knee)
    out = capsys.readouterr().out
    assert out.count("✓") == 4
    assert "6.87 ms" in out and "44.9 µs" in out and "153" in out and "206" in out


def test_lab03_hardware_reference_passes_find_knee():
    from tinyserve.measure import find_knee
    check_find_knee(find_knee)


def _validated(fn):
    """Wrap a wrong knee finder so that it still rejects bad input like the reference."""
    def wrapped(batch_sizes, step_times):
        ref_find_knee(batch_sizes, step_times)
        return fn(np.asarray(batch_sizes, dtype=float), np.asarray(step_times, dtype=float))
    return wrapped


def _floor_not_knee(b, t):
    k = ref_find_knee(b, t)
    return float(np.median(t[b <= k]))


def _one_line(b, t):
    slope, intercept = np.polyfit(b, t, 1)
    return float((t.min() - intercept) / slope)


def _never_flat(b, t):
    best = _hinge_search(b, t)
    return best[1] if best else float(b.min())


def _too_few_candidates(b, t):
    best = _hinge_search(b, t, candidates=np.geomspace(b.min(), b.max(), 5))
    return best[1]


@pytest.mark.parametrize("wrong, hint", [
    (_floor_not_knee, r"looks like the floor step time \(seconds\), not a batch size"),
    (_one_line, r"one straight line through every point"),
    (_never_flat, r"this curve is flat .* return max\(batch_sizes\)"),
    (lambda b, t: float(b.max()), r"i\.e\. a flat curve, but it clearly bends"),
    (_too_few_candidates, r"try enough candidate knees"),
])
def test_check_find_knee_rejects(wrong, hint):
    with pytest.raises(AssertionError, match=hint) as info:
        check_find_knee(_validated(wrong))
    assert re.search(r"[\u4e00-\u9fff]", str(info.value)), "the hint must also be in Chinese"


def test_check_find_knee_wants_value_errors():
    def no_validation(batch_sizes, step_times):
        try:
            return ref_find_knee(batch_sizes, step_times)
        except ValueError:
            return 1.0
    with pytest.raises(AssertionError, match=r"must raise ValueError"):
        check_find_knee(no_validation)


def test_find_knee_cases_agree_with_fit_knee():
    from tinyserve.labs.lab03 import _knee_cases
    for label, b, t, true in _knee_cases():
        fit = fit_knee(b, t)
        if true is None:
            assert fit.flat, label
        else:
            assert not fit.flat and fit.knee == pytest.approx(true, rel=0.3), label


def _one_byte_read(hw, model, dtype):
    return model.num_parameters / hw.memory_bandwidth


def _two_bytes_read(hw, model, dtype):
    return 2 * model.num_parameters / hw.memory_bandwidth


def _one_flop(hw, model, dtype):
    return model.num_parameters / hw.peak_flops(dtype)


@pytest.mark.parametrize("fn, hint", [
    (lambda hw, m, d: _one_byte_read(hw, m, d) / ref_per_request_compute_time(hw, m, d),
     r"got 76\.51, expected 153: did you count 1 byte per parameter"),
    (lambda hw, m, d: _two_bytes_read(hw, m, d) / ref_per_request_compute_time(hw, m, d),
     r"fp32\] crossover_batch: got 9\.564, expected 19\.13: did you hard-code 2 bytes per parameter"),
    (lambda hw, m, d: hw.peak_flops(d) / hw.memory_bandwidth, r"or return the ridge point"),
    (lambda hw, m, d: ref_weight_read_time(hw, m, d) / _one_flop(hw, m, d),
     r"got 306, expected 153: twice too large: did you count 1 FLOP per parameter"),
    (lambda hw, m, d: 153.0, r"153 holds only for the chapter's A100"),
    (lambda hw, m, d: 1 / ref_crossover_batch(hw, m, d), r"upside down"),
    (lambda hw, m, d: ref_weight_read_time(hw, m, d) * 1e3 / ref_per_request_compute_time(hw, m, d),
     r"mixed units"),
])
def test_check_crossover_rejects(fn, hint):
    with pytest.raises(AssertionError, match=hint) as info:
        check_crossover(fn)
    assert re.search(r"[\u4e00-\u9fff]", str(info.value))


@pytest.mark.parametrize("fn, hint", [
    (_one_byte_read, r"did you count 1 byte per parameter"),
    (_two_bytes_read, r"fp32\] .*did you hard-code 2 bytes per parameter"),
    (lambda hw, m, d: 1e3 * ref_weight_read_time(hw, m, d), r"milliseconds"),
    (lambda hw, m, d: ref_per_request_compute_time(hw, m, d), r"that is the compute time"),
])
def test_check_weight_read_time_rejects(fn, hint):
    with pytest.raises(AssertionError, match=hint):
        check_weight_read_time(fn)


@pytest.mark.parametrize("fn, hint", [
    (_one_flop, r"a factor 2 is missing"),
    (lambda hw, m, d: 2 * m.num_parameters / hw.flops["fp16"], r"you always used the fp16 peak"),
    (lambda hw, m, d: 1e6 * ref_per_request_compute_time(hw, m, d), r"microseconds"),
])
def test_check_per_request_compute_time_rejects(fn, hint):
    with pytest.raises(AssertionError, match=hint):
        check_per_request_compute_time(fn)


def test_lab03_stubs_raise_not_implemented():
    def stub(*args):
        raise NotImplementedError("write your code here")

    for check in (check_weight_read_time, check_per_request_compute_time, check_crossover, check_find_knee):
        with pytest.raises(NotImplementedError):
            check(stub)
    start = time.perf_counter()
    with pytest.raises(NotImplementedError):
        check_my_machine(stub, ref_crossover_batch)
    with pytest.raises(NotImplementedError):
        check_my_machine(ref_find_knee, stub)
    assert time.perf_counter() - start < 1, "a stub must fail before anything is measured"


def test_check_my_machine_end_to_end(capsys):
    import torch
    threads = torch.get_num_threads()
    result = check_my_machine(ref_find_knee, ref_crossover_batch, plot=False, budget_s=3.0)
    assert torch.get_num_threads() == threads
    b = result["batch_sizes"]
    assert len(b) >= 8 and b == sorted(b) and b[0] == 1
    assert min(b) <= result["knee"] <= max(b)
    assert result["predicted"] == pytest.approx(ref_crossover_batch(result["spec"], result["model"], "fp32"))
    assert all(t > 0 for t in result["step_times"])
    assert "✓" in capsys.readouterr().out


def test_check_my_machine_rejects_a_wrong_crossover_on_the_measured_machine():
    def fp16_only(hw, model, dtype):              # ignores dtype: fine on presets' fp16, wrong on the CPU
        return ref_crossover_batch(hw, model, dtype) * (2 if dtype == "fp32" else 1)
    with pytest.raises(AssertionError, match=r"on the measured .*crossover_batch gave"):
        check_my_machine(ref_find_knee, fp16_only, plot=False, budget_s=2.0)


def test_lab03_chapter_figures():
    assert ref_crossover_batch(A100_SXM_80GB, LLAMA_7B, "fp16") == pytest.approx(153, abs=0.5)
    assert ref_crossover_batch(H200, LLAMA_7B, "fp16") == pytest.approx(206, abs=0.5)


# ---- Lab 04: streaming detokenizer --------------------------------------------------------

import codecs  # noqa: E402

from tinyserve.labs import check_pending_start, check_stream_detokenizer, check_utf8_length  # noqa: E402
from tinyserve.tokenizer import StreamDetokenizer  # noqa: E402
from tinyserve.tokenizer import _pending_start as pending_start  # noqa: E402  the engine's own cut


def ref_utf8_length(b):
    return 1 if b < 0x80 else 2 if 0xC2 <= b <= 0xDF else 3 if 0xE0 <= b <= 0xEF else 4 if 0xF0 <= b <= 0xF4 else 0


def incremental_pending_start(data):
    """Independent: the longest prefix Python's incremental decoder settles is what may be emitted."""
    dec = codecs.getincrementaldecoder("utf-8")("replace")
    dec.decode(data, final=False)
    return len(data) - len(dec.getstate()[0])


class IncrementalDetokenizer:
    """Independent of tinyserve.tokenizer: Python's incremental UTF-8 decoder does the work."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token_id):
        return self.decoder.decode(self.tokenizer.token_bytes(token_id), final=False)

    def flush(self):
        return self.decoder.decode(b"", final=True)


class NaiveDetokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def push(self, token_id):
        return self.tokenizer.decode([token_id])

    def flush(self):
        return ""


class NeverFlushes(StreamDetokenizer):
    def flush(self):
        return ""


class HoldsInvalidForever:
    """Waits while strict decoding fails: right on valid text, stuck on bytes that never complete."""

    def __init__(self, tokenizer):
        self.tokenizer, self.buf = tokenizer, b""

    def push(self, token_id):
        self.buf += self.tokenizer.token_bytes(token_id)
        try:
            text, self.buf = self.buf.decode("utf-8"), b""
            return text
        except UnicodeDecodeError as e:
            text, self.buf = self.buf[:e.start].decode("utf-8"), self.buf[e.start:]
            return text

    def flush(self):
        text, self.buf = self.buf.decode("utf-8", errors="replace"), b""
        return text


class NoSecondByteRule:
    """Uses only the lead byte's length: holds E0 80 / ED A0 ... one byte too long."""

    def __init__(self, tokenizer):
        self.tokenizer, self.buf = tokenizer, b""

    def push(self, token_id):
        data = self.buf + self.tokenizer.token_bytes(token_id)
        n, cut = len(data), len(data)
        for s in range(n - 1, max(n - 4, -1), -1):
            if not 0x80 <= data[s] <= 0xBF:
                if n - s < ref_utf8_length(data[s]):
                    cut = s
                break
        self.buf = data[cut:]
        return data[:cut].decode("utf-8", errors="replace")

    def flush(self):
        text, self.buf = self.buf.decode("utf-8", errors="replace"), b""
        return text


class LagsOneToken(StreamDetokenizer):
    """Keeps the whole last token back: never broken, but not streaming either."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.held = None

    def push(self, token_id):
        out = "" if self.held is None else super().push(self.held)
        self.held = token_id
        return out

    def flush(self):
        out = "" if self.held is None else super().push(self.held)
        self.held = None
        return out + super().flush()


class PrintsSpecials(StreamDetokenizer):
    def push(self, token_id):
        if self.tokenizer.is_special(token_id):
            return self.tokenizer.decode([token_id], skip_special_tokens=False)
        return super().push(token_id)


def test_lab04_checks_pass_the_references(capsys):
    check_utf8_length(ref_utf8_length)
    check_pending_start(pending_start)
    check_pending_start(incremental_pending_start)
    check_stream_detokenizer(StreamDetokenizer)
    check_stream_detokenizer(IncrementalDetokenizer)
    out = capsys.readouterr().out
    assert out.count("✓") == 5
    assert "'好'" in out and "'🙂'" in out


@pytest.mark.parametrize("fn, hint", [
    (lambda b: 1 if 0x80 <= b <= 0xBF else ref_utf8_length(b), r"continuation byte"),
    (lambda b: 2 if b in (0xC0, 0xC1) else ref_utf8_length(b), r"overlong"),
    (lambda b: 4 if b >= 0xF5 else ref_utf8_length(b), r"above U\+10FFFF"),
    (lambda b: 0 if b < 0x80 else ref_utf8_length(b), r"whole ASCII character"),
    (lambda b: str(ref_utf8_length(b)), r"return the int"),
])
def test_check_utf8_length_rejects(fn, hint):
    with pytest.raises(AssertionError, match=hint):
        check_utf8_length(fn)


def _no_second_byte_rule(data):
    n = len(data)
    for s in range(n - 1, max(n - 4, -1), -1):
        if not 0x80 <= data[s] <= 0xBF:
            return s if n - s < ref_utf8_length(data[s]) else n
    return n


@pytest.mark.parametrize("fn, hint", [
    (len, r"keep them pending"),
    (lambda data: pending_start(data) if data[-1:] < b"\x80" else max(0, len(data) - 1), r"settled"),
    (_no_second_byte_rule, r"the second byte must be"),
    (lambda data: -1, r"return an int between 0 and len\(data\)"),
])
def test_check_pending_start_rejects(fn, hint):
    with pytest.raises(AssertionError, match=hint):
        check_pending_start(fn)


@pytest.mark.parametrize("cls, hint", [
    (NaiveDetokenizer, r"after token 4 .*you emitted '\\ufffd'|after token 4 .*you emitted '�'.*first 2 bytes of a "
                       r"3-byte character.*keep them pending"),
    (NeverFlushes, r"flush\(\) must hand them over"),
    (HoldsInvalidForever, r"are settled: .*can never form a character"),
    (NoSecondByteRule, r"the second byte must be .*emit U\+FFFD now"),
    (LagsOneToken, r"emit complete characters at once"),
    (PrintsSpecials, r"A special token .*has no text"),
])
def test_check_stream_detokenizer_rejects(cls, hint):
    with pytest.raises(AssertionError, match=hint):
        check_stream_detokenizer(cls, show=False)


def test_lab04_naive_hint_is_bilingual_and_specific():
    with pytest.raises(AssertionError) as info:
        check_stream_detokenizer(NaiveDetokenizer, show=False)
    msg = str(info.value)
    assert "第 4 个 token" in msg and "先留在缓冲区" in msg          # Chinese
    assert "after token 4" in msg and "b'\\xe4\\xb8'" in msg        # English, with the bytes


def test_lab04_stubs_raise_not_implemented():
    def stub(*args):
        raise NotImplementedError("write your code here")

    class Stub:
        def __init__(self, tokenizer):
            raise NotImplementedError("write your code here")

    class StubPush(StreamDetokenizer):
        def push(self, token_id):
            raise NotImplementedError("write your code here")

    for check, arg in ((check_utf8_length, stub), (check_pending_start, stub),
                       (check_stream_detokenizer, Stub), (check_stream_detokenizer, StubPush)):
        with pytest.raises(NotImplementedError):
            check(arg)


def test_lab04_crashing_push_becomes_a_hint():
    class Crashes(StreamDetokenizer):
        def push(self, token_id):
            raise KeyError(token_id)

    with pytest.raises(AssertionError, match=r"push raised KeyError"):
        check_stream_detokenizer(Crashes, show=False)
