"""Every GPU measurement the book needs, in one run: ``python -m tinyserve.bench.gpu_evidence``.

Parts (``--only`` picks some), each written to ``<out-dir>/<gpu-slug>/<part>.json``:

- ``kernels``: fused Triton vs eager torch, GB/s against a measured copy (``bench_gpu``);
- ``crossover``: the GEMM stack at Llama-7B shapes in fp16, its knee and B=1 vs the floor;
- ``engine``: tinyserve's own decode step, B = 1, 2, 4, ..., 256, random 7B weights in fp16;
- ``transformers``: tinyserve vs ``transformers.generate`` on the same weights and batch.

GPU time is scarce and a hung kernel must not cost the other parts, so each part
runs in its own process under ``--part-timeout`` seconds (``--isolate thread``
runs them in this process instead, which the tests use). A part that raises,
crashes or times out still leaves a JSON with ``"status": "failed"`` and the error.

Without CUDA the script exits 2. ``--fake`` runs the same plumbing on the CPU:
fake device properties, a fake kernel timer and clock, tiny shapes; the numbers
mean nothing, the files and the table are the real ones.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from tinyserve.bench.peer import hf_model, no_stop
from tinyserve.model import ModelConfig

PARTS_ORDER = ("kernels", "crossover", "engine", "transformers")
RECORD_KEYS = ("part", "status", "error", "device", "machine", "date", "versions", "config",
               "results", "headline", "seconds")
DEFAULT_OUT = Path(__file__).parents[1] / "data" / "gpu"
DEFAULT_TIMEOUT = 140.0        # 4 parts x 140 s, plus start-up, stays under 10 minutes
NO_CUDA = ("gpu-evidence: no CUDA device here; run it on a machine with a GPU "
           "(or pass --fake to check the plumbing on this CPU)")
LLAMA_7B_CONFIG = ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                              num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                              max_position_embeddings=4096)
# More ids than the default tokenizer has (2048), as a 7B model: the engine must sample
# among all of them, as transformers does, for the --fake comparison to mean anything.
TINY_CONFIG = ModelConfig(vocab_size=4096)
TORCH_DTYPES = {"float16": torch.float16, "float32": torch.float32}


# ---- where it runs: the real GPU, or a fake one on the CPU ---------------------------------

@dataclass
class Env:
    """What the parts may measure with. ``device`` is where tensors live; ``timer(fn)``
    times a kernel (seconds); ``clock()`` is wall time for whole steps; ``sync()`` waits
    for the device. ``--fake`` swaps each for a CPU stand-in."""
    fake: bool
    device: str
    gpu: dict
    timer: Callable
    clock: Callable
    sync: Callable

    @property
    def slug(self) -> str:
        return re.sub(r"[^a-z0-9]+", "-", self.gpu["name"].lower()).strip("-")


def real_env() -> Env:
    from tinyserve.bench.kernels import gpu_time
    props = torch.cuda.get_device_properties(0)
    gpu = {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
           "sm_count": props.multi_processor_count,
           "capability": f"{props.major}.{props.minor}"}
    return Env(False, "cuda", gpu, gpu_time, time.perf_counter, torch.cuda.synchronize)


def fake_env() -> Env:
    ticks = itertools.count()
    gpu = {"name": "Fake GPU", "memory_gib": 80.0, "sm_count": 132, "capability": "9.0"}
    # Each clock read advances 1 ms: deterministic, strictly increasing step times.
    return Env(True, "cpu", gpu, lambda fn: (fn(), 1e-3)[1], lambda: next(ticks) * 1e-3,
               lambda: None)


def versions() -> dict:
    import importlib.util
    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("triton", "transformers"):
        out[name] = __import__(name).__version__ if importlib.util.find_spec(name) else None
    return out


def machine(env: Env) -> dict:
    return {"hostname": platform.node(), "platform": platform.platform(),
            "cpu_count": os.cpu_count(), "gpu": env.gpu, "fake": env.fake}


# ---- the parts: each returns (config, results, headline) -----------------------------------

def part_kernels(env: Env) -> tuple[dict, dict, str]:
    from tinyserve import kernels as K
    from tinyserve.bench import kernels as kb
    if not K.HAS_TRITON:
        raise RuntimeError("the kernel benchmark needs Triton (pip install triton)")
    cfg = (dict(tokens=64, batch=2, contexts=[40], copy_bytes=1 << 20) if env.fake else
           dict(tokens=32768, batch=16, contexts=[2048, 8192, 32768], copy_bytes=1 << 30))
    copy_gbps, rows = kb.bench_gpu(torch.float16, cfg["tokens"], cfg["batch"], tuple(cfg["contexts"]),
                                   device=env.device, timer=env.timer, copy_bytes=cfg["copy_bytes"])
    kb.print_table(f"fused vs eager on {env.gpu['name']}", copy_gbps, rows)
    fused = [r for r in rows if r["variant"] != "eager torch"]
    speedups = [r["speedup_vs_eager"] for r in fused]
    gmean = math.exp(statistics.fmean(math.log(s) for s in speedups))
    head = f"copy {copy_gbps:.0f} GB/s, fused {gmean:.2f}x eager (geomean)"
    return {**cfg, "dtype": "float16"}, {"copy_GBps": copy_gbps, "rows": rows,
                                         "fused_speedup_geomean": gmean}, head


def part_crossover(env: Env) -> tuple[dict, dict, str]:
    from tinyserve.bench import crossover as cx
    if env.fake:      # the CPU stack (hidden 1024) at one layer: the plumbing, not the numbers
        cfg = dict(batch_sizes=[1, 2, 4, 8], weight_gib=0.01, repeats=1, measure_seconds=0.05)
    else:
        per_layer = sum(a * b for a, b in cx.layer_shapes(4096)) * 2
        fits = 32 * per_layer < 0.7 * env.gpu["memory_gib"] * 2**30
        cfg = dict(batch_sizes=cx.default_batch_sizes("cuda"), repeats=3, measure_seconds=1.0,
                   weight_gib=None if fits else 0.5 * env.gpu["memory_gib"])  # None: 32 layers
    report = cx.run(env.device, batch_sizes=cfg["batch_sizes"], weight_gib=cfg["weight_gib"],
                    engine_model=None, repeats=cfg["repeats"], measure_seconds=cfg["measure_seconds"])
    fit = report["fits"]["gemm_stack"]
    head = f"knee {fit['knee']:.0f} (pred {fit['predicted_crossover']:.0f}), B=1 {fit['b1_over_floor']:.2f}x floor"
    return cfg, report, head


def random_model(config: ModelConfig, dtype: torch.dtype, device: str, seed: int = 0):
    """``LlamaForServing`` with random weights made in ``dtype`` where they live: 7B in
    fp32 on the CPU would be 27 GB and minutes of randn."""
    from tinyserve.checkpoint import allocate_parameters
    from tinyserve.model import LlamaForServing
    with torch.device("meta"):
        net = LlamaForServing(config)
    allocate_parameters(net, dtype, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name == "model.embed_tokens.weight":
                p.normal_(generator=gen)
            else:      # 1/sqrt(fan_in), as from_seed: activations stay O(1) through the stack
                p.normal_(std=p.shape[1] ** -0.5, generator=gen)
    return net.eval()


def make_engine(net, env: Env, max_seqs: int, max_len: int, max_tokens: int):
    """An engine that samples among all of the model's ids, as ``transformers`` does (the
    default tokenizer has 2048, and the engine samples among its tokenizer's ids only)."""
    from tinyserve.bench.random_checkpoint import byte_level_tokenizer
    from tinyserve.engine import LLMEngine
    from tinyserve.hf_tokenizer import HFTokenizer
    from tinyserve.kv_cache import blocks_for
    from tinyserve.scheduler import SchedulerConfig
    sched = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max(256, max_tokens),
                            max_model_len=max_len)
    tokenizer = HFTokenizer(byte_level_tokenizer(net.config.vocab_size))
    return LLMEngine(net, tokenizer, sched, max_seqs * blocks_for(max_len, 16),
                     clock=env.clock, enable_prefix_caching=False)


def prompts(batch: int, length: int, salt: int = 0) -> list[list[int]]:
    return [[(31 * i + 7 * j + salt) % 2000 + 10 for j in range(length)] for i in range(batch)]


def decode_step_time(engine, batch: int, steps: int, prompt_len: int) -> float:
    """Median of the engine's own step durations with ``batch`` requests all decoding."""
    from tinyserve.request import SamplingParams
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    for p in prompts(batch, prompt_len, salt=batch):
        engine.add_request(p, params)
    first = engine.core.num_steps
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(s.duration for s in engine.core.steps_since(first)
                             if s.num_decode_tokens == batch and s.num_prefill_tokens == 0)


def model_cfg(env: Env) -> tuple[ModelConfig, str]:
    return (TINY_CONFIG, "float32") if env.fake else (LLAMA_7B_CONFIG, "float16")


def part_engine(env: Env) -> tuple[dict, dict, str]:
    from dataclasses import asdict

    from tinyserve.measure import measure_device
    from tinyserve.bench import crossover as cx
    mc, dtype = model_cfg(env)
    sizes = [1, 2, 4, 8] if env.fake else [2**k for k in range(9)]
    steps, prompt_len = 3, 4
    cfg = {"model": asdict(mc), "dtype": dtype, "batch_sizes": sizes, "steps": steps,
           "prompt_len": prompt_len, "kernels": "torch", "modes": ["eager"],
           "enforce_eager": "LLM has no enforce_eager knob (no CUDA-graph mode): eager only"}
    net = random_model(mc, TORCH_DTYPES[dtype], env.device)
    engine = make_engine(net, env, sizes[-1], prompt_len + steps + 8, sizes[-1] * prompt_len)
    decode_step_time(engine, min(4, sizes[-1]), steps, prompt_len)          # warm-up
    times = [decode_step_time(engine, b, steps, prompt_len) for b in sizes]
    read = [p for n, p in net.named_parameters() if "embed_tokens" not in n]
    weight_bytes = sum(p.numel() * p.element_size() for p in read)
    hw = measure_device(env.device, seconds=0.05 if env.fake else 1.0,
                            copy_mib=16 if env.fake else None)
    fit = cx.knee_report(sizes, times, hw, "fp16" if dtype == "float16" else "fp32", weight_bytes)
    results = {"step_times_s": times, "weight_bytes": weight_bytes, "device_spec": asdict(hw),
               "fit": fit, "tokens_per_s": [b / t for b, t in zip(sizes, times)]}
    head = f"B=1 {times[0] * 1e3:.2f} ms ({fit['b1_over_floor']:.2f}x floor), B={sizes[-1]} {times[-1] * 1e3:.2f} ms"
    return cfg, results, head


def timed(env: Env, fn) -> tuple[float, object]:
    env.sync()
    start = env.clock()
    out = fn()
    env.sync()
    return env.clock() - start, out


def part_transformers(env: Env) -> tuple[dict, dict, str]:
    from tinyserve.request import SamplingParams
    mc, dtype = model_cfg(env)
    batch, prompt_len, new = (2, 4, 4) if env.fake else (16, 32, 64)
    cfg = {"dtype": dtype, "batch": batch, "prompt_len": prompt_len, "new_tokens": new,
           "greedy": True, "model": {"hidden_size": mc.hidden_size, "num_layers": mc.num_hidden_layers}}
    net = random_model(mc, TORCH_DTYPES[dtype], env.device)
    engine = make_engine(net, env, batch, prompt_len + new + 8, batch * prompt_len)
    ps = prompts(batch, prompt_len)

    def ours():
        ids = [engine.add_request(p, SamplingParams(max_tokens=new, ignore_eos=True)) for p in ps]
        reqs = [engine.requests[i] for i in ids]
        while engine.has_unfinished_requests():
            engine.step()
        return [list(r.output_token_ids) for r in reqs]

    hf = hf_model(net, env.device)
    no_stop(hf)
    x = torch.tensor(ps, device=env.device)
    mask = torch.ones_like(x)

    def theirs(n=new):
        with torch.inference_mode():
            out = hf.generate(input_ids=x, attention_mask=mask, max_new_tokens=n,
                              do_sample=False, pad_token_id=0)
        return out[:, prompt_len:].tolist()

    ours(), theirs(2)                                                          # warm-up
    t_ours, tok_ours = timed(env, ours)
    t_hf, tok_hf = timed(env, theirs)
    first_match = sum(a[0] == b[0] for a, b in zip(tok_ours, tok_hf)) / batch
    all_match = sum(a == b for a, b in zip(tok_ours, tok_hf)) / batch
    results = {"tinyserve_s": t_ours, "transformers_s": t_hf,
               "tinyserve_tok_per_s": batch * new / t_ours, "transformers_tok_per_s": batch * new / t_hf,
               "ratio": t_hf / t_ours, "first_token_match": first_match, "all_tokens_match": all_match}
    head = (f"tinyserve {results['ratio']:.2f}x transformers, first tokens match {first_match:.0%}, "
            f"all {new} tokens {all_match:.0%}")
    return cfg, results, head


PARTS: dict[str, Callable[[Env], tuple]] = {"kernels": part_kernels, "crossover": part_crossover,
                                           "engine": part_engine, "transformers": part_transformers}


# ---- running the parts: records, isolation, the summary ------------------------------------

def record(part: str, env: Env, status: str, seconds: float, config=None, results=None,
           headline="", error=None, **extra) -> dict:
    return {"part": part, "status": status, "error": error, "device": env.device,
            "machine": machine(env), "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "versions": versions(), "config": config, "results": results, "headline": headline,
            "seconds": round(seconds, 3), **extra}


def part_path(out_dir: Path, env: Env, part: str) -> Path:
    return Path(out_dir) / env.slug / f"{part}.json"


def write(rec: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec, indent=1, default=str) + "\n")
    return path


def stored(part: str, directory: Path | None = None) -> list[dict]:
    """The records of ``part`` that ran to the end (``status`` ok) in ``tinyserve/data/gpu``
    (or ``directory``), one per GPU, newest first: what the notebooks show without a GPU."""
    paths = Path(directory or DEFAULT_OUT).glob(f"*/{part}.json")
    records = [r for r in (json.loads(p.read_text()) for p in paths) if r["status"] == "ok"]
    return sorted(records, key=lambda r: r["date"], reverse=True)


def execute(part: str, env: Env) -> dict:
    """Run one part here and return its record, catching what it raises."""
    start = time.perf_counter()
    try:
        config, results, head = PARTS[part](env)
        return record(part, env, "ok", time.perf_counter() - start, config, results, head)
    except Exception as e:                                     # noqa: BLE001 - recorded, not fatal
        return record(part, env, "failed", time.perf_counter() - start,
                      error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())


def in_thread(part: str, env: Env, out_dir: Path, timeout: float) -> dict | None:
    """Run in a daemon thread; ``None`` when it outlives ``timeout``. The thread is then
    abandoned, and only this function writes, so a late finish cannot overwrite the record."""
    box = []
    worker = threading.Thread(target=lambda: box.append(execute(part, env)), daemon=True)
    worker.start()
    worker.join(timeout)
    if not box:
        return None
    write(box[0], part_path(out_dir, env, part))
    return box[0]


def in_process(part: str, env: Env, out_dir: Path, timeout: float) -> dict | None:
    """Run in a child python, killed after ``timeout``: a hung CUDA kernel dies with it,
    and each part starts with all of the GPU's memory."""
    path = part_path(out_dir, env, part)
    path.unlink(missing_ok=True)                             # so a crash cannot leave an old file
    cmd = [sys.executable, "-m", "tinyserve.bench.gpu_evidence", "--child", part,
           "--out-dir", str(out_dir)] + (["--fake"] if env.fake else [])
    try:
        rc = subprocess.run(cmd, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        return None
    if not path.exists():                                    # it died before writing (segfault, OOM kill)
        write(record(part, env, "failed", 0.0, error=f"child process exited with {rc}, no record"), path)
    return json.loads(path.read_text())


def run_all(parts, env: Env, out_dir: Path, timeout: float, isolate: str = "process") -> list[dict]:
    runner = in_process if isolate == "process" else in_thread
    records = []
    for part in parts:
        print(f"== {part} (limit {timeout:g} s)", flush=True)
        start = time.perf_counter()
        rec = runner(part, env, out_dir, timeout)
        if rec is None:
            rec = record(part, env, "failed", time.perf_counter() - start, timed_out=True,
                         error=f"timed out after {timeout:g} s")
            write(rec, part_path(out_dir, env, part))
        records.append(rec)
    return records


def summary(records: list[dict]) -> str:
    lines = [f"{'part':<14}{'status':<8}{'seconds':>9}  headline", "-" * 72]
    for r in records:
        lines.append(f"{r['part']:<14}{r['status']:<8}{r['seconds']:>9.1f}  {r['headline'] or r['error']}")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m tinyserve.bench.gpu_evidence", description=__doc__.split("\n")[0])
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT,
                   help="folder for <gpu-slug>/<part>.json (default tinyserve/data/gpu)")
    p.add_argument("--only", nargs="+", choices=PARTS_ORDER, metavar="PART",
                   help=f"run only these parts ({', '.join(PARTS_ORDER)})")
    p.add_argument("--part-timeout", type=float, default=DEFAULT_TIMEOUT,
                   help=f"seconds each part may take (default {DEFAULT_TIMEOUT:g})")
    p.add_argument("--isolate", choices=("process", "thread"), default="process",
                   help="run each part in a child process (default) or a thread of this one")
    p.add_argument("--fake", action="store_true",
                   help="no GPU needed: fake device, timers and tiny shapes (checks the plumbing)")
    p.add_argument("--child", choices=PARTS_ORDER, help=argparse.SUPPRESS)    # one part, in_process
    return p.parse_args(argv)


def main(argv=None) -> int:
    """0 when every part succeeded, 1 when any failed or timed out, 2 without CUDA."""
    args = parse_args(argv)
    if not args.fake and not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    env = fake_env() if args.fake else real_env()
    if args.child:
        rec = execute(args.child, env)
        write(rec, part_path(args.out_dir, env, args.child))
        return 0 if rec["status"] == "ok" else 1
    parts = [p for p in PARTS_ORDER if not args.only or p in args.only]
    records = run_all(parts, env, args.out_dir, args.part_timeout, args.isolate)
    print(summary(records))
    print(f"records in {Path(args.out_dir) / env.slug}")
    return 0 if all(r["status"] == "ok" for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
