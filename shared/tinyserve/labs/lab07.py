"""Checks for lab 07, the capstone (see solutions/lab07_capstone_tuning.ipynb).

The student gets a "mystery" deployment: a workload and the engine knobs it
runs with today (``capstone_problem()``). It misses its TTFT/TPOT SLOs badly.
They diagnose it in the chapter's order (``tinyserve.metrics.diagnose``) and
return a dict of engine knobs; ``check_capstone(config)`` simulates the same
workload with it and grades the goodput against a target.

Constraints (the budget a real team would have): one A100, the 7B model in
fp16 (quantization is not signed off), engine knobs only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tinyserve.hardware import A100_SXM_80GB, LLAMA_7B, crossover_batch
from tinyserve.labs.hints import fail
from tinyserve.diagnose import diagnose
from tinyserve.sim import simulate
from tinyserve.workload import RequestSpec, make_workload

__all__ = ["capstone_problem", "check_capstone", "run_capstone"]

TTFT_SLO = 0.5           # seconds
TPOT_SLO = 0.025         # seconds per output token (40 tokens/s)
# Requests meeting both SLOs per second. The reference tuning (solutions/lab07_*)
# reaches about 18.8 on seed 0; the target leaves ~10% of slack for other good answers.
TARGET_GOODPUT = 17.0

# The knobs a student may set, and what the budget allows.
ALLOWED = {
    "max_num_seqs": "int >= 1",
    "max_num_batched_tokens": "int >= 1",
    "enable_chunked_prefill": "bool",
    "enable_prefix_caching": "bool",
    "policy": "'fcfs' | 'sjf' | 'priority' | 'bucket' | 'decode-first' | 'prefill-first'",
    "dtype": "'fp16' only (quantization is not signed off)",
}

BASELINE = {"max_num_seqs": 8, "max_num_batched_tokens": 4096, "enable_chunked_prefill": False,
            "enable_prefix_caching": False, "policy": "fcfs", "dtype": "fp16"}


@dataclass
class CapstoneProblem:
    """The mystery deployment: what arrives, and how the engine is configured today."""
    specs: list[RequestSpec]
    baseline: dict
    ttft_slo: float = TTFT_SLO
    tpot_slo: float = TPOT_SLO
    target_goodput: float = TARGET_GOODPUT
    hardware: str = "A100_SXM_80GB"
    model: str = "LLAMA_7B"
    allowed: dict = field(default_factory=lambda: dict(ALLOWED))

    @property
    def prefix_share(self) -> float:
        """Share of prompt tokens that are a prefix shared with other requests."""
        return sum(s.prefix_len for s in self.specs) / sum(s.prompt_len for s in self.specs)


def capstone_problem(seed: int = 0) -> CapstoneProblem:
    """The mystery workload (reproducible from ``seed``) and today's configuration.

    A chat assistant with a few long system prompts, plus long documents to
    summarise and some long generations, ~24 requests/s for ~18 s.
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an int, got {seed!r}")
    chat = make_workload("shared-prefix", 360, rate=24, seed=seed, num_prefix_groups=8, prefix_len=768)
    docs = make_workload("long-in-short-out", 30, rate=2, seed=seed + 1, length_scale=1.5)
    gens = make_workload("short-in-long-out", 60, rate=4, seed=seed + 2)
    specs = sorted(chat + docs + gens, key=lambda s: s.arrival)
    return CapstoneProblem(specs, dict(BASELINE))


def _validate(config) -> dict:
    if not isinstance(config, dict):
        fail(f"config 应该是一个 dict（旋钮名 → 值），你给的是 {type(config).__name__}。",
             f"config must be a dict (knob name -> value), got {type(config).__name__}.")
    unknown = sorted(set(config) - set(ALLOWED))
    if unknown:
        extra_zh = "；预算只有一张卡，不能加副本" if {"num_replicas", "routing"} & set(unknown) else ""
        extra_en = "; the budget is one GPU, no replicas" if {"num_replicas", "routing"} & set(unknown) else ""
        fail(f"不认识的旋钮 {unknown}{extra_zh}。能调的只有：{sorted(ALLOWED)}。",
             f"unknown knobs {unknown}{extra_en}. You may set only: {sorted(ALLOWED)}.")
    if config.get("dtype", "fp16") != "fp16":
        fail("这次不许量化：质量团队还没有验收 INT8，而且按章节的顺序，模型层面的手段排在最后。"
             "先把批、分块和缓存调好。",
             "quantization is off the table: INT8 is not signed off, and in the chapter's order "
             "model-level levers come last. Tune the batch, chunking and cache first.")
    for key in ("max_num_seqs", "max_num_batched_tokens"):
        if key in config and (not isinstance(config[key], int) or isinstance(config[key], bool)
                              or config[key] < 1):
            fail(f"{key} 必须是 >= 1 的整数，你给的是 {config[key]!r}。",
                 f"{key} must be an integer >= 1, got {config[key]!r}.")
    for key in ("enable_chunked_prefill", "enable_prefix_caching"):
        if key in config and not isinstance(config[key], bool):
            fail(f"{key} 必须是 True 或 False，你给的是 {config[key]!r}。",
                 f"{key} must be True or False, got {config[key]!r}.")
    return dict(BASELINE) | dict(config)


def run_capstone(config: dict, problem: CapstoneProblem | None = None) -> dict:
    """Simulate the mystery workload with ``config`` (missing knobs keep today's values)
    and return its summary under the lab's SLOs."""
    problem = problem or capstone_problem()
    knobs = _validate(config)
    try:
        result = simulate(problem.specs, problem.hardware, problem.model, **knobs)
    except ValueError as e:
        unchunked = not knobs["enable_chunked_prefill"]
        fail(f"模拟器拒绝了这个配置：{e}" + ("。不分块时，token 预算必须装得下最长的请求" if unchunked else ""),
             f"the simulator rejected this config: {e}"
             + (". Without chunking the token budget must hold the longest request" if unchunked else ""))
    return result.summary(ttft_slo=problem.ttft_slo, tpot_slo=problem.tpot_slo)


def _row(name: str, s: dict | None, target: float | None = None) -> str:
    if s is None:
        return f"{name:<22}{target:>10.2f}"
    return (f"{name:<22}{s['goodput']:>10.2f}{s['slo_attainment']:>9.0%}{s['p99_ttft']:>11.3f}"
            f"{s['p99_tpot'] * 1e3:>12.1f}{s['prefix_cache_hit_rate']:>9.2f}{s['mean_batch_size']:>8.1f}")


def check_capstone(config: dict, seed: int = 0) -> dict:
    """Grade a tuned config: goodput on the mystery workload must reach the target.

    Prints a score table (baseline, yours, target) and a ``score:`` line that
    ``make grade`` picks up; raises ``AssertionError`` with the next step of the
    tuning order when the goodput falls short. Returns your run's summary.
    """
    problem = capstone_problem(seed)
    baseline = run_capstone(problem.baseline, problem)
    yours = run_capstone(config, problem)
    print(f"{'run':<22}{'goodput/s':>10}{'SLO met':>9}{'p99 TTFT s':>11}{'p99 TPOT ms':>12}"
          f"{'hit rate':>9}{'batch':>8}")
    print(_row("baseline (mystery)", baseline))
    print(_row("your config", yours))
    print(_row("target", None, problem.target_goodput))
    passed = yours["goodput"] >= problem.target_goodput
    print(f"score: goodput {yours['goodput']:.2f} req/s (target {problem.target_goodput:.2f}, "
          f"baseline {baseline['goodput']:.2f}) {'PASS' if passed else 'FAIL'}")
    if not passed:
        knobs = _validate(config)
        d = diagnose(yours, problem.ttft_slo, problem.tpot_slo,
                     crossover=crossover_batch(A100_SXM_80GB, LLAMA_7B, "fp16"),
                     max_num_seqs=knobs["max_num_seqs"], prefix_share=problem.prefix_share)
        fail(f"有效吞吐 {yours['goodput']:.2f} 请求/秒，还没到目标 {problem.target_goodput:.2f}。"
             f"按顺序看，你的配置现在卡在「{d.stage}」这一层：{d.finding} 建议：{d.action}。"
             f"一次只改一个旋钮，先预测指标会怎样动，再跑一次。",
             f"goodput {yours['goodput']:.2f} req/s is below the target {problem.target_goodput:.2f}. "
             f"In the tuning order your config now stops at '{d.stage}'. Suggested: {d.action}. "
             f"Change one knob at a time, predict how the numbers move, then rerun.")
    print("✓ 达标：按判断顺序调好了批、分块和缓存 / target met: batch, chunking and cache are tuned in order")
    return yours
