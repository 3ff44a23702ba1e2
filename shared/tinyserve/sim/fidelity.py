"""The simulator against real engines: published vLLM measurements, replayed.

``data/published_vllm.json`` holds measurements of vLLM serving 0.6B to 14B models
on one GPU, each with its source, what the source states, the workload (lengths,
concurrency or rate), how the requests came in (``"client"``: ``"http"`` through
``vllm serve``, or ``"offline"`` through ``LLM.generate``) and the scheduler knobs
vLLM ran with. ``predict`` puts one through ``simulate`` with a cost model and
returns the same metrics (a source that had just run the same prompts on the same
server, ``"warm_prefix_cache"``, is simulated after a first run of them that fills
the prefix cache); ``compare`` does it for all of them, and ``fit``
calibrates an ``EngineCostModel`` on the ``"calibration"`` points, so the
``"held-out"`` ones test it on measurements it never saw. The split is by
source: no source has points on both sides (``splits_by_source`` checks it).

A measurement names its GPU and model by preset (``tinyserve.hardware``) or, for
one the presets lack, spells the spec out (a ``HardwareSpec`` or ``ModelSpec``'s
fields, with its ``source``).

    from tinyserve.sim.fidelity import compare
    for row in compare(): print(row.id, row.metric, row.measured, row.predicted)
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Sequence

import numpy as np

from tinyserve.hardware import MODELS, HardwareSpec, ModelSpec, get_hardware, lookup
from tinyserve.sim.cost_model import EngineCostModel, get_cost_model
from tinyserve.sim.simulator import simulate
from tinyserve.workload import RequestSpec, arrival_times

# How fast the engine turns out tokens, as a rate or as a time per token or request.
SPEED_METRICS = ("output_throughput", "request_throughput", "mean_tpot", "mean_e2e")
LATENCY_METRICS = ("mean_tpot", "mean_e2e")          # speeds given as times: inverted for speed_error
TTFT_METRICS = ("mean_ttft", "median_ttft")
# The metrics fit() matches. TTFT is in: the front end (frontend_time) is what a
# client's TTFT holds beyond the engine's own queue and prefill.
FIT_METRICS = SPEED_METRICS + TTFT_METRICS
# The EngineCostModel fields that fit() adjusts (gemm_tokens_exponent stays 0: no
# published source here separates it from gemm_efficiency; a live sweep fits it too,
# LIVE_FITTED).
FITTED = ("step_overhead", "seq_overhead", "weight_efficiency", "kv_efficiency",
          "gemm_efficiency", "interference", "frontend_time", "frontend_latency")
# A live vLLM sweep on a CPU spans steps of 1 to 2048 tokens, all compute-bound beyond ~10
# (the CPU's ridge point), so it shows how GEMM efficiency grows with the tokens in a step.
LIVE_FITTED = FITTED + ("gemm_tokens_exponent",)


@cache
def published() -> dict:
    """The data file: ``{"sources": {...}, "measurements": [...]}``."""
    text = resources.files("tinyserve").joinpath("data/published_vllm.json").read_text()
    return json.loads(text)


def source_in_goal(name: str) -> bool:
    """Whether a source's points count toward ``BOUNDS``: all but those marked
    ``"in_goal": false`` (which say why, in ``"why_not_in_goal"``)."""
    return published()["sources"][name].get("in_goal", True)


def in_goal(measurement: dict) -> bool:
    """Whether a measurement counts toward ``BOUNDS``: a vLLM V1-era point (no
    ``"engine_generation"``) of a source in the goal (``source_in_goal``). The others
    are predicted and printed all the same."""
    return measurement.get("engine_generation") is None and source_in_goal(measurement["source"])


def measurements(split: str | None = None) -> list[dict]:
    """All measurements, or those of one split (``"calibration"``, ``"held-out"``)."""
    rows = published()["measurements"]
    if split is not None and split not in {m["split"] for m in rows}:
        raise ValueError(f"split: unknown split {split!r}; choose one of {sorted({m['split'] for m in rows})}")
    return [m for m in rows if split is None or m["split"] == split]


def hardware_of(measurement: dict) -> HardwareSpec:
    """The measurement's GPU: a preset name, or a spec spelled out in the data file."""
    hw = measurement["hardware"]
    return get_hardware(hw) if isinstance(hw, str) else HardwareSpec(**hw)


def model_of(measurement: dict) -> ModelSpec:
    """The measurement's model: a preset name, or a spec spelled out in the data file."""
    model = measurement["model"]
    if isinstance(model, str):
        return lookup(MODELS, model, "model")
    return ModelSpec(**{k: v for k, v in model.items() if k != "source"})


def python_random_lengths(seed: int, num_seqs: int, input_range: Sequence[int],
                          output_range: Sequence[int], token_id_max: int) -> tuple[list[int], list[int]]:
    """Prompt and output lengths as nano-vllm's ``bench.py`` draws them with Python's
    ``random``: per prompt a length, then that many token ids (which advance the
    generator too); then every output length."""
    rng = random.Random(seed)
    inputs = []
    for _ in range(num_seqs):
        n = rng.randint(*input_range)
        for _ in range(n):
            rng.randint(0, token_id_max)
        inputs.append(n)
    outputs = [rng.randint(*output_range) for _ in range(num_seqs)]
    return inputs, outputs


def workload(measurement: dict) -> list[RequestSpec]:
    """The requests of a measurement: queued at t=0 (rate inf, or an offline batch),
    or Poisson arrivals at ``request_rate`` (seeded here: the source's own arrival
    times are not published).

    A recorded trace is replayed as is; seeded random lengths are drawn again
    exactly (``seeded_lengths``); a source that printed only its totals borrows
    the shape of another measurement's recorded trace (``lengths_like``: cycled
    to its number of prompts and scaled to its totals); fixed lengths are
    repeated; outputs that stopped early at EOS (only their mean is known) are
    spread evenly between ``2 x mean - max`` and ``max``, so the mean is the
    source's and the requests do not all finish in the same step.
    """
    w = measurement["workload"]
    if "lengths_like" in w:
        inputs, outputs = lengths_like(**w["lengths_like"])
    elif "seeded_lengths" in w:
        g = w["seeded_lengths"]
        inputs, outputs = python_random_lengths(g["seed"], g["num_seqs"], g["input_range"],
                                                g["output_range"], g["token_id_max"])
    elif "input_lens" in w:
        inputs, outputs = w["input_lens"], [max(1, o) for o in w["output_lens"]]
    else:
        n = w["num_prompts"]
        if "output_len" in w:
            outputs = [w["output_len"]] * n
        else:
            high, mean = w["max_output_len"], w["mean_output_len"]
            low = 2 * mean - high
            outputs = [low + (i * 37) % (high - low + 1) for i in range(n)]   # a fixed permutation
        inputs = [w["input_len"]] * n
    rate = w.get("request_rate", math.inf)
    arrivals = arrival_times(len(inputs), rate, 1.0, np.random.default_rng(w.get("arrival_seed", 0)))
    return [RequestSpec(float(t), n, o) for t, n, o in zip(arrivals, inputs, outputs)]


def lengths_like(measurement: str, num_prompts: int, input_tokens: int,
                 output_tokens: int) -> tuple[list[int], list[int]]:
    """``measurement``'s recorded lengths, cycled to ``num_prompts`` and each list scaled
    so that it sums to about the given totals (every length at least 1)."""
    trace = next(m for m in measurements() if m["id"] == measurement)["workload"]
    n = len(trace["input_lens"])

    def scaled(lengths, total):
        cycled = [max(1, lengths[i % n]) for i in range(num_prompts)]
        return [max(1, round(x * total / sum(cycled))) for x in cycled]
    return scaled(trace["input_lens"], input_tokens), scaled(trace["output_lens"], output_tokens)


def splits_by_source(rows: Sequence[dict] | None = None) -> dict[str, str]:
    """Each source's split; a ValueError if a source has points in both."""
    out: dict[str, str] = {}
    for m in measurements() if rows is None else rows:
        if out.setdefault(m["source"], m["split"]) != m["split"]:
            raise ValueError(f"source {m['source']!r} has points in both splits")
    return out


def engine_knobs(measurement: dict) -> dict:
    """The scheduler knobs vLLM ran with, as ``simulate`` keywords."""
    knobs = {k: v for k, v in measurement["engine"].items() if k != "why"}
    knobs.setdefault("max_model_len", 32768)
    return knobs


def predict(measurement: dict, cost_model="roofline", extra: Sequence[str] = ()) -> dict[str, float]:
    """The measurement's metrics (and the summary keys in ``extra``) as the simulator
    predicts them with ``cost_model``. Requests that came over HTTP go through the
    cost model's front end (``frontend_time``; the roofline has none)."""
    model = get_cost_model(cost_model)
    http = measurement["client"] == "http"
    frontend = {name: getattr(model, name, 0.0) if http else 0.0
                for name in ("frontend_time", "frontend_latency")}
    specs = workload(measurement)
    warm = measurement["workload"].get("warm_prefix_cache", False)
    result = simulate(specs, hardware_of(measurement), model_of(measurement),
                      measurement["dtype"], max_concurrency=measurement["workload"].get("max_concurrency"),
                      cost_model=model, warmup=specs if warm else (), **frontend, **engine_knobs(measurement))
    summary = result.summary()
    return {metric: summary[metric] for metric in (*measurement["measured"], *extra)}


@dataclass(frozen=True)
class Comparison:
    id: str
    source: str
    split: str
    metric: str
    measured: float
    predicted: dict[str, float]          # cost model name -> prediction
    # cost model name -> the summary keys ``compare`` was asked for, from the same run
    extra: dict[str, dict[str, float]] = field(default_factory=dict)

    def error(self, cost_model: str) -> float:
        """predicted / measured - 1."""
        return self.predicted[cost_model] / self.measured - 1

    def speed_error(self, cost_model: str) -> float:
        """Predicted / measured speed - 1: a throughput as it is, a latency (e2e, TPOT)
        inverted, so that > 0 always means "predicted too fast". TTFT stays a time."""
        if self.metric in LATENCY_METRICS:
            return self.measured / self.predicted[cost_model] - 1
        return self.error(cost_model)


# How each metric is judged: its kind, and the bound the issue sets on held-out points.
METRIC_KINDS = {"output_throughput": "throughput", "request_throughput": "throughput",
                "mean_e2e": "throughput", "mean_tpot": "tpot",
                "mean_ttft": "ttft", "median_ttft": "ttft"}
BOUNDS = {"throughput": 0.15, "tpot": 0.20, "ttft": 2.0}   # |error| for the first two; a ratio for TTFT


def miss(row: "Comparison", cost_model: str) -> float:
    """How far ``cost_model`` is off on ``row``, in the units of ``BOUNDS``: |predicted /
    measured - 1| for throughputs and TPOT, max(ratio, 1 / ratio) for TTFT."""
    ratio = row.predicted[cost_model] / row.measured
    return max(ratio, 1 / ratio) if METRIC_KINDS[row.metric] == "ttft" else abs(ratio - 1)


def worst(rows: Sequence["Comparison"], cost_model: str, split: str = "held-out") -> dict[str, "Comparison"]:
    """Per metric kind, the ``split`` row (of a point ``in_goal``) that ``cost_model``
    misses most; ``miss(row, cost_model)`` is by how much."""
    by_id = {m["id"]: m for m in measurements()}
    out: dict[str, Comparison] = {}
    for r in rows:
        if r.split != split or not in_goal(by_id[r.id]):
            continue
        kind = METRIC_KINDS[r.metric]
        if kind not in out or miss(r, cost_model) > miss(out[kind], cost_model):
            out[kind] = r
    return out


def compare(cost_models: Sequence = ("roofline", "vllm-like"),
            rows: Sequence[dict] | None = None, extra: Sequence[str] = ()) -> list[Comparison]:
    """Every metric of every measurement, measured and predicted by each cost model
    (one simulation per measurement and model); the summary keys in ``extra``
    (``mean_batch_size``, ...) of those same runs go in each row's ``extra``."""
    models = [get_cost_model(c) for c in cost_models]
    out = []
    for m in measurements() if rows is None else rows:
        predictions = {model.name: predict(m, model, extra) for model in models}
        extras = {name: {key: p[key] for key in extra} for name, p in predictions.items()}
        for metric, value in m["measured"].items():
            out.append(Comparison(m["id"], m["source"], m["split"], metric, value,
                                  {name: p[metric] for name, p in predictions.items()}, extras))
    return out


def fit_loss(model: EngineCostModel, rows: Sequence[dict]) -> float:
    """Mean squared log error of ``model`` over the metrics of ``rows``."""
    errors = [math.log(predicted[k] / v) for m in rows for predicted in (predict(m, model),)
              for k, v in m["measured"].items() if k in FIT_METRICS]
    return float(np.mean(np.square(errors)))


# Unconstrained coordinates -> parameters: overheads >= 0 (log scale around a typical
# size), efficiencies and interference in (0, 1) (logistic).
_LOG_SCALES = {"step_overhead": 1e-3, "seq_overhead": 1e-5, "frontend_time": 1e-3,
               "frontend_latency": 1e-2}


def _to_params(x: np.ndarray, fields: Sequence[str]) -> dict[str, float]:
    return {name: (_LOG_SCALES[name] * math.exp(v) if name in _LOG_SCALES else float(1 / (1 + np.exp(-v))))
            for name, v in zip(fields, x)}


def _from_params(model: EngineCostModel, fields: Sequence[str]) -> np.ndarray:
    logit = lambda p: math.log(p / (1 - p))
    clip = lambda p: min(max(p, 1e-3), 1 - 1e-3)
    return np.array([math.log(max(getattr(model, name), 1e-3 * _LOG_SCALES[name]) / _LOG_SCALES[name])
                     if name in _LOG_SCALES else logit(clip(getattr(model, name))) for name in fields])


def fit(rows: Sequence[dict] | None = None, start: EngineCostModel | None = None,
        iterations: int = 300, verbose: bool = False,
        fields: Sequence[str] = FITTED) -> EngineCostModel:
    """The ``EngineCostModel`` that best predicts ``rows`` (default: the calibration
    split), by Nelder-Mead on the mean squared log error over ``fields`` (the
    others stay at ``start``'s values)."""
    rows = measurements("calibration") if rows is None else list(rows)
    start = start or EngineCostModel("vllm-like", step_overhead=1e-3, seq_overhead=1e-5,
                                     weight_efficiency=0.8, kv_efficiency=0.8, gemm_efficiency=0.7,
                                     interference=0.5, frontend_time=1e-3, frontend_latency=1e-2)
    loss = lambda x: fit_loss(start.with_params(**_to_params(x, fields)), rows)
    x = nelder_mead(loss, _from_params(start, fields), iterations, verbose=verbose)
    return start.with_params(**_to_params(x, fields))


def nelder_mead(f, x0: np.ndarray, iterations: int, step: float = 0.5,
                verbose: bool = False) -> np.ndarray:
    """Minimize ``f`` from ``x0`` with the Nelder-Mead simplex (standard coefficients)."""
    simplex = [x0] + [x0 + step * e for e in np.eye(len(x0))]
    values = [f(x) for x in simplex]
    for it in range(iterations):
        order = np.argsort(values)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if verbose and it % 20 == 0:
            print(f"  iteration {it}: loss {values[0]:.5f}")
        centroid = np.mean(simplex[:-1], axis=0)
        reflected = centroid + (centroid - simplex[-1])
        fr = f(reflected)
        if fr < values[0]:
            expanded = centroid + 2 * (centroid - simplex[-1])
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = centroid + 0.5 * (simplex[-1] - centroid)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:                                     # shrink towards the best point
                simplex = [simplex[0]] + [simplex[0] + 0.5 * (x - simplex[0]) for x in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    return simplex[int(np.argmin(values))]
