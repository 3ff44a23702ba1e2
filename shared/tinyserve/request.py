"""A request and what it asks for.

Status machine::

    WAITING ──admitted──▶ RUNNING ──stop / length / abort──▶ FINISHED
       ▲                     │
       └──── PREEMPTED ◀─────┘  (blocks ran out: its KV is dropped and recomputed later)
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field


# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS): dividing logits by
# 1e-300 overflows to inf and the softmax to NaN, and the limit of temperature -> 0 is argmax.
SAMPLING_EPS = 1e-5
# Seeds are reduced modulo 2**64 (torch.Generator takes 64 bits), so any integer is accepted.
SEED_MODULUS = 2**64
MAX_LOGPROBS = 20                  # OpenAI's top_logprobs limit


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class SamplingParams:
    """Field names and meanings as in vLLM's ``SamplingParams``.

    ``temperature`` below ``SAMPLING_EPS`` is greedy. ``seed`` is reduced modulo
    2**64. ``logprobs``: None for none, else how many of the most likely tokens to
    report with each sampled token (0: the sampled token's own log-probability only).
    """
    max_tokens: int = 16
    temperature: float = 0.0          # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1                   # -1 = no limit
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    logprobs: int | None = None

    def __post_init__(self):
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_finite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_finite(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or (self.top_k != -1 and self.top_k < 1):
            raise ValueError(f"top_k must be -1 (no limit) or >= 1, got {self.top_k!r}")
        if self.seed is not None:
            if not _is_int(self.seed):
                raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
            self.seed %= SEED_MODULUS
        if self.stop_token_ids is not None:
            if not all(_is_int(t) for t in self.stop_token_ids):
                raise ValueError(f"stop_token_ids must be integers, got {self.stop_token_ids!r}")
            self.stop_token_ids = list(self.stop_token_ids)
        if self.logprobs is not None and (not _is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], "
                             f"got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False)    # a request is itself: compared by identity, not by field values
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    prompt: str | None = None
    eos_token_id: int | None = None
    priority: int = 0
    # More ids that end generation like EOS (a checkpoint's generation_config.json).
    extra_eos_token_ids: tuple[int, ...] = ()
    # Expected number of output tokens, if the client or a predictor gives one
    # (used by shortest-job-first); None = unknown.
    output_len_hint: int | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose K/V are in the cache. Reset to 0 on preemption (recompute).
    num_computed_tokens: int = 0
    finish_reason: str | None = None     # "stop" | "length" | "abort"
    num_preemptions: int = 0
    # With sampling_params.logprobs set: per output token, (its log-probability,
    # [(token id, log-probability), ...] of the most likely tokens), from the model's
    # distribution before temperature, top-k and top-p.
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    # Prompt tokens found in the prefix cache at first admission, and at every
    # admission (a preempted request is admitted again and may hit the cache).
    num_cached_tokens: int = 0
    cached_tokens_per_admission: list[int] = field(default_factory=list)
    prefix_checked: bool = False           # looked up in the prefix cache since last admitted
    # Chain hashes of its first full blocks, computed by prefix-cache lookups while it
    # waits (kv_cache.find_cached_prefix extends them), so a request that waits many
    # steps is hashed once. Dropped when it is admitted: its blocks carry the chain from
    # then on, and a preempted request looks itself up afresh.
    block_hashes: list[bytes] = field(default_factory=list)

    # Timestamps (seconds on the engine's clock) and per-stage durations.
    tokenize_time: float = 0.0
    queued_time: float | None = None       # entered the waiting queue
    detokenize_time: float = 0.0           # total time spent turning its tokens into text
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None
    # Per-step record of (time, num_new_tokens) this request was scheduled for.
    schedule_log: list[tuple[float, int]] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without building prompt + output first
        (a decode step reads one token: it must not copy the whole sequence)."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def is_prefilling(self) -> bool:
        """True while the cache does not yet hold every known token but the last."""
        return self.num_tokens - self.num_computed_tokens > 1

    def check_stop(self, max_model_len: int) -> str | None:
        """Finish reason after the newest output token, or None to go on."""
        params, last = self.sampling_params, self.output_token_ids[-1]
        if not params.ignore_eos and (last == self.eos_token_id or last in self.extra_eos_token_ids):
            return "stop"
        if params.stop_token_ids and last in params.stop_token_ids:
            return "stop"
        if len(self.output_token_ids) >= params.max_tokens or self.num_tokens >= max_model_len:
            return "length"
        return None
