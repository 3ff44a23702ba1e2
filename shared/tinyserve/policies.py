"""Scheduling policies: which waiting request is admitted next.

The scheduler asks its policy one question per admission, ``select(waiting,
now, running)``, and never looks at how the answer was found; FCFS,
shortest-job-first, priority with aging, length buckets and the decode-first /
prefill-first step compositions are all classes of this module, and the
simulator runs the very same ones.
"""

from __future__ import annotations

import bisect
from typing import Callable, Sequence

from tinyserve.request import Request, RequestStatus


class Policy:
    """Orders the waiting queue.

    ``select(waiting, now, running)`` returns the index in ``waiting`` of the next
    request to admit, or ``None`` to admit nobody more this step. A preempted
    request sits at the front of the queue and is always resumed first: it has
    already been served once and holds no blocks, so letting it wait again would
    only waste the work done on it.

    ``prefill_first`` selects the step composition: ``False`` (decode-first, the
    default) lets running requests take their tokens first and gives new prompts
    the budget left over; ``True`` runs pending prefills in steps of their own
    while the running requests' decodes wait.
    """
    name = "base"
    prefill_first = False

    def select(self, waiting: Sequence[Request], now: float,
               running: Sequence[Request] = ()) -> int | None:
        if waiting and waiting[0].status is RequestStatus.PREEMPTED:
            return 0
        return self.choose(waiting, now, running)

    def choose(self, waiting: Sequence[Request], now: float,
               running: Sequence[Request]) -> int | None:
        raise NotImplementedError


def _argmin(waiting: Sequence[Request], key: Callable[[Request], float]) -> int:
    """Index of the smallest key; ties go to the earlier position (arrival order)."""
    return min(range(len(waiting)), key=lambda i: key(waiting[i]))


class FCFSPolicy(Policy):
    """First come, first served: a long prompt at the head holds up everyone behind it."""
    name = "fcfs"

    def choose(self, waiting, now, running):
        return 0


class SJFPolicy(Policy):
    """Shortest job first: the fewest tokens left to prefill, plus the output-length hint
    when the request carries one (``Request.output_len_hint``).

    ``aging`` (tokens per second of waiting) lowers a request's effective length
    as it waits, so a long request cannot be overtaken forever; 0 = pure SJF,
    which can starve long requests under sustained load.
    """
    name = "sjf"

    def __init__(self, aging: float = 0.0):
        if aging < 0:
            raise ValueError(f"aging must be >= 0, got {aging!r}")
        self.aging = aging

    def job_size(self, request: Request) -> float:
        size = request.num_tokens - request.num_computed_tokens
        if request.output_len_hint is not None:
            size += request.output_len_hint
        return size

    def choose(self, waiting, now, running):
        return _argmin(waiting, lambda r: self.job_size(r) - self.aging * (now - r.arrival_time))


class PriorityPolicy(Policy):
    """Lower ``priority`` value first; among equals, first come first served.

    ``aging`` (priority levels per second of waiting) is subtracted from a
    request's priority as it waits, so every request eventually reaches the
    front: a request with priority p behind a stream of priority-0 arrivals
    waits at most about p / aging seconds longer than they do.
    """
    name = "priority"

    def __init__(self, aging: float = 1.0):
        if aging < 0:
            raise ValueError(f"aging must be >= 0, got {aging!r}")
        self.aging = aging

    def choose(self, waiting, now, running):
        return _argmin(waiting, lambda r: r.priority - self.aging * (now - r.arrival_time))


class BucketPolicy(Policy):
    """Length buckets: each step admits requests of one prompt-length bucket only,
    the bucket of the oldest waiting request, in arrival order.

    Requests admitted together have similar lengths, so they finish prefill
    together (and in a static batch, nobody short is held by someone long).
    The cost is fill rate: when that bucket has few requests waiting, seats and
    budget stay unused this step although other requests wait.
    """
    name = "bucket"

    def __init__(self, boundaries: Sequence[int] = (64, 256, 1024)):
        if not boundaries or list(boundaries) != sorted(set(boundaries)):
            raise ValueError(f"boundaries must be increasing, got {boundaries!r}")
        self.boundaries = tuple(boundaries)
        self._step: tuple[float, int] | None = None     # (step time, its bucket)

    def bucket(self, request: Request) -> int:
        return bisect.bisect_left(self.boundaries, request.num_prompt_tokens)

    def choose(self, waiting, now, running):
        if self._step is None or self._step[0] != now:         # a new step
            self._step = (now, self.bucket(waiting[0]))
        current = self._step[1]
        return next((i for i, r in enumerate(waiting) if self.bucket(r) == current), None)


class DecodeFirstPolicy(FCFSPolicy):
    """FCFS order; every step serves the running requests' decodes first and gives
    new prompts what is left of the token budget (steady TPOT, slower TTFT).
    This is also what ``fcfs`` does: the name exists to compare with prefill-first."""
    name = "decode-first"


class PrefillFirstPolicy(FCFSPolicy):
    """FCFS order; whenever a waiting prompt can be admitted, the step runs
    prefills only and the decodes pause (fast TTFT, TPOT stalls)."""
    name = "prefill-first"
    prefill_first = True


POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (FCFSPolicy, SJFPolicy, PriorityPolicy, BucketPolicy,
                              DecodeFirstPolicy, PrefillFirstPolicy)}


def make_policy(policy: str | Policy) -> Policy:
    """A policy by name (default settings) or an already built ``Policy`` instance."""
    if isinstance(policy, Policy):
        return policy
    if policy not in POLICIES:
        raise ValueError(f"policy: unknown policy {policy!r}; choose one of {sorted(POLICIES)}")
    return POLICIES[policy]()
