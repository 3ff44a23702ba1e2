"""The crossover benchmark at toy sizes: sweeps, fits, the JSON report, the prediction."""

import json

import numpy as np
import pytest

from tinyserve.bench import crossover as xo
from tinyserve import hardware as hwm
from tinyserve import measure
from tinyserve.model import get_preset


def test_predicted_crossover_converts_for_dtype():
    hw = hwm.HardwareSpec("toy", flops={"fp32": 100e9, "fp16": 400e9}, memory_bandwidth=10e9,
                          memory_size=1e9)
    # 2 FLOPs per parameter against bytes_per_param bytes: ridge x bytes / 2
    assert xo.predicted_crossover(hw, "fp16") == pytest.approx(40.0)
    assert xo.predicted_crossover(hw, "fp32") == pytest.approx(20.0)
    # the chapter's number, and agreement with hardware.crossover_batch
    assert xo.predicted_crossover(hwm.A100_SXM_80GB, "fp16") == pytest.approx(153, abs=1)
    for dtype in ("fp16", "fp32", "int8"):
        assert xo.predicted_crossover(hwm.A100_SXM_80GB, dtype) == pytest.approx(
            hwm.crossover_batch(hwm.A100_SXM_80GB, hwm.LLAMA_7B, dtype))
    assert xo.weight_read_floor(hw, 5e9) == pytest.approx(0.5)


def test_default_batch_sizes_are_log_spaced_and_monotone():
    cpu, gpu = xo.default_batch_sizes("cpu"), xo.default_batch_sizes("cuda")
    for sizes, top in ((cpu, 256), (gpu, 1024)):
        assert sizes[0] == 1 and sizes[-1] == top
        assert all(a < b for a, b in zip(sizes, sizes[1:]))
        assert max(b / a for a, b in zip(sizes, sizes[1:])) <= 2
    assert xo.default_batch_sizes("cpu", 16) == [1, 2, 3, 4, 6, 8, 12, 16]


def test_gemm_stack_sweep_tiny():
    stack = xo.GemmStack(hidden=64, num_layers=2)
    # Llama's four matrices per layer: QKV 64x192, output 64x64, gate/up 64x344, down 172x64
    assert stack.num_parameters == 2 * (64 * 192 + 64 * 64 + 64 * 344 + 172 * 64)
    assert sum(w.numel() for w in stack.weights) == stack.num_parameters
    assert stack.weight_bytes == sum(w.numel() * w.element_size() for w in stack.weights)
    assert xo.stack_config("cpu")["dtype"] == "fp32"
    assert 0.9 < xo.stack_config("cpu")["num_layers"] * 4 * sum(
        a * b for a, b in xo.layer_shapes(1024)) / 2**30 < 1.1


@pytest.mark.parametrize("prepack", [False, True])
def test_the_cpu_sweep_keeps_each_batch_sizes_best_round(monkeypatch, prepack):
    """On a fake clock, the step at batch B takes B ms, plus 50 ms in the one round a burst
    of load hits it (a different round for each B). The sweep reports B ms for every B,
    in the order given: the best of the rounds, not the first, the last or the mean, both
    when the rounds go over all batch sizes and when each batch size (with its own packed
    weights) is timed on its own."""
    clock, calls = [0.0], {}
    burst_at_call = {1: 2, 2: 3, 4: 4}               # call 1 is the warm-up; 8 is never hit

    def step_fn(self, batch, prepack=False):
        def step():
            calls[batch] = calls.get(batch, 0) + 1
            clock[0] += batch * 1e-3 + (50e-3 if burst_at_call.get(batch) == calls[batch] else 0.0)
        return step

    monkeypatch.setattr(xo.GemmStack, "step_fn", step_fn)
    monkeypatch.setattr(xo.time, "perf_counter", lambda: clock[0])
    times = xo.sweep_gemm_stack(xo.GemmStack(hidden=8, num_layers=1), [8, 1, 4, 2], repeats=3,
                                prepack=prepack)
    assert times == pytest.approx([8e-3, 1e-3, 4e-3, 2e-3], rel=1e-9)
    assert calls == {8: 4, 1: 4, 4: 4, 2: 4}         # one warm-up and three rounds each


def test_engine_sweep_tiny():
    times, info = xo.sweep_engine([1, 2, 4], model="tiny", steps=2)
    assert len(times) == 3
    # What a decode step reads: every weight but the embedding table (of which it reads a
    # few rows), counted here from the preset's shapes, not from the model object.
    cfg = get_preset("tiny")
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    attention = cfg.hidden_size * head_dim * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size
    norms = (2 * cfg.num_hidden_layers + 1) * cfg.hidden_size
    head = cfg.vocab_size * cfg.hidden_size
    assert info["num_parameters_read"] == cfg.num_hidden_layers * (attention + mlp) + norms + head
    assert info["dtype"] == "fp32" and info["weight_bytes"] == 4 * info["num_parameters_read"]


def test_engine_sweep_counts_a_tied_output_projection_once(tmp_path):
    # Tied (Qwen2.5-0.5B, Llama-3.2-1B): the embedding table is the output projection,
    # read whole every step, so it counts once; untied, the table is not read.
    import dataclasses

    from tinyserve.checkpoint import save_pretrained
    from tinyserve.model import LlamaForServing

    tied = dataclasses.replace(get_preset("tiny"), tie_word_embeddings=True)
    save_pretrained(LlamaForServing.from_seed(tied), tmp_path)
    _, tied_info = xo.sweep_engine([1], model=str(tmp_path), steps=1)
    _, untied_info = xo.sweep_engine([1], model="tiny", steps=1)
    assert tied_info["num_parameters_read"] == untied_info["num_parameters_read"]


def test_knee_report_on_synthetic_curve():
    hw = hwm.HardwareSpec("toy", flops={"fp32": 100e9}, memory_bandwidth=10e9, memory_size=1e9)
    b = np.array([1, 2, 4, 8, 16, 32, 64, 128])
    weight_bytes = 4e9                                   # 0.4 s floor, 1e9 params -> 20 ms per request
    t = np.maximum(0.4, b * 2 * 1e9 / 100e9)             # knee at 20 = predicted
    rep = xo.knee_report(b, t, hw, "fp32", weight_bytes)
    assert rep["predicted_crossover"] == pytest.approx(20)
    assert rep["knee"] == pytest.approx(20, rel=0.1)
    assert rep["b1_over_floor"] == pytest.approx(1.0)
    assert not rep["flat"]


def test_run_and_json_report(tmp_path, monkeypatch):
    fake = hwm.HardwareSpec("fake cpu", flops={"fp32": 50e9}, memory_bandwidth=10e9, memory_size=1e9)
    monkeypatch.setattr(measure, "measure_device", lambda *a, **k: fake)
    monkeypatch.setattr(xo, "stack_config", lambda device, gib=None: {"hidden": 64, "num_layers": 2,
                                                                     "dtype": "fp32"})
    report = xo.run("cpu", batch_sizes=[1, 2, 4, 8], engine_batch_sizes=[1, 2, 4, 8],
                    engine_model="tiny", repeats=1, engine_steps=2, verbose=False)
    path = xo.write_json(report, tmp_path / "sub" / "bench_crossover_test.json")
    back = json.loads(path.read_text())
    assert set(xo.REPORT_KEYS) <= set(back)
    assert back["benchmark"] == "crossover" and back["device"] == "cpu"
    assert "torch" in back["versions"] and back["date"]
    assert back["device_spec"]["memory_bandwidth"] == 10e9
    for name in ("gemm_stack", "engine"):
        curve, fit = back["curves"][name], back["fits"][name]
        assert len(curve["batch_sizes"]) == len(curve["step_times_s"])
        assert {"knee", "predicted_crossover", "weight_read_floor_s", "b1_over_floor", "flat",
                "fit_min_batch"} <= set(fit)
        assert fit["fit_min_batch"] == 2                 # CPU: the GEMV point at B=1 is left out
    assert xo.load_stored(tmp_path / "sub")[0]["date"] == back["date"]


def test_plots_and_widget_smoke():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tinyserve.book import plots
    left, right = plots.crossover_explorer(hwm.A100_SXM_80GB, hwm.LLAMA_7B, "fp16", 0)
    assert "153" in " ".join(t.get_text() for t in left.get_legend().get_texts())
    assert plots.crossover_with_context(hwm.A100_SXM_80GB, hwm.LLAMA_7B, "fp16", 0) == pytest.approx(
        hwm.crossover_batch(hwm.A100_SXM_80GB, hwm.LLAMA_7B, "fp16"))
    assert plots.crossover_with_context(hwm.A100_SXM_80GB, hwm.LLAMA_7B, "fp16", 4096) > 153
    plt.close("all")
    pytest.importorskip("ipywidgets")
    from tinyserve.book import widgets
    box = widgets.crossover_calculator()
    controls, summary = box.children[:2], box.children[2]
    assert "B = 153</b>" in summary.value                      # the chapter's A100 figure
    dtype = controls[1].children[0]
    dtype.value = "fp32"                                       # moving a control recomputes it
    assert f"B = {hwm.crossover_batch(hwm.A100_SXM_80GB, hwm.LLAMA_7B, 'fp32'):.0f}</b>" in summary.value
    data = box._repr_mimebundle_()
    data = data[0] if isinstance(data, tuple) else data
    assert data["text/plain"] == widgets.STATIC_TEXT           # not VBox(children=(...))
    plt.close("all")


def test_the_start_up_probe_counts_its_own_memory_its_data_and_the_checkpoints_dtype(tmp_path):
    # bench step's start-up probe runs in a process forked from the benchmark: its peak must
    # be its own (getrusage's would include the 600 MiB held here), and a bf16 checkpoint is
    # started in bf16, as the sweeps start it.
    import torch
    from tinyserve.bench import step
    from tinyserve.bench.random_checkpoint import write_checkpoint
    held = torch.ones(600 * 2**18)
    path = write_checkpoint("tiny", "bfloat16", tmp_path / "tiny-bf16")
    run = step.compile_cost(str(path), 4, str(tmp_path / "inductor"))["cold"]
    assert run["peak_rss"] < held.numel() * held.element_size()
    assert run["rss"] <= run["peak_rss"]
    # The anonymous part (the data) holds at least the weights, within all of RSS, and its
    # sampled peak is at least what it holds at the end.
    assert run["anon"] - run["baseline_anon"] >= run["checkpoint_bytes"]
    assert run["anon"] <= run["peak_anon"] <= run["peak_rss"]
    assert run["anon"] < run["rss"]
    from tinyserve.model import get_preset
    assert run["checkpoint_bytes"] == get_preset("tiny").num_parameters() * 2
