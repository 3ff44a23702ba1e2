"""The simulator against real engines: published vLLM measurements, replayed.

``data/published_vllm.json`` holds measurements of vLLM serving 7-8B models on
one GPU, each with its source, what the source states, the workload (lengths,
concurrency or rate) and the scheduler knobs vLLM ran with. ``predict`` puts
one through ``simulate`` with a cost model and returns the same metrics;
``compare`` does it for all of them, and ``fit`` calibrates an
``EngineCostModel`` on the ``"calibration"`` points, so the ``"held-out"`` ones
test it on measurements it never saw.

    from tinyserve.sim.fidelity import compare
    for row in compare(): print(row.id, row.metric, row.measured, row.predicted)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Sequence

import numpy as np

from tinyserve.metrics import summarize
from tinyserve.sim.cost_model import EngineCostModel, get_cost_model
from tinyserve.sim.simulator import simulate
from tinyserve.workload import RequestSpec

# The metrics fit() matches: how fast the engine turns out tokens. TTFT is left out on
# purpose: a client's TTFT also holds time outside the engine (HTTP, tokenizing, the
# API server's own queue), which no step cost model prices; it is reported, not fitted.
FIT_METRICS = ("output_throughput", "mean_tpot", "mean_e2e")
LATENCY_METRICS = ("mean_tpot", "mean_e2e")          # how fast, as a time per token or request
# The EngineCostModel fields that fit() adjusts (kv_efficiency follows weight_efficiency).
FITTED = ("step_overhead", "seq_overhead", "weight_efficiency", "gemm_efficiency",
          "gemm_half_tokens", "interference")


@cache
def published() -> dict:
    """The data file: ``{"sources": {...}, "measurements": [...]}``."""
    text = resources.files("tinyserve").joinpath("data/published_vllm.json").read_text()
    return json.loads(text)


def measurements(split: str | None = None) -> list[dict]:
    """All measurements, or those of one split (``"calibration"``, ``"held-out"``)."""
    rows = published()["measurements"]
    if split is not None and split not in {m["split"] for m in rows}:
        raise ValueError(f"split: unknown split {split!r}; choose one of {sorted({m['split'] for m in rows})}")
    return [m for m in rows if split is None or m["split"] == split]


def workload(measurement: dict) -> list[RequestSpec]:
    """The requests of a measurement, all queued at t=0 (the sources used rate inf).

    A recorded trace is replayed as is; fixed lengths are repeated; outputs that
    stopped early at EOS (only their mean is known) are spread evenly between
    ``2 x mean - max`` and ``max``, so the mean is the source's and the requests
    do not all finish in the same step.
    """
    w = measurement["workload"]
    if "input_lens" in w:
        return [RequestSpec(0.0, n, max(1, o)) for n, o in zip(w["input_lens"], w["output_lens"])]
    n = w["num_prompts"]
    if "output_len" in w:
        outputs = [w["output_len"]] * n
    else:
        high, mean = w["max_output_len"], w["mean_output_len"]
        low = 2 * mean - high
        outputs = [low + (i * 37) % (high - low + 1) for i in range(n)]   # a fixed permutation
    return [RequestSpec(0.0, w["input_len"], o) for o in outputs]


def engine_knobs(measurement: dict) -> dict:
    """The scheduler knobs vLLM ran with, as ``simulate`` keywords."""
    knobs = {k: v for k, v in measurement["engine"].items() if k != "why"}
    knobs.setdefault("max_model_len", 32768)
    return knobs


def predict(measurement: dict, cost_model="roofline") -> dict[str, float]:
    """The measurement's metrics as the simulator predicts them with ``cost_model``."""
    specs = workload(measurement)
    result = simulate(specs, measurement["hardware"], measurement["model"], measurement["dtype"],
                      max_concurrency=measurement["workload"].get("max_concurrency"),
                      cost_model=cost_model, **engine_knobs(measurement))
    summary = summarize(result.metrics)
    return {metric: summary[metric] for metric in measurement["measured"]}


@dataclass(frozen=True)
class Comparison:
    id: str
    source: str
    split: str
    metric: str
    measured: float
    predicted: dict[str, float]          # cost model name -> prediction

    def error(self, cost_model: str) -> float:
        """predicted / measured - 1."""
        return self.predicted[cost_model] / self.measured - 1

    def speed_error(self, cost_model: str) -> float:
        """Predicted / measured speed - 1: a throughput as it is, a latency (e2e, TPOT)
        inverted, so that > 0 always means "predicted too fast". TTFT stays a time."""
        if self.metric in LATENCY_METRICS:
            return self.measured / self.predicted[cost_model] - 1
        return self.error(cost_model)


def compare(cost_models: Sequence = ("roofline", "vllm-like"),
            rows: Sequence[dict] | None = None) -> list[Comparison]:
    """Every metric of every measurement, measured and predicted by each cost model."""
    models = [get_cost_model(c) for c in cost_models]
    out = []
    for m in measurements() if rows is None else rows:
        predictions = {model.name: predict(m, model) for model in models}
        for metric, value in m["measured"].items():
            out.append(Comparison(m["id"], m["source"], m["split"], metric, value,
                                  {name: p[metric] for name, p in predictions.items()}))
    return out


def fit_loss(model: EngineCostModel, rows: Sequence[dict]) -> float:
    """Mean squared log error of ``model`` over the metrics of ``rows``."""
    errors = [math.log(predict(m, model)[k] / v) for m in rows
              for k, v in m["measured"].items() if k in FIT_METRICS]
    return float(np.mean(np.square(errors)))


def _to_params(x: np.ndarray) -> dict[str, float]:
    # Unconstrained coordinates -> parameters: overheads and M_half >= 0 (log scale),
    # efficiencies and interference in (0, 1) (logistic).
    sig = 1 / (1 + np.exp(-x))
    return {"step_overhead": 1e-3 * math.exp(x[0]), "seq_overhead": 1e-5 * math.exp(x[1]),
            "weight_efficiency": float(sig[2]), "kv_efficiency": float(sig[2]),
            "gemm_efficiency": float(sig[3]), "gemm_half_tokens": 64 * math.exp(x[4]),
            "interference": float(sig[5])}


def _from_params(model: EngineCostModel) -> np.ndarray:
    logit = lambda p: math.log(p / (1 - p))
    clip = lambda p: min(max(p, 1e-3), 1 - 1e-3)
    return np.array([math.log(max(model.step_overhead, 1e-6) / 1e-3),
                     math.log(max(model.seq_overhead, 1e-8) / 1e-5),
                     logit(clip(model.weight_efficiency)), logit(clip(model.gemm_efficiency)),
                     math.log(max(model.gemm_half_tokens, 1e-3) / 64), logit(clip(model.interference))])


def fit(rows: Sequence[dict] | None = None, start: EngineCostModel | None = None,
        iterations: int = 300, verbose: bool = False) -> EngineCostModel:
    """The ``EngineCostModel`` that best predicts ``rows`` (default: the calibration
    split), by Nelder-Mead on the mean squared log error."""
    rows = measurements("calibration") if rows is None else list(rows)
    start = start or EngineCostModel("vllm-like", step_overhead=1e-3, seq_overhead=1e-5,
                                     weight_efficiency=0.8, gemm_efficiency=0.7,
                                     gemm_half_tokens=64, interference=0.5)
    loss = lambda x: fit_loss(start.with_params(**_to_params(x)), rows)
    x = nelder_mead(loss, _from_params(start), iterations, verbose=verbose)
    return start.with_params(**_to_params(x))


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
