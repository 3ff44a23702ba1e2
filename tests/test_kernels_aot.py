"""Ahead-of-time compile every Triton kernel for sm_80/86/89/90 (no GPU needed):
no compile error, no register spill, shared memory within each architecture's limit.

Runs ``python -m tinyserve.kernels.aot --json`` in a child process (it defines the
kernels compiled, not interpreted, and compiles on 2 processes in a fresh cache).
Skips, with the tool's reason, where AOT compilation is impossible (no Triton,
no ptxas in the wheel). About a minute on 2 cores.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def aot_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("aot") / "aot.json"
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "shared"), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "tinyserve.kernels.aot", "--jobs", "2", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode == 2:
        pytest.skip(proc.stderr.strip() or "AOT compilation unavailable here")
    if not out.exists():
        pytest.fail(f"aot wrote no report (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc, json.loads(out.read_text())


def test_aot_exit_status_is_clean(aot_report):
    proc, _ = aot_report
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]


def _package_rows(report):
    return [r for r in report["rows"] if ":" not in r["kernel"]]


def test_every_package_kernel_compiles_for_every_arch(aot_report):
    _, report = aot_report
    rows = _package_rows(report)
    kernels = {r["kernel"] for r in rows}
    assert {"add_rmsnorm._add_rmsnorm_kernel", "silu_mul._silu_mul_kernel", "softmax._softmax_kernel",
            "paged_attention._paged_decode_kernel", "paged_attention._merge_splits_kernel"} <= kernels
    for k in kernels:
        for dt in ("fp16", "bf16"):
            assert {r["arch"] for r in rows if r["kernel"] == k and r["dtype"] == dt} == \
                {"sm_80", "sm_86", "sm_89", "sm_90"}, (k, dt)
    errors = [(r["kernel"], r["config"], r["arch"], r["dtype"], r["error"]) for r in report["rows"] if r["error"]]
    assert not errors


def test_no_spills_and_shared_memory_within_limits(aot_report):
    _, report = aot_report
    rows = _package_rows(report)
    spills = [(r["kernel"], r["config"], r["arch"], r["dtype"], r["spill_bytes"]) for r in rows if r["spill_bytes"]]
    assert not spills
    over = [(r["kernel"], r["arch"], r["shared_bytes"]) for r in rows if r["shared_bytes"] > r["shared_limit"]]
    assert not over


def test_paged_decode_covers_mha_gqa_and_both_head_dims(aot_report):
    _, report = aot_report
    rows = [r for r in report["rows"] if r["kernel"] == "paged_attention._paged_decode_kernel"]
    for want in ("GROUP=1 ", "GROUP=8 ", "HEAD_DIM=64 ", "HEAD_DIM=128 ", "SPLIT=0", "SPLIT=1"):
        assert any(want in r["config"] for r in rows), want
    assert all(r["registers"] <= 255 and r["spill_bytes"] == 0 for r in rows)
