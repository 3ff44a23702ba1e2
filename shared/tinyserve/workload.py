"""Synthetic serving workloads: when requests arrive and how long they are.

A workload is a list of ``RequestSpec`` sorted by arrival time. The same list
drives the simulator (``tinyserve.sim``), the real engine on CPU and the
HTTP benchmark client, so a result can be checked on each.

* Arrivals: gaps drawn from a gamma distribution with mean ``1 / rate``.
  ``burstiness = 1`` is a Poisson process; smaller values bunch requests into
  bursts separated by lulls (the same rate, a larger variance), larger values
  make arrivals more regular. (vLLM's serving benchmark uses the same convention.)
* Lengths: input (ISL) and output (OSL) lengths from lognormal distributions,
  whose medians and spreads give each named workload its shape.
* Shared prefixes: requests of a ``prefix_group`` start with the same
  ``prefix_len`` tokens (a system prompt, a few-shot header, a document).

Everything is reproducible from ``seed``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Token ids used for synthetic prompts: valid in any vocabulary of >= 2000 ids
# and clear of the low ids that tokenizers reserve for special tokens.
TOKEN_ID_RANGE = (10, 2000)


@dataclass(frozen=True)
class RequestSpec:
    arrival: float                  # seconds from the start of the run
    prompt_len: int                 # input tokens (ISL), including the shared prefix
    output_len: int                 # output tokens to generate (OSL)
    priority: int = 0               # lower = more urgent (the "priority" policy)
    prefix_group: int | None = None  # requests of one group share their first prefix_len tokens
    prefix_len: int = 0

    def __post_init__(self):
        if self.arrival < 0:
            raise ValueError(f"arrival must be >= 0, got {self.arrival!r}")
        if self.prompt_len < 1:
            raise ValueError(f"prompt_len must be >= 1, got {self.prompt_len!r}")
        if self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len!r}")
        if not 0 <= self.prefix_len <= self.prompt_len:
            raise ValueError(f"prefix_len must be in [0, prompt_len], got {self.prefix_len!r}")
        if self.prefix_len and self.prefix_group is None:
            raise ValueError("prefix_len > 0 needs a prefix_group")


@dataclass(frozen=True)
class LengthShape:
    """Lognormal input and output lengths: a median and a spread (sigma of the log)."""
    isl_median: float
    osl_median: float
    isl_sigma: float = 0.6
    osl_sigma: float = 0.6
    description: str = ""


# Shapes sized for a 4k-context 7B model; ``length_scale`` shrinks them for small models.
WORKLOADS: dict[str, LengthShape] = {
    "mixed": LengthShape(256, 128, 1.0, 1.0, "chat-like: both lengths spread over two decades"),
    "short-in-long-out": LengthShape(64, 512, 0.5, 0.5, "short questions, long answers (generation)"),
    "long-in-short-out": LengthShape(1536, 32, 0.4, 0.6, "long documents, short answers (RAG, summaries)"),
    "shared-prefix": LengthShape(48, 64, 0.5, 0.5, "a long system prompt shared by each group, short turns"),
}


def arrival_times(num_requests: int, rate: float, burstiness: float = 1.0,
                  rng: np.random.Generator | None = None) -> np.ndarray:
    """Sorted arrival times of ``num_requests`` requests at ``rate`` per second on average."""
    if not isinstance(num_requests, (int, np.integer)) or num_requests < 0:
        raise ValueError(f"num_requests must be an integer >= 0, got {num_requests!r}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate!r}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness!r}")
    rng = np.random.default_rng(0) if rng is None else rng
    if np.isinf(rate):
        return np.zeros(num_requests)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num_requests)
    return np.cumsum(gaps) - gaps[0] if num_requests else gaps


def _lognormal_lengths(rng: np.random.Generator, median: float, sigma: float, n: int,
                       low: int, high: int) -> np.ndarray:
    values = np.round(rng.lognormal(np.log(median), sigma, size=n))
    return np.clip(values, low, high).astype(int)


def make_workload(name: str = "mixed", num_requests: int = 1000, rate: float = 10.0,
                  seed: int = 0, burstiness: float = 1.0, max_len: int = 4096,
                  length_scale: float = 1.0, num_prefix_groups: int = 8,
                  prefix_len: int = 512, priorities: int = 1) -> list[RequestSpec]:
    """A named workload (see ``WORKLOADS``) of ``num_requests`` requests.

    ``rate`` is in requests per second (``float('inf')``: everyone at t=0).
    Lengths are multiplied by ``length_scale`` and clipped so that prompt +
    output fits ``max_len``. ``priorities > 1`` gives each request a priority
    drawn uniformly from ``0 .. priorities-1``. For ``shared-prefix``, each request
    joins one of ``num_prefix_groups`` groups whose first ``prefix_len`` tokens
    (times ``length_scale``) are shared.
    """
    if name not in WORKLOADS:
        raise ValueError(f"workload: unknown workload {name!r}; choose one of {sorted(WORKLOADS)}")
    if not length_scale > 0:
        raise ValueError(f"length_scale must be > 0, got {length_scale!r}")
    if not isinstance(max_len, int) or max_len < 2:
        raise ValueError(f"max_len must be an integer >= 2, got {max_len!r}")
    if not isinstance(priorities, int) or priorities < 1:
        raise ValueError(f"priorities must be an integer >= 1, got {priorities!r}")
    shape = WORKLOADS[name]
    rng = np.random.default_rng(seed)
    arrivals = arrival_times(num_requests, rate, burstiness, rng)
    shared = 0
    groups = np.full(num_requests, -1)
    if name == "shared-prefix":
        if not isinstance(num_prefix_groups, int) or num_prefix_groups < 1:
            raise ValueError(f"num_prefix_groups must be an integer >= 1, got {num_prefix_groups!r}")
        shared = min(max(1, round(prefix_len * length_scale)), max_len // 2)
        groups = rng.integers(0, num_prefix_groups, size=num_requests)
    isl = _lognormal_lengths(rng, shape.isl_median * length_scale, shape.isl_sigma,
                             num_requests, 1, max_len - 1)
    osl = _lognormal_lengths(rng, shape.osl_median * length_scale, shape.osl_sigma,
                             num_requests, 1, max_len - 1)
    prio = rng.integers(0, priorities, size=num_requests)
    specs = []
    for i in range(num_requests):
        prompt = min(int(isl[i]) + shared, max_len - 1)
        output = max(1, min(int(osl[i]), max_len - prompt))
        group = int(groups[i]) if groups[i] >= 0 else None
        specs.append(RequestSpec(float(arrivals[i]), prompt, output, int(prio[i]), group,
                                 min(shared, prompt) if group is not None else 0))
    return specs


def prompt_token_ids(spec: RequestSpec, index: int, seed: int = 0) -> list[int]:
    """Deterministic token ids for request ``index`` of a workload.

    Requests of the same ``prefix_group`` get identical first ``prefix_len`` ids;
    the rest of each prompt is random, so unrelated prompts share nothing.
    """
    low, high = TOKEN_ID_RANGE
    ids: list[int] = []
    if spec.prefix_group is not None and spec.prefix_len:
        group_rng = np.random.default_rng([seed, 1, spec.prefix_group])
        ids = group_rng.integers(low, high, size=spec.prefix_len).tolist()
    own = np.random.default_rng([seed, 2, index])
    ids += own.integers(low, high, size=spec.prompt_len - len(ids)).tolist()
    return ids


def offered_load(specs: list[RequestSpec]) -> dict[str, float]:
    """Mean lengths and request rate of a workload (what the server is asked to do)."""
    if not specs:
        raise ValueError("specs must not be empty")
    span = specs[-1].arrival - specs[0].arrival
    return {
        "num_requests": len(specs),
        "rate": (len(specs) - 1) / span if span > 0 else float("inf"),
        "mean_prompt_len": float(np.mean([s.prompt_len for s in specs])),
        "mean_output_len": float(np.mean([s.output_len for s in specs])),
    }
