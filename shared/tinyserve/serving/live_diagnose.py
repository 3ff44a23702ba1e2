"""The chapter's tuning order on a live server: two scrapes of ``/metrics``, one ``Diagnosis``.

    tinyserve diagnose --url http://127.0.0.1:8000 --window 60 --ttft-slo 0.5 --tpot-slo 0.05
    live = diagnose_url("http://127.0.0.1:8000", window=60, ttft_slo=0.5, tpot_slo=0.05)
    print(live)        # the metrics used, the window's numbers, then the Diagnosis

The window between the scrapes becomes the summary that ``tinyserve.diagnose``
reads, and the diagnosis is that same function, the one notebook 08 teaches:

* ``request_throughput``: finished requests / window; ``arrival_rate``: finished
  (+ rejected, + SGLang's aborted) + the change in requests held (running +
  waiting; an engine that restarted lost what it held), / window;
* ``queue_length_at_start``, ``queue_length_at_end``, ``max_queue_length``,
  ``queue_growth_rate``: the waiting gauge at the two scrapes, the larger and the
  change per second (a queue that grows while arrivals outpace completions, or
  while the batch is at its cap, is overload, whatever the latency of the requests
  that did finish); ``mean_batch_size``: generated tokens / engine steps where the
  engine counts its steps (vLLM's and tinyserve's tokens-per-step histogram: every
  sequence past its prefill adds one token to a step), else the running gauge averaged
  over the two scrapes (a live vLLM's gauge read 0 at a scrape while its steps ran 4
  sequences; ours read 1 at both while its 2 seats stayed full);
  per engine either way (vLLM's data-parallel engines, ``engine`` label, and SGLang's
  ``dp_rank`` each have their own batch; of SGLang's tensor/pipeline ranks one is
  read); ``mean_kv_usage``: the KV-usage gauge, averaged;
* ``output_throughput``: generated tokens / window (zero with requests held: a
  stalled server); ``mean_context_len``: mean prompt + half the mean output of the
  window's tokens per finished request, where a decode step's context sits on
  average (for the context-aware crossover);
* ``step_token_ceiling``, ``step_share_at_ceiling``: the tokens-per-step
  histogram, its highest non-empty bucket and the share of steps in it (steps
  pinned at one count while requests wait: the token budget);
* ``{mean,median,p99}_{ttft,tpot,itl,e2e}`` and ``mean_queue_time``: the window's
  histogram observations (mean = sum / count, quantiles from the buckets);
* ``prefix_cache_hit_rate``: the share of prompt tokens served from a cache in
  the window, local or through a KV connector (vLLM's ``prompt_tokens_cached``,
  else its ``prompt_tokens_by_source``, else local + external hits / lookups);
  ``num_preemptions``: preemptions in the window.

What the server does not export stays unknown (``LiveDiagnosis.unknown``), and
the step that needed it says so. One substitution is made, and named: an engine
without a per-request TPOT histogram (SGLang, vLLM < 0.11) has its mean TPOT read
from the inter-token histogram (the mean gap is decode time / decode tokens: the
token-weighted mean TPOT), while its median and p99 stay unknown, since a
quantile of the gaps is not a quantile of the per-request TPOT; step 1 then
compares mean with mean, so the same traffic gets the same verdict on every engine.
The crossover (step 2) needs the GPU and the model, which ``/metrics`` does not
tell: from ``crossover_of(hardware=..., model_spec=...)`` or ``model_dir``,
else that step is skipped and says so.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from tinyserve.diagnose import STATS, Diagnosis, diagnose, format_value
from tinyserve.hardware import MODELS, ModelSpec, crossover_batch, get_hardware, lookup
from tinyserve.serving.client import run_benchmark
from tinyserve.serving.dialects import Name
from tinyserve.serving.scrape import Window, fetch_metrics, read_scrape

QUANTILES = {"mean": None, "median": 0.5, "p99": 0.99}
LATENCIES = ("ttft", "tpot", "itl", "e2e")
SKIPPED_CROSSOVER = ("skipped: /metrics tells neither the GPU nor the model; pass --hardware and "
                     "--model-spec (or --model-dir), or --crossover")
NO_MAX_NUM_SEQS = "not in /metrics; pass --max-num-seqs (vLLM --max-num-seqs, SGLang --max-running-requests)"
NO_PREFIX_SHARE = "not given, so the hit rate is shown but not judged; pass --prefix-share"


@dataclass
class LiveDiagnosis:
    """What ``diagnose_window`` read, computed and concluded."""
    engine: str
    seconds: float
    model: str | None
    sources: dict           # role -> the metric it was read from (and its version note)
    summary: dict           # the window as diagnose() reads it
    crossover: str          # how the crossover was obtained, or why it was skipped
    diagnosis: Diagnosis
    url: str | None = None
    notes: list = field(default_factory=list)     # what the reader must know (restarts)

    @property
    def unknown(self) -> dict:
        """Summary key or knob -> why it is not known."""
        return self.diagnosis.unknown

    def __str__(self) -> str:
        where = f" at {self.url}" if self.url else ""
        name = self.model if self.model is None or self.model.isprintable() else repr(self.model)[1:-1]
        model = f", model {name}" if self.model else ""
        lines = [f"{self.engine}{where}{model}: a window of {self.seconds:.1f} s", "metrics used:"]
        lines += [f"  {role:<18}{source}" for role, source in self.sources.items()]
        lines.append("over the window:")
        lines += [f"  {key:<22}{format_value(value)}" for key, value in self.summary.items()]
        lines.append(f"crossover: {self.crossover}")
        lines += [f"note: {note}" for note in self.notes]
        lines += ["", str(self.diagnosis)]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        d = self.diagnosis
        return {"engine": self.engine, "url": self.url, "model": self.model, "seconds": self.seconds,
                "sources": self.sources, "summary": plain(self.summary), "crossover": self.crossover,
                "notes": self.notes,
                "diagnosis": {"stage": d.stage, "finding": d.finding, "action": d.action,
                              "evidence": plain(d.evidence), "next": d.next, "unknown": d.unknown}}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False, indent=2, allow_nan=False)


def plain(values: dict) -> dict:
    """JSON-ready: tuples as lists, NaN and infinities as null (JSON has neither)."""
    def one(v):
        if isinstance(v, (tuple, list)):
            return [one(x) for x in v]
        if isinstance(v, dict):
            return plain(v)
        return None if isinstance(v, float) and not math.isfinite(v) else v
    return {k: one(v) for k, v in values.items()}


# ---- the window as a summary --------------------------------------------------------

def load_summary(w: Window, s: dict, unknown: dict) -> None:
    """Arrivals, completions, the queue, the batch, the KV cache and preemptions."""
    finished, rejected = w.delta("finished"), w.delta("rejected") or 0.0
    aborted = w.delta("aborted") or 0.0
    running, waiting = w.gauge("running"), w.gauge("waiting")
    if finished is None:
        unknown["request_throughput"] = unknown["arrival_rate"] = w.missing("finished")
    else:
        s["completed"] = finished
        s["request_throughput"] = finished / w.seconds
        if running is None or waiting is None:
            unknown["arrival_rate"] = w.missing("running" if running is None else "waiting")
        else:       # held at the start by an engine that restarted: lost, not served
            held_before = sum(w.gauge(role, surviving=True)[0] for role in ("running", "waiting"))
            held = running[1] + waiting[1] - held_before
            s["arrival_rate"] = (finished + rejected + aborted + held) / w.seconds
    if waiting is None:
        for key in ("queue_length_at_start", "queue_length_at_end", "max_queue_length", "queue_growth_rate"):
            unknown[key] = w.missing("waiting")
    else:
        s["queue_length_at_start"], s["queue_length_at_end"] = waiting
        s["max_queue_length"] = max(waiting)
        s["queue_growth_rate"] = (waiting[1] - waiting[0]) / w.seconds
    engines = w.engines("running")
    steps, generated = w.histogram("step_tokens"), w.delta("generation_tokens")
    if steps is not None and steps.count and generated is not None:
        # Every sequence that is past its prefill adds one token to a step, so this is the
        # mean batch over every step of the window (counted per step: per engine already).
        s["mean_batch_size"] = generated / steps.count
    elif running is None:
        unknown["mean_batch_size"] = w.missing("running")
    else:       # the crossover and max_num_seqs are per engine, and so is the batch
        s["mean_batch_size"] = sum(running) / 2 / engines
    kv_usage = w.gauge("kv_usage")
    if kv_usage is None:
        unknown["mean_kv_usage"] = w.missing("kv_usage")
    else:
        s["mean_kv_usage"] = sum(kv_usage) / 2
    if engines > 1:
        s["engines"] = engines
        w.notes.append(f"{engines} data-parallel engines: mean_batch_size is per engine, as max_num_seqs "
                       "and the crossover are")
    preemptions = w.delta("preemptions")
    if preemptions is None:
        unknown["num_preemptions"] = w.missing("preemptions")
    else:
        s["num_preemptions"] = preemptions
    generated, prompts = w.delta("generation_tokens"), w.delta("prompt_tokens")
    if generated is not None:
        s["output_throughput"] = generated / w.seconds
    if finished and generated is not None and prompts is not None:
        s["mean_context_len"] = (prompts + generated / 2) / finished
    else:
        unknown["mean_context_len"] = "needs the finished-request, prompt-token and generated-token counters"


def step_summary(w: Window, s: dict, unknown: dict) -> None:
    """Where the window's steps sit in tokens: the highest non-empty bucket and its share."""
    h = w.histogram("step_tokens")
    if h is None or h.count == 0:
        reason = w.missing("step_tokens") if h is None else "no steps in the window"
        unknown.update(dict.fromkeys(("step_token_ceiling", "step_share_at_ceiling"), reason))
        return
    counts = h.counts
    top = max(i for i, n in enumerate(counts) if n)
    s["step_token_ceiling"] = h.bounds[top] if top < len(h.bounds) - 1 else h.bounds[-2]
    s["step_share_at_ceiling"] = counts[top] / h.count


def reused_share(w: Window) -> float | None:
    """vLLM's share of prompt tokens served from any cache (local or KV connector), when
    it counts them so; None when it does not."""
    cached, prompts = w.delta("cached_prompt_tokens"), w.delta("prompt_tokens")
    if cached is not None and prompts:
        return cached / prompts
    w.found.pop("cached_prompt_tokens", None)
    reused = lambda labels: labels.get("source") in ("local_cache_hit", "external_kv_transfer")
    by_source = w.delta("prompt_by_source")
    if by_source:
        return w.delta("prompt_by_source", reused) / by_source
    w.found.pop("prompt_by_source", None)
    return None


def cache_summary(w: Window, s: dict, unknown: dict) -> None:
    """Prefix-cache hits / lookups over the window (local and KV-connector reuse where
    the engine tells both); a hit-rate gauge if no counters."""
    rate = reused_share(w)
    queries, hits = w.delta("prefix_queries"), w.delta("prefix_hits")
    external_queries, external_hits = w.delta("external_queries"), w.delta("external_hits")
    if external_queries and external_hits is not None:
        s["external_prefix_cache_hit_rate"] = external_hits / external_queries
        if rate is None and queries and hits is not None:
            rate = (hits + external_hits) / queries       # external lookups follow local misses
    if rate is not None:
        s["prefix_cache_hit_rate"] = rate
        return
    if queries is not None and hits is not None:
        prompts = w.delta("prompt_tokens")
        if queries > 0:
            s["prefix_cache_hit_rate"] = hits / queries
        elif prompts:               # prompts went through and none was looked up: caching is off
            s["prefix_cache_hit_rate"] = 0.0
            w.found["prefix_queries"] = Name(w.found["prefix_queries"].metric,
                                             "no lookups while prompts ran: prefix caching is off")
        else:
            unknown["prefix_cache_hit_rate"] = "no prefix-cache lookups in the window"
        return
    for role in ("prefix_queries", "prefix_hits"):     # half a pair is not used
        w.found.pop(role, None)
    rate = w.gauge("prefix_hit_rate")
    if rate is None:
        unknown["prefix_cache_hit_rate"] = w.missing("prefix_queries" if queries is None else "prefix_hits")
    else:
        s["prefix_cache_hit_rate"] = rate[1]


def latency_summary(w: Window, s: dict, unknown: dict) -> None:
    """Mean, median and p99 of every latency histogram the server exports."""
    for role in LATENCIES:
        h = w.histogram(role)
        if h is None or h.count == 0:
            reason = (w.missing(role) if h is None else
                      f"no observations of {w.found[role].metric} in the window; widen it")
            unknown.update({f"{stat}_{role}": reason for stat in STATS})
            continue
        for stat, q in QUANTILES.items():
            s[f"{stat}_{role}"] = h.mean if q is None else h.quantile(q)
        check_sum(w, role, h)
    queue = w.histogram("queue_time")
    if queue is None or queue.count == 0:
        unknown["mean_queue_time"] = (w.missing("queue_time") if queue is None else
                                      "no queue-time observations in the window")
    else:
        s["mean_queue_time"] = queue.mean
        check_sum(w, "queue_time", queue)


def check_sum(w: Window, role: str, h) -> None:
    """A window's sum that no placing of its observations in their buckets can give comes
    from two processes: a restart the scrapes carry no timestamps to show."""
    if h.contradicts_buckets():
        w.suspect.append(role)
        w.notes.append(f"suspect window: {w.found[role].metric}'s sum over the window (mean {h.mean:.4g}) is "
                       f"outside what its buckets allow; the server probably restarted between the scrapes "
                       f"and every series grew past its old value")


def stand_in_tpot(w: Window, s: dict, unknown: dict) -> None:
    """No per-request TPOT histogram: the mean TPOT from the per-token gaps (mean with
    mean), the median and p99 unknown, and say so."""
    if "tpot" in w.found or "itl" not in w.found or "mean_itl" in unknown:
        return
    s["mean_tpot"] = s["mean_itl"]
    unknown.pop("mean_tpot", None)
    for stat in STATS[1:]:
        unknown[f"{stat}_tpot"] = (f"{w.dialect.engine} exports per-token gaps ({w.found['itl'].metric}), not "
                                   f"per-request TPOT; a {stat} of gaps is not a {stat} of TPOT")
    w.found["tpot"] = Name(f"stand-in: {w.found['itl'].metric}",
                           f"mean only: the mean gap is the token-weighted mean TPOT; {w.dialect.engine} "
                           f"exports no per-request TPOT histogram")


def window_summary(w: Window) -> tuple[dict, dict]:
    """The summary ``diagnose()`` reads, and what stayed unknown (key -> reason)."""
    s, unknown = {"duration": w.seconds}, {}
    load_summary(w, s, unknown)
    cache_summary(w, s, unknown)
    latency_summary(w, s, unknown)
    step_summary(w, s, unknown)
    stand_in_tpot(w, s, unknown)
    return s, unknown


# ---- the crossover and the diagnosis -------------------------------------------------

def crossover_of(hardware: str | None = None, model_spec: str | None = None,
                 model_dir: str | None = None, dtype: str = "fp16") -> tuple | None:
    """(crossover batch as a function of the context length, how it was found) from a GPU
    preset and a model preset or a checkpoint's ``config.json``; None when neither is given."""
    if model_spec is not None and model_dir is not None:
        raise ValueError("give --model-spec or --model-dir, not both")
    if hardware is None and model_spec is None and model_dir is None:
        return None
    if hardware is None or (model_spec is None and model_dir is None):
        raise ValueError("the crossover needs both the GPU (--hardware) and the model "
                         "(--model-spec or --model-dir)")
    hw = get_hardware(hardware)
    if model_dir is not None:
        from tinyserve.checkpoint import read_config
        spec = ModelSpec.from_config(read_config(model_dir), name=Path(model_dir).name)
    else:
        spec = lookup(MODELS, model_spec, "model spec")
    return partial(crossover_batch, hw, spec, dtype), f"{hw.name}, {spec.name} {dtype}"


def diagnose_window(w: Window, ttft_slo: float, tpot_slo: float, *, crossover=None,
                    crossover_note: str | None = None, max_num_seqs: int | None = None,
                    prefix_share: float | None = None, routing: str | None = None,
                    stat: str = "p99", url: str | None = None) -> LiveDiagnosis:
    """Summarize the window and walk the tuning order over it (``tinyserve.diagnose``);
    ``crossover`` is a batch size or a function of the context length (``crossover_of``)."""
    summary, unknown = window_summary(w)
    if crossover is None:
        unknown["crossover"] = SKIPPED_CROSSOVER
    if max_num_seqs is None:
        unknown["max_num_seqs"] = NO_MAX_NUM_SEQS
    if prefix_share is None:
        unknown["prefix_share"] = NO_PREFIX_SHARE
    d = diagnose(summary, ttft_slo, tpot_slo, crossover=crossover, max_num_seqs=max_num_seqs,
                 prefix_share=prefix_share, routing=routing, stat=stat, unknown=unknown)
    if w.identical:
        if w.before.source == w.after.source:
            d = Diagnosis("idle", "两次抓取是同一份文件：这个窗口里没有流量，无从判断"
                          "(both scrapes are the same file: no traffic in this window: nothing to judge).",
                          "give two scrapes taken --window seconds apart (隔 --window 秒各抓一次)", {}, [], unknown)
        else:
            w.notes.append("the two scrapes are identical: if they are one scrape given twice, there is "
                           "nothing to judge")
    elif w.suspect:
        d = Diagnosis("unknown", "窗口可疑：直方图的总和与它自己的桶对不上，两次抓取多半来自重启前后的两个进程"
                      "(suspect window: a histogram's sum contradicts its own buckets, so the two scrapes "
                      "probably come from before and after a restart).",
                      "scrape again, twice, --window seconds apart (重新抓两次)",
                      {f"sum outside its buckets: {', '.join(w.suspect)}": "suspect"}, [], unknown)
    if crossover is None:
        note = SKIPPED_CROSSOVER
    elif callable(crossover):
        note = (f"{crossover(0.0):.4g} with weights only, read at the window's mean context "
                f"({crossover_note or 'given'})")
    else:
        note = f"{crossover:.4g} ({crossover_note or 'given'})"
    return LiveDiagnosis(w.dialect.engine, w.seconds, w.model, {r: str(n) for r, n in w.found.items()},
                         summary, note, d, url, list(w.notes))


def check_window(window) -> None:
    if not isinstance(window, (int, float)) or isinstance(window, bool) or not 0 < window < math.inf:
        raise ValueError(f"window (--window) must be a positive number of seconds, got {window!r}")


def diagnose_files(before, after, seconds: float, model: str | None = None, **knobs) -> LiveDiagnosis:
    """Two scrapes saved to files (``tinyserve diagnose --once FILE1 FILE2``)."""
    check_window(seconds)
    return diagnose_window(Window(read_scrape(before), read_scrape(after), seconds, model), **knobs)


def diagnose_url(url: str, window: float = 60.0, *, model: str | None = None, timeout: float = 10.0,
                 **knobs) -> LiveDiagnosis:
    """Scrape ``url``'s ``/metrics``, wait ``window`` seconds, scrape again, diagnose."""
    check_window(window)
    def timed_fetch():          # the scrape and the middle of the time it took
        before = time.monotonic()
        scrape = fetch_metrics(url, timeout)
        return scrape, (before + time.monotonic()) / 2

    first, start = timed_fetch()
    time.sleep(window)
    second, end = timed_fetch()
    return diagnose_window(Window(first, second, end - start, model), url=url, **knobs)


def diagnose_under_load(url: str, specs, window: float, warm: float = 1.0, **kwargs) -> LiveDiagnosis:
    """Send ``specs`` to ``url`` open-loop (``tinyserve.serving.client.run_benchmark``) on
    a thread; ``warm`` seconds in, ``diagnose_url`` a ``window`` of it; then hang up, so
    that the server aborts the backlog instead of draining it (notebook 08, the tests)."""
    loop = asyncio.new_event_loop()
    load = loop.create_task(run_benchmark(url, specs, progress=False))

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(asyncio.wait([load]))
        left = asyncio.all_tasks(loop)          # the requests still streaming
        for task in left:
            task.cancel()
        if left:
            loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))

    thread = threading.Thread(target=run, name="tinyserve-load", daemon=True)
    thread.start()
    try:
        time.sleep(warm)
        return diagnose_url(url, window, **kwargs)
    finally:
        loop.call_soon_threadsafe(load.cancel)
        thread.join()
        loop.close()
