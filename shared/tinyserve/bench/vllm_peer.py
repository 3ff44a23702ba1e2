"""tinyserve beside a real vLLM on this CPU, on the same weights:
``python -m tinyserve.bench peer --engine vllm [--models cpu-bench,qwen2.5-0.5b-shape]
[--dtypes float32,bfloat16] [--engines ...] [--rounds R] [--no-server] [--out FILE]`` (``make peer``).

vLLM runs from its own environment (``bench.vllm_setup``): ``bench.vllm_worker`` for its
offline API, its OpenAI server for the online part. Where it cannot run, the tinyserve
rows still print, after one line saying why vLLM skipped.

What is compared, on the same machine: offline, the engines of one model and dtype loaded
together and taking turns workload by workload, for ``ROUNDS`` rounds; online, one server
after the other:
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
The B=1 TPOTs are also printed against the weight-read floor (the bytes a decode step
reads over the best read bandwidth, measured before each round): how close to it an
engine runs bounds how much faster any other engine can be.
"""

from __future__ import annotations

import contextlib
import gc
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
from tinyserve.bench.vllm_worker import write
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


# Offline, every engine of a model and dtype stays loaded and runs all the workloads in
# ROUNDS rounds of turns: in each round every workload runs on each engine, the engines'
# turns at one workload back to back and their order reversed every turn (ABBA...), so
# that a pair times the engines next to one another, on one state of a machine whose
# memory speed drifts by tens of percent from minute to minute (an AMD EPYC Zen 5, 32 MiB
# L3: one model's B=1 token 14 ms for minutes, then 20; a round of whole workloads per
# turn put a minute between an engine's B=1 and the other's, and their ratio spread
# 0.70-0.84 over three rounds). Each workload reports the median round; the ratio of two
# engines is the median of their per-round ratios. Each round has prompts of its own
# (seed r): a prompt seen in an earlier round would be served from both engines' prefix
# caches. PAUSE_S between turns lets the OpenMP threads of the engine before stop spinning.
ROUNDS, PAUSE_S = 3, 1.0


class VllmOffline:
    """vLLM's offline API loaded once in its own process group (``bench.vllm_worker``
    with a control directory), timed in turns by ``turn(t)``. Its log goes to a file: a
    pipe would stay open as long as any of vLLM's own subprocesses lives."""

    def __init__(self, model: Path, dtype: str, jobs: list[dict], tuned: bool, turns: int = 1,
                 timeout: float = 3600):
        from tinyserve.serving.processes import sigterm_as_exit, stop_group
        self.timeout, self.stack, self.jobs = timeout, contextlib.ExitStack(), jobs
        try:
            self.stack.enter_context(sigterm_as_exit())
            self.dir = Path(self.stack.enter_context(tempfile.TemporaryDirectory()))
            job = {"model": str(model), "dtype": dtype, "max_model_len": MAX_MODEL_LEN,
                   "workloads": jobs, "turns": turns, "control": str(self.dir)}
            (self.dir / "job.json").write_text(json.dumps(job))
            self.log = self.stack.enter_context(open(self.dir / "log.txt", "w+"))
            self.proc = subprocess.Popen([str(vllm_python()), "-m", "tinyserve.bench.vllm_worker",
                                          str(self.dir / "job.json")], env=vllm_env(tuned),
                                         stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO,
                                         start_new_session=True)
            self.stack.callback(stop_group, self.proc)     # first on close: before its directory goes
            self.start_s = self._wait("ready.json")["start_s"]
        except BaseException:
            self.stack.close()
            raise

    def _wait(self, name: str):
        path, deadline = self.dir / name, time.monotonic() + self.timeout
        while not path.exists():
            code = self.proc.poll()
            if code is not None or time.monotonic() > deadline:
                self.log.seek(0)
                raise RuntimeError(f"vLLM worker {'failed (%s)' % code if code is not None else 'timed out'}"
                                   f" before {name}: {self.log.read()[-3000:]}")
            time.sleep(0.01)
        return json.loads(path.read_text())

    def turn(self, t: int, jobs: list[dict] | None = None) -> dict:
        """The workloads (default: those it started with) once more, as turn ``t``."""
        write(self.dir / f"go-{t}", jobs or self.jobs)
        return {"start_s": self.start_s, "workloads": self._wait(f"turn-{t}.json")}

    def close(self) -> None:
        self.stack.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class TinyserveOffline:
    """tinyserve's ``LLM`` loaded once, timed in turns by ``turn(t)`` as ``VllmOffline``."""

    def __init__(self, model: Path, dtype: str, jobs: list[dict], eager: bool):
        from tinyserve import LLM, SamplingParams
        started = time.perf_counter()
        self.llm = LLM(str(model), dtype=dtype, max_num_seqs=max(j["concurrency"] for j in jobs),
                       max_num_batched_tokens=512, max_model_len=MAX_MODEL_LEN, enforce_eager=eager)
        self.start_s, self.jobs = time.perf_counter() - started, jobs
        self.llm.generate([jobs[0]["prompts"][0]], SamplingParams(max_tokens=2, ignore_eos=True),
                          use_tqdm=False)                        # warm-up, untimed

    def turn(self, t: int = 0, jobs: list[dict] | None = None) -> dict:
        from tinyserve import SamplingParams
        result = {"start_s": self.start_s, "workloads": []}
        for w in jobs or self.jobs:
            params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in w["news"]]
            began = time.perf_counter()
            if w["concurrency"] == 1:
                outs = [self.llm.generate([p], [sp], use_tqdm=False)[0] for p, sp in zip(w["prompts"], params)]
            else:
                outs = self.llm.generate(w["prompts"], params, use_tqdm=False)
            result["workloads"].append({
                "name": w["name"], "seconds": time.perf_counter() - began,
                "tokens": [o.token_ids for o in outs],
                "ttft": [o.metrics.ttft for o in outs], "tpot": [o.metrics.tpot for o in outs]})
        return result

    def close(self) -> None:
        del self.llm
        gc.collect()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def start_offline(engine: str, model: Path, dtype: str, jobs: list[dict], turns: int):
    if engine.startswith("vLLM"):
        return VllmOffline(model, dtype, jobs, tuned=engine == "vLLM tuned", turns=turns)
    return TinyserveOffline(model, dtype, jobs, eager=engine == "tinyserve eager")


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


def decode_bytes(shape: str, dtype: str) -> int:
    """The bytes one decode step of ``shape`` in ``dtype`` reads (``packed_gemm.weight_bytes``)."""
    import torch
    from tinyserve.model import LlamaForServing
    from tinyserve.packed_gemm import weight_bytes
    with torch.device("meta"):                  # shapes only: no memory, no init
        return weight_bytes(LlamaForServing(model_config(shape)).to(getattr(torch, dtype)))


def summarize(engine: str, mode: str, rounds: list[dict], reference: dict | None) -> list[dict]:
    """One row per workload from ``rounds`` (one result each): output tok/s, TTFT and TPOT
    of its median round (the lower middle one of an even count), every round's tok/s;
    tokens compared from the first round."""
    rows = []
    mean = lambda xs: statistics.fmean(x for x in xs if x is not None) if any(
        x is not None for x in xs) else float("nan")
    for i, first in enumerate(rounds[0]["workloads"]):
        runs = [r["workloads"][i] for r in rounds]
        rates = [(w.get("output_tokens") or sum(map(len, w["tokens"]))) / w["seconds"] for w in runs]
        median = sorted(range(len(runs)), key=rates.__getitem__)[(len(runs) - 1) // 2]
        w, ref = runs[median], reference["workloads"][i]["tokens"] if reference else None
        tokens = first["tokens"]
        rows.append({"engine": engine, "mode": mode, "workload": first["name"],
                     "tok_per_s": rates[median], "tok_per_s_rounds": rates,
                     "ttft": mean(w["ttft"]), "tpot": mean(w["tpot"]), "start_s": rounds[0]["start_s"],
                     "equal": (sum(a == b for a, b in zip(tokens, ref))
                               if tokens is not None and ref is not None else None),
                     "requests": len(w["ttft"]), "errors": w.get("errors", 0)})
    return rows


def run(shapes=("cpu-bench", "qwen2.5-0.5b-shape"), dtypes=("float32", "bfloat16"),
        engines=ENGINES, online: bool = True, rounds: int = ROUNDS, say=print,
        out: str | None = None) -> dict:
    """Every engine on every model and dtype; the report. Offline, a model and dtype's engines
    are loaded together and take turns for ``rounds`` rounds (``ROUNDS``); online, each
    server runs alone, one after the other. With ``out``, the report so far is written
    there after each model and dtype (a long run that stops keeps what it measured)."""
    from tinyserve.host import fixed_threads, usable_cores
    from tinyserve.measure import read_bandwidth, this_machine
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    reason = vllm_unavailable()
    if reason:
        say(f"vLLM skipped: {reason}")
        engines = tuple(e for e in engines if not e.startswith("vLLM"))
    import torch
    # tinyserve eager first: every other engine's tokens are compared with the first one's.
    order = tuple(dict.fromkeys(e for e in ("tinyserve eager", *engines) if e in engines))
    report = {"benchmark": "peer-vllm", "reference": order[0] if order else None,
              "vllm": VLLM_VERSION if not reason else None, "rounds": rounds,
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "machine": this_machine().as_dict(), "rows": [], "floors": [],
              # Other programs slow both engines, and not equally: the load is part of the result.
              "load_average": [round(x, 1) for x in os.getloadavg()]}
    with fixed_threads(usable_cores()):
        for shape in shapes:
            for dtype in dtypes:
                model = checkpoint_dir(shape, dtype)
                vocab = model_config(shape).vocab_size
                # Started on prompts of no round: the warm-up's would be in the prefix caches.
                jobs = workloads(vocab, seed=-1)
                results = {engine: [] for engine in order}
                bandwidths = []
                with contextlib.ExitStack() as stack:
                    started = {}
                    for engine in order:
                        say(f"{shape} {dtype}: {engine} offline, starting ...", flush=True)
                        started[engine] = stack.enter_context(
                            start_offline(engine, model, dtype, jobs, turns=rounds * len(jobs)))
                    for r in range(rounds):
                        say(f"{shape} {dtype}: offline round {r + 1} of {rounds} ...", flush=True)
                        time.sleep(PAUSE_S)
                        bandwidths.append(read_bandwidth("cpu", seconds=0.5))
                        for engine in order:
                            results[engine].append({"start_s": started[engine].start_s, "workloads": []})
                        for i, w in enumerate(workloads(vocab, seed=r)):
                            t = r * len(jobs) + i
                            for engine in (order if t % 2 == 0 else order[::-1]):
                                time.sleep(PAUSE_S)
                                results[engine][r]["workloads"] += started[engine].turn(t, [w])["workloads"]
                for engine in order:
                    rows = summarize(engine, "offline", results[engine], results[order[0]][0])
                    if online:
                        say(f"{shape} {dtype}: {engine} server ...", flush=True)
                        with start_server(engine, model, dtype) as server:
                            rows += summarize(engine, "server", [run_online(server, workloads(vocab))], None)
                    for row in rows:
                        row.update(model=shape, dtype=dtype)
                        say("  " + format_row(row), flush=True)
                    report["rows"] += rows
                report["floors"].append({"model": shape, "dtype": dtype,
                                         "weight_bytes": decode_bytes(shape, dtype),
                                         "read_bandwidth_rounds": bandwidths})
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
        by_key = {}
        for r in report["rows"]:
            if r["mode"] == mode:
                by_key.setdefault((r["model"], r["dtype"], r["workload"]), {})[r["engine"]] = r
        lines = [(k, paired_ratios(v["tinyserve packed"], v["vLLM tuned"])) for k, v in by_key.items()
                 if "tinyserve packed" in v and "vLLM tuned" in v]
        if lines:
            say(f"\n{mode}: tinyserve packed / vLLM tuned, output tok/s (>1: tinyserve faster)"
                + ("; median of the rounds' ratios (lowest-highest)" if mode == "offline" else ""))
            for (model, dtype, workload), ratios in lines:
                spread = f"  ({min(ratios):.2f}-{max(ratios):.2f}, {len(ratios)} rounds)" if len(ratios) > 1 else ""
                say(f"  {model:<20}{dtype:<10}{workload:<22}{statistics.median(ratios):>6.2f}x{spread}")
    print_floors(report, say)


def print_floors(report: dict, say=print) -> None:
    """Each offline B=1 TPOT as a multiple of the weight-read floor, and the multiple that
    1.2x vLLM tuned's speed would take."""
    floors = report.get("floors") or []
    if floors:
        say("\noffline B=1 against the weight-read floor (bytes a decode step reads / the best "
            "read bandwidth, measured before each round): TPOT / floor")
    for f in floors:
        bandwidth = max(f["read_bandwidth_rounds"])
        floor = f["weight_bytes"] / bandwidth
        tpots = {r["engine"]: r["tpot"] for r in report["rows"] if r["mode"] == "offline"
                 and r["workload"] == "B=1" and (r["model"], r["dtype"]) == (f["model"], f["dtype"])}
        line = "  ".join(f"{e} {t / floor:.2f}" for e, t in tpots.items())
        if "vLLM tuned" in tpots:
            line += f"; 1.2x vLLM tuned would take {tpots['vLLM tuned'] / 1.2 / floor:.2f}"
        say(f"  {f['model']:<20}{f['dtype']:<10}floor {floor * 1e3:.1f} ms "
            f"({f['weight_bytes'] / 2**20:.0f} MiB / {bandwidth / 1e9:.1f} GB/s): {line}")


def paired_ratios(a: dict, b: dict) -> list[float]:
    """Row ``a``'s tok/s over row ``b``'s, round by round (each round timed both engines
    in turn); a report from before rounds has one rate per row."""
    rounds_a, rounds_b = (r.get("tok_per_s_rounds") or [r["tok_per_s"]] for r in (a, b))
    if len(rounds_a) != len(rounds_b):
        return [a["tok_per_s"] / b["tok_per_s"]]
    return [x / y for x, y in zip(rounds_a, rounds_b)]


def main(args) -> dict:
    engines = tuple(e.strip() for e in args.engines.split(",")) if args.engines else ENGINES
    unknown = set(engines) - set(ENGINES)
    if unknown:
        raise ValueError(f"engines: unknown {sorted(unknown)}; choose from {list(ENGINES)}")
    report = run(tuple(args.models.split(",")), tuple(args.dtypes.split(",")), engines,
                 online=not args.no_server, rounds=ROUNDS if args.rounds is None else args.rounds,
                 out=args.out)
    if args.out:
        print(f"wrote {args.out}")
    return report
