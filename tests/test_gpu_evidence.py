"""`python -m tinyserve.bench.gpu_evidence` on the CPU: the numbers need a GPU, but the
plumbing (parts, records, time limits, failures, the summary, exit codes) runs here
with ``--fake``: fake device properties, a fake kernel timer and clock, tiny shapes."""

import json
import time

import pytest
import torch

from tinyserve.bench import gpu_evidence as ge

RESULT_KEYS = {
    "kernels": {"copy_GBps", "rows", "fused_speedup_geomean"},
    "crossover": {"benchmark", "device_spec", "curves", "fits"},
    "engine": {"step_times_s", "weight_bytes", "device_spec", "fit", "tokens_per_s"},
    "transformers": {"tinyserve_s", "transformers_s", "tinyserve_tok_per_s",
                     "transformers_tok_per_s", "ratio", "first_token_match", "all_tokens_match"},
}


def load(out, part):
    return json.loads((out / "fake-gpu" / f"{part}.json").read_text())


def quick(env):
    return {"n": 1}, {"value": 1.0}, "quick"


def test_fake_run_writes_every_part(tmp_path, capsys):
    pytest.importorskip("triton")
    pytest.importorskip("transformers")
    assert ge.main(["--fake", "--isolate", "thread", "--out-dir", str(tmp_path)]) == 0
    table = capsys.readouterr().out.split("part          status")[-1]
    for part in ge.PARTS_ORDER:
        rec = load(tmp_path, part)
        assert set(ge.RECORD_KEYS) <= set(rec) and rec["status"] == "ok", rec.get("traceback")
        assert RESULT_KEYS[part] <= set(rec["results"])
        assert {"torch", "triton", "transformers", "cuda"} <= set(rec["versions"])
        assert rec["machine"]["gpu"]["name"] == "Fake GPU" and rec["machine"]["fake"]
        assert part in table and rec["headline"] in table
    engine = load(tmp_path, "engine")
    assert len(engine["results"]["step_times_s"]) == len(engine["config"]["batch_sizes"])
    assert engine["config"]["modes"] == ["eager"] and "enforce_eager" in engine["config"]
    # Greedy on the same fp32 weights, choosing among all 4096 ids (the default tokenizer
    # has 2048): tinyserve and transformers give the same tokens.
    assert load(tmp_path, "transformers")["results"]["all_tokens_match"] == 1.0
    assert [r["part"] for r in ge.stored("engine", tmp_path)] == ["engine"]


def test_the_shipped_records_are_a_real_gpu_run_of_every_part():
    for part in ge.PARTS_ORDER:
        records = ge.stored(part)
        assert records, f"no stored {part} record in tinyserve/data/gpu"
        for rec in records:
            assert not rec["machine"]["fake"] and rec["device"] == "cuda"
            assert rec["versions"]["cuda"] and RESULT_KEYS[part] <= set(rec["results"])


def test_a_failing_part_is_recorded_and_the_others_still_run(tmp_path, monkeypatch, capsys):
    def boom(env):
        raise RuntimeError("boom")
    monkeypatch.setitem(ge.PARTS, "crossover", boom)
    monkeypatch.setitem(ge.PARTS, "engine", quick)
    argv = ["--fake", "--isolate", "thread", "--out-dir", str(tmp_path), "--only", "crossover", "engine"]
    assert ge.main(argv) == 1
    failed = load(tmp_path, "crossover")
    assert failed["status"] == "failed" and failed["error"] == "RuntimeError: boom"
    assert ge.stored("crossover", tmp_path) == []           # the notebooks never show a failed part
    assert "boom" in failed["traceback"] and set(ge.RECORD_KEYS) <= set(failed)
    assert load(tmp_path, "engine")["status"] == "ok"
    out = capsys.readouterr().out
    assert "RuntimeError: boom" in out and "quick" in out


def test_a_part_past_its_limit_is_recorded_as_timed_out(tmp_path, monkeypatch):
    monkeypatch.setitem(ge.PARTS, "kernels", lambda env: (time.sleep(3), quick(env))[1])
    monkeypatch.setitem(ge.PARTS, "engine", quick)
    argv = ["--fake", "--isolate", "thread", "--out-dir", str(tmp_path), "--part-timeout", "0.2",
            "--only", "kernels", "engine"]
    start = time.perf_counter()
    assert ge.main(argv) == 1
    assert time.perf_counter() - start < 2           # it did not wait for the slow part
    slow = load(tmp_path, "kernels")
    assert slow["status"] == "failed" and slow["timed_out"] and "timed out" in slow["error"]
    assert load(tmp_path, "engine")["status"] == "ok"


def test_each_part_in_its_own_process(tmp_path):
    # A child that cannot even import torch in 0.1 s is killed and recorded ...
    assert ge.main(["--fake", "--out-dir", str(tmp_path), "--only", "engine", "--part-timeout", "0.1"]) == 1
    assert load(tmp_path, "engine")["timed_out"]
    # ... and a child given the time writes its own record (replacing the old one).
    assert ge.main(["--fake", "--out-dir", str(tmp_path), "--only", "engine"]) == 0
    rec = load(tmp_path, "engine")
    assert rec["status"] == "ok" and "timed_out" not in rec


def test_without_cuda_it_says_so_and_exits_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ge.main(["--out-dir", str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_records_go_under_the_gpus_slug(tmp_path):
    env = ge.fake_env()
    env.gpu = {**env.gpu, "name": "NVIDIA H200"}
    assert ge.part_path(tmp_path, env, "engine") == tmp_path / "nvidia-h200" / "engine.json"
