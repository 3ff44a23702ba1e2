"""Replay a timed trace of requests against an engine, in real time.

A trace is a list of ``(arrival_offset_seconds, prompt, SamplingParams)``. The
replayer adds each request once its arrival time has passed (stamping the true
arrival time, so TTFT includes the time it spent queued behind a busy step),
steps the engine while there is work, and sleeps when there is none::

    trace = [(t, [1, 2, 3], SamplingParams(max_tokens=16)) for t in poisson_arrivals(50, 2.0, seed=0)]
    outputs = replay(llm.engine, trace, max_duration=3.0)
    queue = [(s.start, s.num_waiting) for s in llm.engine.step_stats]
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np

from tinyserve.engine import LLMEngine, Prompt, RequestOutput
from tinyserve.request import SamplingParams

Arrival = tuple[float, Prompt, SamplingParams]


def poisson_arrivals(rate: float, duration_or_count: float | int, seed: int = 0) -> np.ndarray:
    """Sorted arrival offsets (seconds) of a Poisson process of ``rate`` requests/s.

    An ``int`` asks for that many arrivals; a ``float`` for every arrival within
    that many seconds. The gaps are exponential with mean ``1 / rate``.
    """
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate!r}")
    rng = np.random.default_rng(seed)
    if isinstance(duration_or_count, (int, np.integer)) and not isinstance(duration_or_count, bool):
        return np.cumsum(rng.exponential(1.0 / rate, size=int(duration_or_count)))
    duration = float(duration_or_count)
    gaps = rng.exponential(1.0 / rate, size=int(rate * duration * 1.5) + 16)
    while gaps.sum() < duration:        # rare: draw more until the window is covered
        gaps = np.concatenate([gaps, rng.exponential(1.0 / rate, size=gaps.size)])
    offsets = np.cumsum(gaps)
    return offsets[offsets < duration]


def replay(engine: LLMEngine, arrivals: Sequence[Arrival], *,
           clock: Callable[[], float] | None = None,
           max_duration: float | None = None) -> list[RequestOutput]:
    """Run ``arrivals`` against ``engine`` in real time; return finished outputs in trace order.

    ``clock`` defaults to the engine's own clock (it must be the same clock, since
    arrival times are stamped with it). With ``max_duration`` (seconds), requests
    still unfinished after that long are aborted (their blocks are freed) and
    later arrivals are never added.
    """
    clock = clock or engine.clock
    order = sorted(range(len(arrivals)), key=lambda i: arrivals[i][0])
    start = clock()
    next_i = 0                      # position in ``order`` of the next request to add
    index_of: dict[str, int] = {}   # request id -> position in the trace
    done: dict[int, RequestOutput] = {}
    while True:
        now = clock()
        if max_duration is not None and now - start >= max_duration:
            for rid, i in index_of.items():
                if i not in done:
                    engine.abort(rid)
            break
        # Admit every request whose arrival time has passed, stamped with that time.
        while next_i < len(order) and start + arrivals[order[next_i]][0] <= now:
            i = order[next_i]
            offset, prompt, params = arrivals[i]
            rid = engine.add_request(prompt, params, arrival_time=start + offset)
            index_of[rid] = i
            next_i += 1
        if engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished and out.request_id in index_of:
                    done[index_of[out.request_id]] = out
        elif next_i < len(order):   # idle: sleep until the next arrival (or the deadline)
            wake = start + arrivals[order[next_i]][0]
            if max_duration is not None:
                wake = min(wake, start + max_duration)
            time.sleep(max(0.0, wake - clock()))
        else:
            break
    return [done[i] for i in sorted(done)]
