"""tinyserve beside a real vLLM on this CPU, on the same weights:
``python -m tinyserve.bench peer --engine vllm [--models cpu-bench,qwen2.5-0.5b-shape]
[--dtypes float32,bfloat16] [--engines ...] [--no-server] [--out FILE]`` (``make peer``).

vLLM runs from its own environment (``bench.vllm_setup``): ``bench.vllm_worker`` for its
offline API, its OpenAI server for the online part. Where it cannot run, the tinyserve
rows still print, after one line saying why vLLM skipped.

What is compared, one engine after the other on the same machine:
- engines: tinyserve with its packed decode path (``enforce_eager=False``), tinyserve
  eager, vLLM at its defaults (on CPU it keeps a core for its front end) and vLLM tuned
  as its CPU documentation says (every core computing, Intel OpenMP preloaded);
- models (``bench.random_checkpoint``): the ``cpu-bench`` preset's shape (Llama) and
  Qwen2.5-0.5B's shape (Qwen2: q/k/v biases, tied embeddings; vocabulary 32,000 instead
  of 151,936, as in the first measurement), random weights, fp32 and bf16;
- workloads (``VLLM_SCENARIOS``): 4 requests one at a time, 32 at once, 32 at once with
  mixed output lengths; prompts of 32-192 tokens, greedy, EOS ignored;
- offline: each engine's own API; online: each engine's OpenAI server driven by our
  ``bench serve`` client with at most B requests in flight.
Every row prints output tok/s, mean TTFT and TPOT (each engine's own per-request
timestamps offline, the client's online), start-up seconds and how many requests'
greedy tokens equal tinyserve eager's. Nothing is tuned on one side only.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from tinyserve.bench.peer import MIXED_NEW, PROMPT_LENS, Scenario
from tinyserve.bench.random_checkpoint import checkpoint_dir, model_config
from tinyserve.bench.vllm_setup import REPO, VLLM_VERSION, serve, vllm_env, vllm_python, vllm_unavailable
from tinyserve.host import cache_root

VLLM_SCENARIOS = (Scenario("B=1", 1, 4), Scenario("B=32", 32, 32),
                  Scenario("B=32, mixed outputs", 32, 32, mixed_outputs=True))
MAX_MODEL_LEN = PROMPT_LENS[1] + MIXED_NEW[1] + 8
ENGINES = ("tinyserve packed", "tinyserve eager", "vLLM defaults", "vLLM tuned")
# The run we ship (our machine, named in it).
STORED_REPORT = Path(__file__).resolve().parents[1] / "data" / "peer_vllm_cpu.json"


def last_report_path() -> Path:
    """Where `make peer` writes its report on the reader's machine."""
    return cache_root() / "peer" / "report.json"


def last_report() -> dict | None:
    """The report `make peer` last wrote on this machine, or None."""
    path = last_report_path()
    return json.loads(path.read_text()) if path.exists() else None


def stored_report() -> dict:
    """The run shipped with the package (machine, date and versions inside)."""
    return json.loads(STORED_REPORT.read_text())


def workloads(vocab: int, scenarios=VLLM_SCENARIOS, seed: int = 0) -> list[dict]:
    out = []
    for sc in scenarios:
        prompts, news = sc.workload(vocab, seed)
        out.append({"name": sc.name, "concurrency": sc.concurrency, "prompts": prompts, "news": news})
    return out


def run_vllm_offline(model: Path, dtype: str, jobs: list[dict], tuned: bool,
                     timeout: float = 3600) -> dict:
    """vLLM's offline API in its own process group; the worker's result
    (``bench.vllm_worker``). Its log goes to a file: a pipe would stay open as long as
    any of vLLM's own subprocesses lives."""
    from tinyserve.serving.processes import sigterm_as_exit, stop_group
    with tempfile.TemporaryDirectory() as tmp, sigterm_as_exit():
        job = {"model": str(model), "dtype": dtype, "max_model_len": MAX_MODEL_LEN,
               "workloads": jobs, "out": f"{tmp}/result.json"}
        Path(f"{tmp}/job.json").write_text(json.dumps(job))
        with open(f"{tmp}/log.txt", "w+") as log:
            proc = subprocess.Popen([str(vllm_python()), "-m", "tinyserve.bench.vllm_worker",
                                     f"{tmp}/job.json"], env=vllm_env(tuned), stdout=log,
                                    stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
            try:
                code = proc.wait(timeout)
            finally:
                stop_group(proc)
            if code != 0:
                log.seek(0)
                raise RuntimeError(f"vLLM worker failed ({code}): {log.read()[-3000:]}")
        return json.loads(Path(job["out"]).read_text())


def run_tinyserve_offline(model: Path, dtype: str, jobs: list[dict], eager: bool) -> dict:
    from tinyserve import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(str(model), dtype=dtype, max_num_seqs=max(j["concurrency"] for j in jobs),
              max_num_batched_tokens=512, max_model_len=MAX_MODEL_LEN, enforce_eager=eager)
    result = {"start_s": time.perf_counter() - started, "workloads": []}
    llm.generate([jobs[0]["prompts"][0]], SamplingParams(max_tokens=2, ignore_eos=True),
                 use_tqdm=False)                                 # warm-up, untimed
    for w in jobs:
        params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in w["news"]]
        began = time.perf_counter()
        if w["concurrency"] == 1:
            outs = [llm.generate([p], [sp], use_tqdm=False)[0] for p, sp in zip(w["prompts"], params)]
        else:
            outs = llm.generate(w["prompts"], params, use_tqdm=False)
        result["workloads"].append({
            "name": w["name"], "seconds": time.perf_counter() - began,
            "tokens": [o.token_ids for o in outs],
            "ttft": [o.metrics.ttft for o in outs], "tpot": [o.metrics.tpot for o in outs]})
    return result


def run_online(server, jobs: list[dict]) -> dict:
    """Our ``bench serve`` client against a started server: each workload with at most B
    requests in flight; per-request TTFT/TPOT as the client saw them."""
    from tinyserve.serving.client import benchmark
    from tinyserve.workload import RequestSpec

    out = {"start_s": server.start_s, "workloads": []}
    warm = [RequestSpec(arrival=0.0, prompt_len=len(jobs[0]["prompts"][0]), output_len=2)]
    benchmark(server.url, warm, prompts=jobs[0]["prompts"][:1], progress=False)
    for w in jobs:
        specs = [RequestSpec(arrival=0.0, prompt_len=len(p), output_len=n)
                 for p, n in zip(w["prompts"], w["news"])]
        s = benchmark(server.url, specs, prompts=w["prompts"], max_concurrency=w["concurrency"],
                      progress=False)
        out["workloads"].append({"name": w["name"], "seconds": s["duration"], "tokens": None,
                                 "ttft": [r["ttft"] for r in s["requests"]],
                                 "tpot": [r["tpot"] for r in s["requests"]],
                                 "errors": s["errors"],
                                 "output_tokens": s["total_output_tokens"]})
    return out


def start_server(engine: str, model: Path, dtype: str, timeout: float = 900):
    from tinyserve.serving.processes import ServerProcess
    started = time.perf_counter()
    if engine.startswith("vLLM"):
        server = serve(model, dtype, max_model_len=MAX_MODEL_LEN, tuned=engine == "vLLM tuned",
                       timeout=timeout)
    else:
        server = ServerProcess(["serve", "--model", str(model), "--dtype", dtype,
                                "--max-num-seqs", "32", "--max-num-batched-tokens", "512",
                                "--no-enforce-eager" if engine == "tinyserve packed" else "--enforce-eager"]
                               ).wait(timeout)
    server.start_s = time.perf_counter() - started
    return server


def summarize(engine: str, mode: str, result: dict, reference: dict | None) -> list[dict]:
    rows = []
    for i, w in enumerate(result["workloads"]):
        ref = reference["workloads"][i]["tokens"] if reference else None
        tokens = w["tokens"]
        out_tokens = w.get("output_tokens") or sum(map(len, tokens))
        mean = lambda xs: statistics.fmean(x for x in xs if x is not None) if any(
            x is not None for x in xs) else float("nan")
        rows.append({"engine": engine, "mode": mode, "workload": w["name"],
                     "tok_per_s": out_tokens / w["seconds"], "ttft": mean(w["ttft"]),
                     "tpot": mean(w["tpot"]), "start_s": result["start_s"],
                     "equal": (sum(a == b for a, b in zip(tokens, ref))
                               if tokens is not None and ref is not None else None),
                     "requests": len(w["ttft"]), "errors": w.get("errors", 0)})
    return rows


def run(shapes=("cpu-bench", "qwen2.5-0.5b-shape"), dtypes=("float32", "bfloat16"),
        engines=ENGINES, online: bool = True, say=print, out: str | None = None) -> dict:
    """Every engine on every model and dtype; the report. With ``out``, the report so far
    is written there after each engine (a long run that stops keeps what it measured)."""
    from tinyserve.host import fixed_threads, usable_cores
    from tinyserve.measure import this_machine
    reason = vllm_unavailable()
    if reason:
        say(f"vLLM skipped: {reason}")
        engines = tuple(e for e in engines if not e.startswith("vLLM"))
    import torch
    # tinyserve eager first: every other engine's tokens are compared with the first one's.
    order = tuple(dict.fromkeys(e for e in ("tinyserve eager", *engines) if e in engines))
    report = {"benchmark": "peer-vllm", "reference": order[0] if order else None,
              "vllm": VLLM_VERSION if not reason else None,
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "machine": this_machine().as_dict(), "rows": [],
              # Other programs slow both engines, and not equally: the load is part of the result.
              "load_average": [round(x, 1) for x in os.getloadavg()]}
    with fixed_threads(usable_cores()):
        for shape in shapes:
            for dtype in dtypes:
                model = checkpoint_dir(shape, dtype)
                jobs = workloads(model_config(shape).vocab_size)
                reference = None
                for engine in order:
                    say(f"{shape} {dtype}: {engine} offline ...", flush=True)
                    if engine.startswith("vLLM"):
                        res = run_vllm_offline(model, dtype, jobs, tuned=engine == "vLLM tuned")
                    else:
                        res = run_tinyserve_offline(model, dtype, jobs, eager=engine == "tinyserve eager")
                    reference = reference or res
                    rows = summarize(engine, "offline", res, reference)
                    if online:
                        say(f"{shape} {dtype}: {engine} server ...", flush=True)
                        with start_server(engine, model, dtype) as server:
                            rows += summarize(engine, "server", run_online(server, jobs), None)
                    for row in rows:
                        row.update(model=shape, dtype=dtype)
                        say("  " + format_row(row), flush=True)
                    report["rows"] += rows
                    report["load_average_end"] = [round(x, 1) for x in os.getloadavg()]
                    if out:
                        Path(out).write_text(json.dumps(report, indent=1, ensure_ascii=False))
    print_report(report, say)
    return report


def format_row(r: dict) -> str:
    equal = f"{r['equal']}/{r['requests']}" if r["equal"] is not None else "-"
    err = f"  {r['errors']} errors" if r["errors"] else ""
    return (f"{r['model']:<20}{r['dtype']:<10}{r['engine']:<18}{r['mode']:<9}{r['workload']:<22}"
            f"{r['tok_per_s']:>8.1f}{1e3 * r['ttft']:>9.0f}{1e3 * r['tpot']:>8.1f}"
            f"{r['start_s']:>9.1f}{equal:>7}{err}")


def print_report(report: dict, say=print) -> None:
    m = report["machine"]
    say(f"\ntinyserve vs vLLM {report['vllm'] or '(not run)'} on {m.get('cpu', '?')}, "
        f"{m.get('cores', '?')} cores, {report.get('date', '?')}: output tok/s, mean TTFT / TPOT in ms; "
        f"equal = requests whose greedy tokens equal {report.get('reference') or 'tinyserve eager'}'s")
    head = (f"{'model':<20}{'dtype':<10}{'engine':<18}{'mode':<9}{'workload':<22}"
            f"{'tok/s':>8}{'TTFT':>9}{'TPOT':>8}{'start s':>9}{'equal':>7}")
    say(head)
    for r in report["rows"]:
        say(format_row(r))
    if report.get("note"):
        say(report["note"])
    if report.get("load_average"):
        say(f"load average (1, 5, 15 min) when the run started: {report['load_average']} on "
            f"{m.get('cores', '?')} cores; other programs slow both engines, and not equally")
    for mode in ("offline", "server"):
        best = {}
        for r in report["rows"]:
            if r["mode"] == mode:
                best.setdefault((r["model"], r["dtype"], r["workload"]), {})[r["engine"]] = r["tok_per_s"]
        lines = [(k, v["tinyserve packed"] / v["vLLM tuned"]) for k, v in best.items()
                 if "tinyserve packed" in v and "vLLM tuned" in v]
        if lines:
            say(f"\n{mode}: tinyserve packed / vLLM tuned, output tok/s (>1: tinyserve faster)")
            for (model, dtype, workload), ratio in lines:
                say(f"  {model:<20}{dtype:<10}{workload:<22}{ratio:>6.2f}x")


def main(args) -> dict:
    engines = tuple(e.strip() for e in args.engines.split(",")) if args.engines else ENGINES
    unknown = set(engines) - set(ENGINES)
    if unknown:
        raise ValueError(f"engines: unknown {sorted(unknown)}; choose from {list(ENGINES)}")
    report = run(tuple(args.models.split(",")), tuple(args.dtypes.split(",")), engines,
                 online=not args.no_server, out=args.out)
    if args.out:
        print(f"wrote {args.out}")
    return report
