"""``bench peer``: tinyserve and transformers (``generate`` on static left-padded batches,
``generate_batch``) on the same weights give the same greedy tokens, request for request,
and the report says so."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tinyserve.bench import peer, vllm_peer, vllm_setup
from tinyserve.bench.random_checkpoint import model_config
from tinyserve.model import LlamaForServing
from tinyserve.packed_gemm import weight_bytes

pytest.importorskip("transformers")


def test_every_engine_gives_transformers_generate_tokens():
    scenarios = (peer.Scenario("B=1", 1, 1), peer.Scenario("B=3, mixed outputs", 3, 5, mixed_outputs=True))
    report = peer.run("small", scenarios, verbose=False)
    assert [s["name"] for s in report["scenarios"]] == [s.name for s in scenarios]
    for sc in report["scenarios"]:
        engines = [r["engine"] for r in sc["rows"]]
        assert engines[0] == "transformers generate (static batches)"
        assert {"tinyserve eager", "tinyserve enforce_eager=False"} <= set(engines)
        reference = sc["rows"][0]
        for row in sc["rows"]:
            assert row["equal"] == sc["requests"], (sc["name"], row["engine"])
            # Throughput is the scenario's output tokens over this engine's run, and the
            # ratio is against transformers generate: > 1 means faster than the reference.
            assert row["tok_per_s"] == pytest.approx(sc["output_tokens"] / row["seconds"])
            assert row["ratio"] == pytest.approx(reference["seconds"] / row["seconds"])


def test_a_mixed_workload_has_prompts_and_outputs_in_their_ranges():
    prompts, news = peer.Scenario("x", 4, 20, mixed_outputs=True).workload(vocab=2048)
    assert len(prompts) == len(news) == 20
    assert all(peer.PROMPT_LENS[0] <= len(p) <= peer.PROMPT_LENS[1] for p in prompts)
    assert all(peer.MIXED_NEW[0] <= n <= peer.MIXED_NEW[1] for n in news) and len(set(news)) > 1
    assert all(10 <= t < 2048 for p in prompts for t in p)
    assert peer.Scenario("x", 4, 20).workload(vocab=2048)[1] == [peer.FIXED_NEW] * 20


def test_the_shipped_vllm_run_names_its_machine_and_holds_only_what_make_peer_runs():
    """Notebook 03 prints the stored `make peer` run to every reader, whatever machine they
    are on: it must say where, when and under what load it was measured, and hold only the
    engines, modes and workloads that `make peer` runs, with no failed request."""
    report = vllm_peer.stored_report()
    assert report["vllm"] and report["date"] and report["load_average"]
    assert report["machine"]["cpu"] and report["machine"]["cores"] > 0
    workloads = {s.name for s in vllm_peer.VLLM_SCENARIOS}
    for row in report["rows"]:
        assert (row["engine"], row["mode"], row["workload"]) in {
            (e, m, w) for e in vllm_peer.ENGINES for m in ("offline", "server") for w in workloads}, row
        assert row["errors"] == 0 and row["tok_per_s"] > 0, row
        assert row["equal"] is None or 0 <= row["equal"] <= row["requests"], row
    printed = []
    vllm_peer.print_report(report, printed.append)
    assert report["machine"]["cpu"] in printed[0] and len(printed) > len(report["rows"])
    # "equal" counts against the first engine run, whichever it was (eager was left out here).
    printed = []
    vllm_peer.print_report({**report, "reference": "tinyserve packed"}, printed.append)
    assert "equal tinyserve packed's" in printed[0]


def test_peer_engines_loaded_together_take_turns_and_report_their_median_round(monkeypatch):
    # vLLM left out: the rounds, the turns and the report are the same for any engine.
    said, turns, turn = [], [], vllm_peer.TinyserveOffline.turn
    def recorded(self, t=0, jobs=None):
        turns.append(("eager" if self.llm.engine.executor.enforce_eager else "packed", t,
                      [w["name"] for w in jobs]))
        return turn(self, t, jobs)
    monkeypatch.setattr(vllm_peer.TinyserveOffline, "turn", recorded)
    report = vllm_peer.run(shapes=("small",), dtypes=("float32",), online=False, rounds=3,
                           engines=("tinyserve packed", "tinyserve eager"), say=lambda line, **_: said.append(line))
    assert report["rounds"] == 3
    # One workload per turn, the two engines' turns at it back to back, who goes first
    # alternating: eager packed, packed eager, eager packed ...
    names = [s.name for s in vllm_peer.VLLM_SCENARIOS] * 3
    assert turns == [(e, t, [names[t]]) for t in range(9)
                     for e in (("eager", "packed") if t % 2 == 0 else ("packed", "eager"))]
    assert [s for s in said if "offline round" in s] == [f"small float32: offline round {r} of 3 ..." for r in (1, 2, 3)]
    rows = {(r["engine"], r["workload"]): r for r in report["rows"]}
    assert len(rows) == 2 * len(vllm_peer.VLLM_SCENARIOS)
    for row in rows.values():
        assert len(row["tok_per_s_rounds"]) == 3 and row["tok_per_s"] == sorted(row["tok_per_s_rounds"])[1]
        assert row["equal"] == row["requests"], row          # packed and eager: the same greedy tokens
    # A read bandwidth measured before each round, against the bytes the small model's step reads.
    [floor] = report["floors"]
    assert floor["weight_bytes"] == weight_bytes(LlamaForServing.from_seed(model_config("small"), 0))
    assert len(floor["read_bandwidth_rounds"]) == 3 and min(floor["read_bandwidth_rounds"]) > 0


def test_the_ratio_of_two_engines_is_the_median_of_their_rounds_ratios():
    row = lambda engine, rates: {"engine": engine, "mode": "offline", "model": "m", "dtype": "d",
                                 "workload": "B=1", "tok_per_s": sorted(rates)[1], "tok_per_s_rounds": rates,
                                 "ttft": 0.1, "tpot": 0.01, "start_s": 1.0, "equal": None, "requests": 4,
                                 "errors": 0}
    # Round by round 2.0, 0.5 and 1.5: the median is 1.5, where the medians' ratio would be 1.0.
    ours, theirs = row("tinyserve packed", [20.0, 10.0, 30.0]), row("vLLM tuned", [10.0, 20.0, 20.0])
    assert vllm_peer.paired_ratios(ours, theirs) == [2.0, 0.5, 1.5]
    printed = []
    vllm_peer.print_report({"machine": {"cpu": "x", "cores": 2}, "vllm": "v", "rows": [ours, theirs]},
                           printed.append)
    assert printed[-1].split() == ["m", "d", "B=1", "1.50x", "(0.50-2.00,", "3", "rounds)"]
    # The B=1 TPOTs against the floor: 1 GB at 100 GB/s, 10 ms; 1.2x vLLM's speed takes 10 / 1.2 ms.
    floors = [{"model": "m", "dtype": "d", "weight_bytes": 1e9, "read_bandwidth_rounds": [80e9, 100e9]}]
    printed = []
    vllm_peer.print_floors({"rows": [ours, {**theirs, "tpot": 0.012}], "floors": floors}, printed.append)
    assert printed[-1].split() == ["m", "d", "floor", "10.0", "ms", "(954", "MiB", "/", "100.0", "GB/s):",
                                   "tinyserve", "packed", "1.00", "vLLM", "tuned", "1.20;", "1.2x", "vLLM",
                                   "tuned", "would", "take", "1.00"]
    # A report from before rounds: one rate per row.
    assert vllm_peer.paired_ratios(*({**r, "tok_per_s_rounds": None} for r in (ours, theirs))) == [1.0]


def test_an_unfinished_make_vllm_is_not_taken_for_an_installed_vllm(tmp_path, monkeypatch):
    # While `make vllm` runs (or after it was cut short) .venv-vllm has a python but no vLLM:
    # every vLLM cell and test must skip with a line, not crash on `import vllm`.
    if vllm_setup.platform_unsupported():
        pytest.skip(vllm_setup.platform_unsupported())
    monkeypatch.delenv("TINYSERVE_VLLM_PYTHON", raising=False)
    monkeypatch.setattr(vllm_setup, "REPO", tmp_path)
    assert "not installed" in vllm_setup.vllm_unavailable()
    python = tmp_path / ".venv-vllm" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.touch()
    assert "has not finished" in vllm_setup.vllm_unavailable()
    (tmp_path / ".venv-vllm" / ".installed").touch()          # make vllm's last step
    assert vllm_setup.vllm_unavailable() is None
    # A python named by hand that is not there: the line names the variable, not make vllm.
    monkeypatch.setenv("TINYSERVE_VLLM_PYTHON", str(tmp_path / "nowhere" / "python"))
    assert vllm_setup.vllm_unavailable() == f"TINYSERVE_VLLM_PYTHON={tmp_path / 'nowhere' / 'python'} does not exist"


def test_the_reports_a_machine_writes_live_under_tinyserve_cache(tmp_path, monkeypatch):
    # `make peer` and `bench sim --vllm-live` write where notebooks 03 and 06 read them back;
    # a reader who moved the cache (a small home, a shared class machine) must find them there.
    from tinyserve.bench import vllm_live
    monkeypatch.setenv("TINYSERVE_CACHE", str(tmp_path))
    assert vllm_peer.last_report() is None and vllm_live.last() is None
    vllm_peer.last_report_path().parent.mkdir(parents=True)
    vllm_peer.last_report_path().write_text('{"engines": []}')
    vllm_live.last_path().parent.mkdir(parents=True)
    vllm_live.last_path().write_text('{"run": {}}')
    assert vllm_peer.last_report() == {"engines": []} and vllm_live.last() == {"run": {}}
    assert vllm_peer.last_report_path().is_relative_to(tmp_path)
    assert vllm_live.last_path().is_relative_to(tmp_path)
    # make peer's own command line, with `echo` for python, run by the shell as make would.
    # (As a top-level make: under `make test` the parent's MAKEFLAGS would add directory lines.)
    repo = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    printed = subprocess.run(["make", "--no-print-directory", "-n", "peer", "PY=echo"], cwd=repo,
                             env=env, capture_output=True, text=True, check=True).stdout
    line = next(line for line in printed.splitlines() if "--out" in line)
    said = subprocess.run(["sh", "-c", line], capture_output=True, text=True, check=True).stdout
    assert said.split("--out ")[1].strip() == str(vllm_peer.last_report_path())
