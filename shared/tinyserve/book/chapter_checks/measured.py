"""The chapter's claims timed on this CPU.

Real engine runs, or a weight stack and tensors bigger than the last-level cache (the
stack twice it, each tensor at least it), with warm-up, one fixed torch thread (on a
shared CPU a second thread waits at every barrier for a core another program holds) and
interleaved pairs or rounds (``tinyserve.measure``). Each check passes ``measure``, so
that strict mode decides it by two of three equal, independent attempts
(``tinyserve.book.claims``); its band is what the physics allows around the prediction,
wide enough for the spread of attempts on a busy 2-core machine.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import statistics
import time
from importlib import resources
from typing import Callable

import torch

from tinyserve import LLM, SamplingParams
from tinyserve import host
from tinyserve.bench.crossover import GemmStack, fastest_packed, layer_shapes
from tinyserve.book import claims
from tinyserve.book.chapter_checks.common import BUSY, all_of, each_within, one_thread, say, timed
from tinyserve.engine import LLMEngine
from tinyserve.metrics import summarize
from tinyserve.model import LlamaForServing, ModelConfig
from tinyserve.packed_gemm import prepacked_linear
from tinyserve.scheduler import SchedulerConfig
from tinyserve.sim import simulate
from tinyserve.tokenizer import load_default_tokenizer
from tinyserve.workload import RequestSpec


# --------------------------------------------------------------------------- C02, C10: a weight stack


@functools.lru_cache(maxsize=1)
def _stack() -> GemmStack:
    """Llama-shaped fp32 layers, at least 256 MiB and twice this CPU's last-level cache (made once)."""
    want = max(256 * 2**20, 2 * (host.l3_cache_bytes() or 0))
    layer = 4 * sum(i * o for i, o in layer_shapes(1024))                 # bytes of one fp32 layer
    return GemmStack(1024, math.ceil(want / layer))


def _compute_only(stack: GemmStack, rows: int) -> Callable:
    """The arithmetic of a step of ``rows`` requests without its weight read: as many
    ``[rows, 1024] x [1024, 1024]`` matmuls as the stack has parameters, on one weight that
    stays in cache. A thin matmul runs far below a square one's peak, the more so on a busy CPU,
    so this is the compute ceiling of this shape, timed in the same rounds as the steps."""
    weight, x = torch.full((1024, 1024), 1 / 32), torch.ones(rows, 1024)
    layer = prepacked_linear(weight, rows) or (lambda x: torch.mm(x, weight.t()))
    calls = round(stack.num_parameters / weight.numel())
    return lambda: [layer(x) for _ in range(calls)]


def _rounds(fns: dict, rounds: int) -> list[dict]:
    """Seconds of each function in every round, the order reversed each round (after a warm-up),
    so that a busy moment of the machine slows a whole round rather than one function."""
    names = list(fns)
    for fn in fns.values():
        fn()
    times = []
    for r in range(rounds):
        times.append({})
        for name in names if r % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            fns[name]()
            times[-1][name] = time.perf_counter() - start
    return times


def _step_model(times: dict, b: int) -> float:
    """read + compute on a CPU: t(B) = t(1) + (B - 1) / B x compute(B), from one round's timings."""
    return times[1] + (b - 1) / b * times[f"compute {b}"]


@one_thread
def c02():
    """Batching amortises the weight read: 8 requests one by one vs in one batch (weights > L3)."""
    stack, batch = _stack(), 8
    single, together = stack.step_fn(1), stack.step_fn(batch, prepack=True)   # packed once, as compiled
    fns = {"one by one": lambda: [single() for _ in range(batch)], batch: together, 1: single,
           f"compute {batch}": _compute_only(stack, batch)}

    def remeasure(attempt):
        rounds = _rounds(fns, 5)
        measured = statistics.median(t["one by one"] / t[batch] for t in rounds)
        predicted = statistics.median(batch * t[1] / _step_model(t, batch) for t in rounds)
        med = {k: 1e3 * statistics.median(t[k] for t in rounds) for k in fns}
        say(f"{stack.weight_bytes >> 20} MiB of weights: one request {med[1]:.1f} ms, {batch} one by one "
             f"{med['one by one']:.0f} ms, batched {med[batch]:.1f} ms, the batch's arithmetic alone "
             f"{med[f'compute {batch}']:.1f} ms")
        return measured, predicted

    return timed("C02", "一批共享一次权重读取：8 条请求合批比逐条快，快多少由“读一次 + 各算各的”预测",
                  remeasure, claims.ratio_between(0.5, 2.0), BUSY + "；或 L3 大到装下了整个权重栈")


@one_thread
def c10():
    """Step time vs batch on a weight stack > L3: below the crossover and past it."""
    stack = _stack()
    single = stack.step_fn(1)
    probe = _rounds({1: single, 16: _compute_only(stack, 16)}, 3)
    b_star = statistics.median(16 * t[1] / t[16] for t in probe)       # a weight read / one request's math
    lo, hi = max(2, round(b_star / 4)), min(128, max(4, round(2 * b_star)))
    # Each batch through the faster packed GEMM on this CPU (MKL's on an Intel Xeon, oneDNN's on an AMD EPYC).
    fns = {1: single} | {b: fastest_packed(stack, b)[1] for b in (lo, hi, 2 * hi)}
    fns |= {f"compute {b}": _compute_only(stack, b) for b in (lo, hi, 2 * hi)}

    def remeasure(attempt):
        rounds = _rounds(fns, 5)
        measured = tuple(statistics.median(t[a] / t[b] for t in rounds) for a, b in ((lo, 1), (2 * hi, hi)))
        predicted = (statistics.median(_step_model(t, lo) / t[1] for t in rounds),
                     statistics.median(_step_model(t, 2 * hi) / _step_model(t, hi) for t in rounds))
        say(f"crossover B* = {b_star:.1f} (a weight read / one request's arithmetic): t({lo})/t(1) "
             f"{measured[0]:.2f}x, t({2 * hi})/t({hi}) {measured[1]:.2f}x")
        return measured, predicted

    return timed("C10", "交叉点以内批开大几倍只多一点时间，越过以后一步的时间随批近乎线性上涨",
                  remeasure, each_within(0.75, 1.33),
                  BUSY + "；上面打印的交叉点 B* 若只有几，CPU 上“交叉点以内”几乎没有空间（04 的“本书说/这里测到”）")


# --------------------------------------------------------------------------- C03: seats


@dataclasses.dataclass(frozen=True)
class _LinearCost:
    """A step cost ``a + b x tokens`` measured on this CPU, for the simulator's clock."""
    a: float
    b: float
    name: str = "fitted line"

    def step_time(self, hardware, model, dtype, step) -> float:
        return self.a + self.b * step.tokens


MIX = [([(7 * i + 3 * j) % 2000 + 10 for j in range(16)], n) for i, n in enumerate([32] * 4 + [4] * 12)]


def _run_mix(seats: int) -> tuple[float, float]:
    """Output tokens/s and mean TPOT of 4 long requests, then 12 short ones, on a fresh ``small`` engine
    (packed weights, as the probe's: the default decides by a timing at start, a sample of the moment)."""
    llm = LLM("small", seed=0, max_num_seqs=seats, max_num_batched_tokens=512, max_model_len=128, device="cpu",
              enforce_eager=False)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    outs = llm.generate([p for p, _ in MIX], [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in MIX])
    s = summarize([o.metrics for o in outs])
    return s["output_throughput"], s["mean_tpot"]


def _decode_step(llm: LLM, batch: int, steps: int = 6) -> float:
    """Median seconds of a pure decode step with ``batch`` requests."""
    eng = llm.engine
    for i in range(batch):
        eng.add_request([(31 * i + j) % 2000 + 10 for j in range(4)],
                        SamplingParams(max_tokens=steps + 1, ignore_eos=True))
    first = eng.core.num_steps
    while eng.has_unfinished_requests():
        eng.step()
    return statistics.median(s.duration for s in eng.core.steps_since(first)
                             if s.num_decode_tokens == batch and not s.num_prefill_tokens)


@one_thread
def c03():
    """More seats: higher throughput and a slower TPOT (real engine on this CPU vs its scheduler on a fitted line)."""
    def remeasure(attempt):
        probe = LLM("small", seed=0, max_num_seqs=16, max_model_len=128, device="cpu", enforce_eager=False)
        _decode_step(probe, 4, 2)
        t1, t16 = _decode_step(probe, 1), _decode_step(probe, 16)
        per_token = max(0.0, (t16 - t1) / 15)
        cost = _LinearCost(t1 - per_token, per_token)
        specs = [RequestSpec(0.0, len(p), n) for p, n in MIX]
        pred = {s: simulate(specs, cost_model=cost, max_num_seqs=s, num_kv_blocks=256,
                            max_num_batched_tokens=512).summary() for s in (1, 16)}
        runs = [(_run_mix(1), _run_mix(16)) for _ in range(2)]   # the two in turn
        measured = tuple(statistics.median(b[i] / a[i] for a, b in runs) for i in (0, 1))
        predicted = tuple(pred[16][k] / pred[1][k] for k in ("output_throughput", "mean_tpot"))
        say(f"1 -> 16 seats: throughput x{measured[0]:.2f} (predicted x{predicted[0]:.2f}), "
             f"TPOT x{measured[1]:.2f} (predicted x{predicted[1]:.2f})")
        return measured, predicted

    return timed("C03", "座位从 1 开到 16：吞吐上去了，每个人的出字（TPOT）都变慢", remeasure,
                  all_of("both > 1, each measured/predicted in [0.7, 1.4]",
                       lambda m, p: min(m) > 1 and each_within(0.7, 1.4)(m, p)))



# --------------------------------------------------------------------------- C06, C07: fusion


def _tensors(count: int) -> list[torch.Tensor]:
    """``count`` fp32 tensors of max(64 MiB, this CPU's L3) each (filled, so every page is mapped)."""
    numel = max(64 * 2**20, host.l3_cache_bytes() or 0) // 4
    return [torch.full((numel // 4096, 4096), 1.0 + 0.25 * i) for i in range(count)]


def _unfused_chain(x, y, z, t1, t2, out):
    """out = y + 0.5 * x * z, one kernel per operation: t1 and t2 go to memory and come back."""
    torch.mul(x, z, out=t1)
    torch.mul(t1, 0.5, out=t2)
    torch.add(y, t2, out=out)


def _fused_chain(x, y, z, t1, t2, out):
    """The same in one kernel: read x, y and z once, write out once."""
    torch.addcmul(y, x, z, value=0.5, out=out)


CHAIN_BYTES = {"unfused": (2 + 1) + (1 + 1) + (2 + 1), "fused": 3 + 1}   # tensors read + written


@one_thread
def c06():
    """Fused vs unfused elementwise chain on tensors > L3: speed-up predicted by the bytes."""
    args = _tensors(6)
    _unfused_chain(*args)
    want = args[5].clone()
    _fused_chain(*args)
    torch.testing.assert_close(args[5], want)
    predicted = CHAIN_BYTES["unfused"] / CHAIN_BYTES["fused"]

    def remeasure(attempt):
        pair = host.paired_ratio(lambda: _unfused_chain(*args), lambda: _fused_chain(*args), pairs=7)
        say(f"{args[0].nbytes >> 20} MiB tensors: unfused / fused {pair}; bytes "
             f"{CHAIN_BYTES['unfused']} vs {CHAIN_BYTES['fused']} tensors -> {predicted:.2f}x")
        return pair.median, predicted

    return timed("C06", "中间结果写回再读出浪费带宽：融合的加速比约等于少搬的字节之比", remeasure,
                  claims.ratio_between(0.75, 1.33), BUSY + "；或这台 CPU 上写内存比读贵得多")


@one_thread
def c07():
    """The same fusion followed by a compute-bound GEMM: the saving is the bytes, not the FLOPs."""
    *args, out = _tensors(6)
    gemm_n = 128                                                          # compute-bound on a CPU
    proj, dst = torch.full((4096, gemm_n), 1 / 64), torch.empty(out.shape[0], gemm_n)
    gemm = lambda: torch.mm(out, proj, out=dst)
    src, sink = torch.ones(out.numel()), torch.zeros(out.numel())

    def remeasure(attempt):
        bw = 2 * src.nbytes / host.median_time(lambda: sink.copy_(src), repeats=3)
        t_gemm = host.median_time(gemm, repeats=3)
        t = {v: n * out.nbytes / bw for v, n in CHAIN_BYTES.items()}      # roofline: bytes / bandwidth
        predicted = (t["unfused"] + t_gemm) / (t["fused"] + t_gemm)
        pair = host.paired_ratio(lambda: (_unfused_chain(*args, out), gemm()),
                                    lambda: (_fused_chain(*args, out), gemm()), pairs=5)
        flops, moved = 2 * out.numel() * gemm_n, (CHAIN_BYTES["fused"] + 1) * out.nbytes
        say(f"+ GEMM to {gemm_n} ({flops / t_gemm / 1e9:.0f} GFLOP/s; {flops / moved:.0f} FLOP/byte vs ridge "
             f"{flops / t_gemm / bw:.0f}): chain unfused / fused {pair}, predicted {predicted:.2f}x "
             f"(alone {t['unfused'] / t['fused']:.2f}x)")
        return pair.median, predicted

    return timed("C07", "后面接上算力受限的矩阵乘，融合只省那几份字节的时间：加速比缩到屋顶线预测的大小",
                  remeasure, claims.ratio_between(0.8, 1.25))


# --------------------------------------------------------------------------- C11, C15: the stages


@one_thread
def c11():
    """Share of the engine thread spent tokenizing 1 vs 32 new texts, with an engine faster than its tokenizer."""
    tok = load_default_tokenizer()
    micro = ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024)
    eng = LLMEngine(LlamaForServing.from_seed(micro, 0), tok,
                    SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=8192, max_model_len=1024), 512)
    corpus = resources.files("tinyserve").joinpath("data/corpus/zh.txt").read_text(encoding="utf-8")
    texts = itertools.cycle([corpus[i:i + 150] for i in range(0, len(corpus) - 150, 150)])  # cache cleared

    def feed(prompts) -> tuple[float, float]:
        start = time.perf_counter()
        reqs = [eng.requests[eng.add_request(p, SamplingParams(max_tokens=1))] for p in prompts]
        while eng.has_unfinished_requests():
            eng.step()
        return time.perf_counter() - start, sum(r.tokenize_time for r in reqs)

    def share(k: int, batches: int) -> tuple[float, float]:
        """Tokenizing's share of ``batches`` batches of ``k`` new texts, and its prediction from the
        tokenizer and the engine timed apart with nothing overlapping: t_tok / (t_tok + t_eng)."""
        t_tok = t_eng = total = inside = 0.0
        for _ in range(batches):
            batch = [next(texts) for _ in range(k)]
            tok.clear_cache()
            start = time.perf_counter()
            ids = [tok.encode(t) for t in batch]
            t_tok, t_eng = t_tok + time.perf_counter() - start, t_eng + feed(ids)[0]
            tok.clear_cache()
            total, inside = (a + b for a, b in zip((total, inside), feed(batch)))
        return inside / total, t_tok / (t_tok + t_eng)

    def remeasure(attempt):
        (m1, p1), (m32, p32) = share(1, 16), share(32, 1)
        say(f"engine thread tokenizing: {m1:.0%} of the time for 1 text at a time, {m32:.0%} for 32 "
             f"(predicted from the tokenizer and the engine timed apart: {p1:.0%}, {p32:.0%})")
        return (m1, m32), (p1, p32)

    feed(["热身"] * 32)
    return timed("C11", "分词在引擎线程上串行：并发越高它占的时间越多，32 条并发时引擎大半时间在等分词",
                  remeasure, all_of("32 > 1 text, 32 texts >= 50%, each measured/predicted in [0.7, 1.4]",
                                  lambda m, p: m[1] > m[0] and m[1] >= 0.5 and each_within(0.7, 1.4)(m, p)),
                  BUSY + "；这台机器的分词若比微型引擎快得多，分词就还不是瓶颈")


class _SlowTokenizer:
    """A tokenizer that stalls ``seconds`` on every encode."""

    def __init__(self, tokenizer, seconds: float):
        self._tokenizer, self._seconds = tokenizer, seconds

    def encode(self, *args, **kwargs):
        time.sleep(self._seconds)
        return self._tokenizer.encode(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


@one_thread
def c15():
    """A 150 ms stall in the tokenizer or in the model: the user sees it in e2e, the stage timers say where."""
    stall, tokens = 0.15, 2                   # a short request: little else in e2e for a busy CPU to stretch
    llm = LLM("tiny", seed=0)
    eng, tok, slow = llm.engine, llm.tokenizer, {"model": False}
    llm.model.register_forward_pre_hook(lambda module, args: time.sleep(stall / tokens) if slow["model"] else None)

    def trip(where: str) -> tuple[float, float, float]:
        eng.tokenizer, slow["model"] = _SlowTokenizer(tok, stall) if where == "tokenizer" else tok, where == "model"
        eng.step_stats.clear()
        eng.add_request("一次请求走进引擎", SamplingParams(max_tokens=tokens, ignore_eos=True))
        while eng.has_unfinished_requests():
            for out in eng.step():
                m = out.metrics
        return m.e2e, m.tokenize_time, sum(s.duration for s in eng.step_stats)

    def remeasure(attempt):
        trips = [{w: trip(w) for w in ("none", "tokenizer", "model")} for _ in range(3)]
        delta = lambda w, i: statistics.median(t[w][i] - t["none"][i] for t in trips)
        measured = (delta("tokenizer", 0) / stall, delta("tokenizer", 1) / delta("tokenizer", 0),
                    delta("model", 0) / stall, delta("model", 2) / delta("model", 0))
        say(f"e2e grows by {delta('tokenizer', 0) * 1e3:.0f} ms (tokenizer stall) and "
             f"{delta('model', 0) * 1e3:.0f} ms (model stall); the tokenize timer holds "
             f"{measured[1]:.0%} of the first, the step timers {measured[3]:.0%} of the second")
        return measured, (1.0,) * 4

    trip("none")
    return timed("C15", "任何一站卡住，用户看到的都是端到端变慢；分段计时才知道卡在哪一站",
                  remeasure, each_within(0.75, 1.33))


