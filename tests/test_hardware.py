import math
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from tinyserve import hardware as hwm
from tinyserve.hardware import (
    A100_SXM_80GB, H100_SXM, H200, LLAMA_7B, LLAMA_70B, ModelSpec, crossover_batch,
    decode_step_time, kv_bytes_per_token, per_request_compute_time, tokens_per_second,
    weight_bytes, weight_read_time,
)
from tinyserve import host, measure, packed_gemm
from tinyserve.measure import find_knee, fit_knee, measure_device
from tinyserve.packed_gemm import PACKED_PATHS, prepacked_linear
from tinyserve.model import KVCache, LlamaForServing, ModelConfig, get_preset


def test_chapter_figures_a100_llama7b_fp16():
    assert weight_bytes(LLAMA_7B, "fp16") == 14e9
    assert weight_read_time(A100_SXM_80GB, LLAMA_7B, "fp16") == pytest.approx(6.9e-3, abs=0.1e-3)
    assert per_request_compute_time(A100_SXM_80GB, LLAMA_7B, "fp16") == pytest.approx(45e-6, abs=1e-6)
    assert crossover_batch(A100_SXM_80GB, LLAMA_7B, "fp16") == pytest.approx(153, abs=1)
    # the ratio is exactly the ridge point peak / bandwidth in fp16
    assert crossover_batch(A100_SXM_80GB, LLAMA_7B, "fp16") == pytest.approx(312e12 / 2039e9, rel=1e-12)


def test_other_presets():
    assert crossover_batch(H200, LLAMA_7B, "fp16") == pytest.approx(206, abs=1)
    assert crossover_batch(H100_SXM, LLAMA_7B, "bf16") == pytest.approx(989 / 3.35, rel=1e-9)
    assert hwm.get_hardware("H200") is H200
    with pytest.raises(ValueError, match="B200"):
        hwm.get_hardware("B200")
    # fp32 moves 2x the bytes per parameter: the crossover is 2x the ridge point
    assert crossover_batch(A100_SXM_80GB, LLAMA_7B, "fp32") == pytest.approx(2 * 19.5e12 / 2039e9)


def test_kv_bytes():
    assert kv_bytes_per_token(LLAMA_7B, "fp16") == 32 * 2 * 4096 * 2 == 512 * 1024
    assert kv_bytes_per_token(LLAMA_70B, "fp16") == 80 * 2 * 8 * 128 * 2  # GQA: 8 kv heads


def test_decode_step_flat_then_linear():
    floor = weight_read_time(A100_SXM_80GB, LLAMA_7B, "fp16")
    per = per_request_compute_time(A100_SXM_80GB, LLAMA_7B, "fp16")
    step = lambda b: decode_step_time(A100_SXM_80GB, LLAMA_7B, b, "fp16")  # noqa: E731
    for b in (1, 8, 64, 150, 153):
        assert step(b) == pytest.approx(floor)
    for b in (160, 256, 1024):
        assert step(b) == pytest.approx(b * per)
    per_user, total = tokens_per_second(A100_SXM_80GB, LLAMA_7B, 64, "fp16")
    assert per_user == pytest.approx(1 / floor) and total == pytest.approx(64 / floor)
    # KV reads raise the floor and lower the crossover
    assert decode_step_time(A100_SXM_80GB, LLAMA_7B, 64, "fp16", context_len=2048) > floor
    assert hwm.arithmetic_intensity(LLAMA_7B, 32, "fp16") == pytest.approx(32)
    assert hwm.arithmetic_intensity(LLAMA_7B, 32, "fp16", context_len=4096) < 32


@pytest.mark.parametrize("tied", [False, True])
def test_from_config_counts_what_the_built_model_holds(tied):
    # Every size differs from the others (GQA, head_dim != hidden / heads, biases), so a
    # field read from the wrong place changes a count; the counts are checked against the
    # tensors a real model and its KV cache allocate, not against the config's own formulas.
    cfg = ModelConfig(vocab_size=301, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                      num_attention_heads=6, num_key_value_heads=2, explicit_head_dim=12,
                      qkv_bias=True, qk_norm=True, tie_word_embeddings=tied)
    spec = ModelSpec.from_config(cfg, name="odd")
    model = LlamaForServing(cfg)
    params = list(model.parameters())                       # a tied matrix is listed once
    assert spec.num_parameters == sum(p.numel() for p in params)
    assert weight_bytes(spec, "fp32") == sum(p.numel() * p.element_size() for p in params)
    assert spec.embedding_parameters == (0 if tied else model.model.embed_tokens.weight.numel())
    cache = KVCache(cfg, num_blocks=5, block_size=4, dtype=torch.float16, device="cpu")
    assert kv_bytes_per_token(spec, "fp16") * 5 * 4 == cache.nbytes
    # The cpu-bench preset the notebooks measure: its spec is the model's real size.
    bench = get_preset("cpu-bench")
    with torch.device("meta"):                              # shapes only, no 400 MB of weights
        bench_params = sum(p.numel() for p in LlamaForServing(bench).parameters())
    assert ModelSpec.from_config(bench).num_parameters == bench_params


def test_value_errors():
    with pytest.raises(ValueError, match="fp12"):
        weight_bytes(LLAMA_7B, "fp12")
    with pytest.raises(ValueError, match="fp8"):
        crossover_batch(A100_SXM_80GB, LLAMA_7B, "fp8")  # A100 has no fp8
    with pytest.raises(ValueError):
        decode_step_time(A100_SXM_80GB, LLAMA_7B, 0, "fp16")


def _hinge(b, knee, floor=1e-2):
    return np.maximum(floor, floor * b / knee)


@pytest.mark.parametrize("knee", [16, 153, 184])
def test_find_knee_noisy(knee):
    rng = np.random.default_rng(knee)
    b = np.unique(np.round(np.geomspace(1, 1024, 24)))
    for _ in range(5):
        t = _hinge(b, knee) * (1 + 0.05 * rng.standard_normal(b.size))
        assert find_knee(b, t) == pytest.approx(knee, rel=0.3)
    fit = fit_knee(b, _hinge(b, knee))
    assert fit.knee == pytest.approx(knee, rel=0.02) and not fit.flat
    assert fit.floor == pytest.approx(1e-2, rel=1e-3)
    assert np.allclose(fit.predict(b), _hinge(b, knee), rtol=0.02)


def test_find_knee_flat_and_bad_input():
    b = [1, 2, 4, 8, 16, 32]
    fit = fit_knee(b, [5e-3] * 6)
    assert fit.flat and fit.knee == 32 and fit.slope == 0 and fit.floor == pytest.approx(5e-3)
    rng = np.random.default_rng(0)
    assert find_knee(b, 5e-3 * (1 + 0.05 * rng.standard_normal(6))) == 32
    with pytest.raises(ValueError):
        find_knee([1, 2, 4], [1.0, 2.0])
    with pytest.raises(ValueError):
        find_knee([1, 2], [1.0, 2.0])
    with pytest.raises(ValueError):
        find_knee([1, 2, 4], [1.0, 0.0, 2.0])
    with pytest.raises(ValueError):
        find_knee([0, 2, 4], [1.0, 1.0, 2.0])


def matmul_paths() -> list[str]:
    """The matmul paths measure_device times on this CPU, in its order."""
    return ["torch.matmul"] + [f"{p} packed" for p in PACKED_PATHS
                               if prepacked_linear(torch.zeros(1, 1), 1, p) is not None]


def test_measure_device_divides_bytes_and_flops_by_the_time_and_keeps_the_fastest_matmul(monkeypatch):
    """A clock that gives every timed op a fixed duration, in the order they are set up:
    the copy 2 ms, then the matmul paths 5, 4, 3 ms (the last one available is the fastest).
    The ceilings must be exactly bytes (read + write) and 2 n^3 FLOPs over those times,
    with the peak from the fastest path, named in ``source``."""
    durations = iter([2e-3, 5e-3, 4e-3, 3e-3])

    def fake_clock():
        def timed(op):
            seconds = next(durations)

            def run():
                op()                        # the op still runs: a path that crashes fails here
                return seconds
            return run
        return (lambda: None), timed

    monkeypatch.setattr(measure, "_cpu_clock", fake_clock)
    n, mib = 64, 4
    spec = measure_device("cpu", seconds=0.02, copy_mib=mib, matmul_size=n)
    paths = matmul_paths()
    fastest = [5e-3, 4e-3, 3e-3][len(paths) - 1]
    assert spec.memory_bandwidth == pytest.approx(2 * mib * 2**20 / 2e-3, rel=1e-12)
    assert spec.flops == {"fp32": pytest.approx(2 * n**3 / fastest, rel=1e-12)}
    assert f"fp32 peak from {paths[-1]} (" in spec.source
    assert all(name in spec.source for name in paths)


def test_measure_device_measures_the_dtypes_it_is_asked_for():
    # bf16 through torch.matmul everywhere, and through oneDNN's packed GEMM where it packs bf16.
    spec = measure_device("cpu", seconds=0.05, copy_mib=4, matmul_size=128, dtypes=("fp32", "bf16"))
    assert set(spec.flops) == {"fp32", "bf16"} and all(f > 0 for f in spec.flops.values())
    bf16 = spec.source.split("bf16 peak from ", 1)[1]
    assert ("onednn packed" in bf16) == packed_gemm.packs(torch.bfloat16)
    assert "mkl packed" not in bf16                          # MKL packs fp32 only
    # Without native bf16 the engine multiplies in fp32 on the bf16 weights: its peak too.
    assert ("fp32 compute on bf16" in bf16) == (not packed_gemm.packs(torch.bfloat16))


@pytest.mark.skipif(not packed_gemm.packs(torch.bfloat16), reason="oneDNN packs no bf16 on this CPU")
def test_a_bf16_weight_packed_for_onednn_multiplies_like_a_linear_layer():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=gen).bfloat16()
    x = torch.randn(3, 64, generator=gen).bfloat16()
    layer = prepacked_linear(weight, 3, "onednn")
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, weight), rtol=2e-2, atol=2e-2)
    assert prepacked_linear(weight, 3, "mkl") is None


def test_measure_device_on_this_cpu_times_every_matmul_path():
    spec = measure_device("cpu", seconds=0.05, copy_mib=4, matmul_size=128)
    rates = spec.source.split("fp32 peak from ", 1)[1].split(" (", 1)[1].split(" TFLOP/s")[0]
    assert [part.rsplit(" ", 1)[0] for part in rates.split(", ")] == matmul_paths()
    assert math.isfinite(spec.flops["fp32"]) and math.isfinite(spec.memory_bandwidth)


NEW_PRESETS = ("RTX_3090", "RTX_4090", "L4", "L40S")


@pytest.mark.parametrize("name", NEW_PRESETS)
def test_new_presets_crossover_is_ridge_point(name):
    hw = hwm.get_hardware(name)
    assert hwm.HARDWARE_PRESETS[name] is hw
    # 7B fp16: bytes per parameter (2) and FLOPs per parameter (2) cancel exactly
    ridge = hw.peak_flops("fp16") / hw.memory_bandwidth
    assert crossover_batch(hw, LLAMA_7B, "fp16") == pytest.approx(ridge, rel=1e-12)
    assert crossover_batch(hw, LLAMA_7B, "fp16") == pytest.approx(hw.ridge_point("fp16"), rel=1e-12)
    assert weight_read_time(hw, LLAMA_7B, "fp16") == pytest.approx(14e9 / hw.memory_bandwidth)


@pytest.mark.parametrize("name", NEW_PRESETS)
def test_new_presets_sane_ranges(name):
    hw = hwm.get_hardware(name)
    assert hw.source and ("datasheet" in hw.source or "whitepaper" in hw.source)
    assert 200e9 <= hw.memory_bandwidth <= 1.2e12          # GDDR6/6X: 0.2-1.2 TB/s
    assert hw.memory_size in (24 * 2**30, 48 * 2**30)       # binary: 24 GiB, 48 GiB
    assert 25e12 <= hw.peak_flops("fp32") <= 100e12        # non-tensor fp32
    assert 50e12 <= hw.peak_flops("fp16") <= 400e12        # dense, below an H100's 989
    assert hw.peak_flops("fp16") < H100_SXM.peak_flops("fp16")
    # the dense tensor fp16 rate is 2-4.5x fp32 on these cards (never the 8x of a sparsity figure)
    assert 1.9 <= hw.peak_flops("fp16") / hw.peak_flops("fp32") <= 4.5
    # 8-bit is 2x fp16 (4x on GeForce, whose fp16-with-FP32-accumulate runs at half rate)
    for low in ("fp8", "int8"):
        if low in hw.flops:
            assert 1.98 <= hw.flops[low] / hw.peak_flops("fp16") <= 4.02
    if "bf16" in hw.flops:
        assert hw.flops["bf16"] == pytest.approx(hw.peak_flops("fp16"), rel=0.01)
    assert 50 <= crossover_batch(hw, LLAMA_7B, "fp16") <= 450


def test_new_presets_values():
    # spot values straight from the whitepapers / datasheets (see hardware.py)
    assert hwm.RTX_3090.peak_flops("fp16") == 71e12 and hwm.RTX_3090.memory_bandwidth == 936e9
    assert hwm.RTX_4090.peak_flops("fp16") == pytest.approx(165.2e12)  # FP32 accumulate
    assert hwm.RTX_4090.memory_bandwidth == 1008e9
    assert hwm.L4.peak_flops("fp16") == 121e12 and hwm.L4.memory_bandwidth == 300e9
    assert hwm.L40S.peak_flops("fp16") == pytest.approx(362.05e12) and hwm.L40S.memory_size == 48 * 2**30
    assert hwm.A100_SXM_80GB.memory_size == 81920 * 2**20          # nvidia-smi: 81920 MiB
    assert "fp8" not in hwm.RTX_3090.flops                              # Ampere has no fp8
    assert crossover_batch(hwm.RTX_3090, LLAMA_7B, "fp16") == pytest.approx(76, abs=1)
    assert crossover_batch(hwm.RTX_4090, LLAMA_7B, "fp16") == pytest.approx(164, abs=1)
    assert crossover_batch(hwm.L4, LLAMA_7B, "fp16") == pytest.approx(403, abs=1)
    assert crossover_batch(hwm.L40S, LLAMA_7B, "fp16") == pytest.approx(419, abs=1)
    # the chapter's figure is unchanged
    assert crossover_batch(A100_SXM_80GB, LLAMA_7B, "fp16") == pytest.approx(153, abs=1)
    assert list(hwm.HARDWARE_PRESETS)[:3] == ["A100_SXM_80GB", "H100_SXM", "H200"]


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="free_cores reads /proc/stat (Linux)")
def test_a_program_spinning_on_our_cores_counts_as_one_more_busy_core():
    # The child inherits this process's cores (under make test, the worker's own one), so
    # it spins where the count looks, whether the machine has one core or many.
    before = host.cores_busy_with_others(sample=0.5)
    if round(before) >= host.usable_cores():
        pytest.skip(f"other programs keep all {host.usable_cores()} of this process's cores busy: "
                    "a spinning child cannot add one")
    hog = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 5\nwhile time.time() < end: pass"])
    try:
        time.sleep(0.5)                       # the spinning child is running by now
        assert round(host.cores_busy_with_others(sample=0.5) - before) == 1
    finally:
        hog.kill()
        hog.wait()



@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="free_cores reads /proc/stat (Linux)")
@pytest.mark.parametrize("busy, own, others", [
    (0, 0, 0),          # an idle machine
    (100, 100, 0),      # a whole core busy, all of it this process: nobody else
    (100, 0, 1),        # a whole core busy with another program
    (150, 0, 2),        # one and a half cores: rounds to two
    (40, 0, 0),         # a browser tab's 40% of a core does not take a core away
])
def test_free_cores_counts_only_other_programs(monkeypatch, busy, own, others):
    n = len(os.sched_getaffinity(0))
    ticks = iter([(0, 0), (busy, 100 * n)])             # (busy, total) before and after the sample
    owns = iter([0, own])
    monkeypatch.setattr(host, "_cpu_jiffies", lambda cpus: next(ticks))
    monkeypatch.setattr(host, "_own_jiffies", lambda: next(owns))
    monkeypatch.setattr(host.time, "sleep", lambda s: None)
    assert host.free_cores() == max(1, n - others)


def test_free_cores_falls_back_to_all_cores_without_proc(monkeypatch):
    monkeypatch.setattr(host.os.path, "exists", lambda path: False)
    assert host.free_cores() == host.usable_cores()


def test_interleaved_times_rotates_the_order_and_times_every_call():
    calls, synced = [], []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    times = host.interleaved_times(fns, rounds=4, sync=lambda: synced.append(calls[-1]))
    assert calls == list("abc" "bca" "cab" "abc")        # each round starts one later
    assert synced == calls                              # sync right after every call, inside its time
    assert {name: len(ts) for name, ts in times.items()} == {"a": 4, "b": 4, "c": 4}
    assert all(t >= 0 for ts in times.values() for t in ts)
    with pytest.raises(ValueError, match="rounds: need at least 1, got 0"):
        host.interleaved_times(fns, rounds=0)


def test_the_cpu_is_named_with_its_family_and_model_where_the_kernel_gives_them():
    # A VM's bare model name says nothing of the generation; the numbers do. Only the first
    # processor counts.
    cpuinfo = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n"
               "model name\t: AMD EPYC\n\nprocessor\t: 1\ncpu family\t: 25\nmodel\t\t: 1\n"
               "model name\t: AMD EPYC\n")
    assert host.describe_cpu(cpuinfo) == "AMD EPYC (family 26, model 2)"
    assert host.describe_cpu("processor\t: 0\nmodel name\t: Some ARM core\n") == "Some ARM core"
    assert host.describe_cpu("processor\t: 0\nBogoMIPS\t: 50.00\n") == ""
    assert host.cpu_name()
