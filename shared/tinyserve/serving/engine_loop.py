"""The engine thread: one dedicated thread owns an ``LLMEngine`` and does nothing but ``step()``.

The aiohttp event loop (``tinyserve.serving.app``) parses requests, tokenizes
them on a worker thread and writes responses; ``EngineLoop`` runs the engine on
its own thread. They meet in a thread-safe inbox (add / abort / call commands)
going in, and ``loop.call_soon_threadsafe`` pushing each step's new tokens
(``Delta``) into the handler's ``asyncio.Queue`` coming out. The engine thread
sleeps on a condition variable while it has nothing to do, so an idle server
uses no CPU. Because only the engine thread touches the engine, the scheduler
and the block manager need no locks.

One request's failure is that request's alone. If sampling raises for a request
(``LLMEngine.isolate_sample_failures``), that request is
aborted and its handler gets an ``EngineError``; everyone else in the step gets
their token. If a step fails as a whole, the requests it was running fail and
the waiting ones are kept; the engine goes on. A step that fails with nothing
running (a stall: the policy admits nobody) fails the request at the head of the
queue instead, so every failed step removes a request and the thread never spins.

Stop strings are applied here, on the text each step adds (``StopStrings``): a
request that hits one finishes with ``finish_reason="stop"`` and is aborted at
once, which frees its KV blocks.

A client that disconnects aborts its request: aiohttp cancels the handler,
whose ``finally`` posts an abort that the engine thread applies before its
next step, which frees the request's KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from tinyserve.engine import LLMEngine, RequestOutput
from tinyserve.metrics import E2E_BUCKETS, STEP_TOKEN_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS, Histogram
from tinyserve.request import Request, RequestStatus, SamplingParams
from tinyserve.serving.stops_and_logprobs import StopStrings

log = logging.getLogger("tinyserve.serving")


@dataclass
class Delta:
    """What one engine step produced for one request (sent to its handler)."""
    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    # (log-probability, [(id, log-probability), ...]) per token, when asked for.
    logprobs: list | None = None


class EngineError(Exception):
    """The engine failed while running a request (``request_id``; None: all of them)."""

    def __init__(self, message: str, request_id: str | None = None):
        super().__init__(message)
        self.request_id = request_id


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    stop: StopStrings | None


class EngineLoop:
    """Owns an ``LLMEngine`` on one dedicated thread; handlers talk to it via an inbox."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: deque[tuple] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        # request_id -> where its deltas go; touched only by the engine thread.
        self._streams: dict[str, _Stream] = {}
        # Sampling failures are isolated per request (see the module docstring).
        engine.isolate_sample_failures()
        # Counters and histograms for /metrics (written by the engine thread only).
        self.request_success_total = 0
        self.request_abort_total = 0
        self.request_failure_total = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        # Once per step: its count is the steps run, and /metrics' mean batch is generated
        # tokens / steps.
        self.step_tokens = Histogram(STEP_TOKEN_BUCKETS)

    @property
    def num_steps(self) -> int:
        return self.step_tokens.count

    # -- lifecycle --
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tinyserve-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _post(self, command: tuple) -> None:
        with self._wake:
            self._inbox.append(command)
            self._wake.notify()

    # -- called from the event loop --
    async def add(self, prompt: Sequence[int] | str, params: SamplingParams, queue: asyncio.Queue,
                  stop: Sequence[str] = (), arrival_time: float | None = None) -> str:
        """Queue a request whose ``Delta``s (or ``EngineError``) go to ``queue``; return its
        id. Raises ``ValueError`` if the engine rejects it. ``arrival_time`` (on the
        engine's clock) is when the server received it: TTFT counts from there."""
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future = loop.create_future()
        request_id = f"cmpl-{uuid.uuid4().hex}"
        stops = StopStrings(list(stop)) if stop else None
        self._post(("add", request_id, prompt, params, loop, queue, stops, arrival_time, accepted))
        try:
            await accepted
        except asyncio.CancelledError:      # the client left before the engine took it
            self.abort(request_id)
            raise
        return request_id

    def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread (a consistent snapshot)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        self._post(("call", fn, loop, done))
        return await done

    # -- the engine thread --
    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._wake:
                while not (self._inbox or self._stopping or engine.has_unfinished_requests()):
                    self._wake.wait()           # idle: sleep until a command arrives
                if self._stopping:
                    break
                commands = list(self._inbox)
                self._inbox.clear()
            for command in commands:
                self._apply(command)
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except Exception as exc:            # keep serving: fail what this step ran
                self._fail_step(exc)
                continue
            self.step_tokens.observe(engine.last_step.num_scheduled_tokens)
            self._deliver(outputs, engine.take_sample_failures())
        self._fail_all(EngineError("server is shutting down"))

    def _apply(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, prompt, params, loop, queue, stops, arrival, accepted = command
            try:
                self.engine.add_request(prompt, params, request_id=request_id,
                                        arrival_time=arrival)
            except ValueError as exc:
                settle_future(loop, accepted, exc=exc)
                return
            except Exception as exc:            # never leave a handler waiting
                log.exception("adding request %s failed", request_id)
                settle_future(loop, accepted, exc=EngineError(f"{type(exc).__name__}: {exc}"))
                return
            self._streams[request_id] = _Stream(loop, queue, stops)
            settle_future(loop, accepted, result=request_id)
        elif kind == "abort":
            request_id = command[1]
            if self._streams.pop(request_id, None) is not None and self.engine.abort(request_id):
                self.request_abort_total += 1
        elif kind == "call":
            _, fn, loop, done = command
            try:
                result = fn(self.engine)
            except Exception as exc:
                settle_future(loop, done, exc=exc)
            else:
                settle_future(loop, done, result=result)

    def _deliver(self, outputs: list[RequestOutput], failures: dict[str, Exception]) -> None:
        # One call_soon_threadsafe per event loop per step, not one per token.
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            rid = out.request_id
            if rid in failures:
                self._fail_request(rid, failures[rid], batches)
                continue
            stream = self._streams.get(rid)
            self.generation_tokens_total += len(out.new_token_ids)
            text, finished, reason = out.new_text, out.finished, out.finish_reason
            if stream is not None and stream.stop is not None:
                text, hit = stream.stop.push(text)
                if hit and not finished:
                    finished, reason = True, "stop"
                    self.engine.abort(rid)      # frees its blocks now
                elif hit:
                    reason = "stop"
                elif finished:
                    text += stream.stop.flush()
            if finished:
                self._streams.pop(rid, None)
                self._finished(out.request, reason)
            if stream is None:
                continue
            request = out.request
            logprobs = (request.logprobs[-len(out.new_token_ids):]
                        if request.sampling_params.logprobs is not None and out.new_token_ids
                        else None)
            delta = Delta(rid, text, list(out.new_token_ids), finished, reason,
                          len(out.prompt_token_ids), out.num_output_tokens, logprobs)
            batches.setdefault(stream.loop, []).append((stream.queue, delta))
        for loop, items in batches.items():
            with contextlib.suppress(RuntimeError):      # the loop has closed (shutdown)
                loop.call_soon_threadsafe(_put_all, items)

    def _finished(self, request: Request, reason: str | None) -> None:
        self.prompt_tokens_total += request.num_prompt_tokens
        if reason not in ("stop", "length"):
            return
        self.request_success_total += 1
        end = request.finished_time if request.finished_time is not None else self.engine.clock()
        if request.first_token_time is None:
            return
        ttft = request.first_token_time - request.arrival_time
        e2e = end - request.arrival_time
        self.ttft.observe(ttft)
        self.e2e.observe(e2e)
        n = len(request.output_token_ids)
        if n > 1:
            self.tpot.observe((e2e - ttft) / (n - 1))

    def _fail_request(self, request_id: str, exc: Exception, batches: dict) -> None:
        """This request alone fails: aborted (blocks freed), its handler gets an EngineError."""
        self.request_failure_total += 1
        log.warning("request %s failed: %s: %s", request_id, type(exc).__name__, exc)
        with contextlib.suppress(Exception):
            self.engine.abort(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            error = EngineError(f"request failed: {type(exc).__name__}: {exc}", request_id)
            batches.setdefault(stream.loop, []).append((stream.queue, error))

    def _fail_step(self, exc: Exception) -> None:
        """A step raised outside per-request sampling: fail the requests it was running
        (their state is unknown), keep the waiting ones, and go on. With nothing running
        the next step would fail the same way: the head of the queue fails instead."""
        log.error("engine step failed; failing the requests it ran", exc_info=exc)
        engine, batches = self.engine, {}
        if not engine.scheduler.running and engine.scheduler.waiting:
            self._fail_request(engine.scheduler.waiting[0].request_id, exc, batches)
        for rid in list(self._streams):
            request = engine.requests.get(rid)
            if request is not None and request.status in (RequestStatus.WAITING,
                                                          RequestStatus.PREEMPTED):
                continue
            if request is not None and request.is_finished:    # retired by the failed step
                engine.forget(rid)
            self._fail_request(rid, exc, batches)
        for loop, items in batches.items():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_put_all, items)

    def _fail_all(self, exc: EngineError) -> None:
        for request_id, stream in list(self._streams.items()):
            with contextlib.suppress(Exception):
                self.engine.abort(request_id)
            with contextlib.suppress(RuntimeError):
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait,
                                                 EngineError(str(exc), request_id))
        self._streams.clear()


def _put_all(items: list) -> None:
    for queue, delta in items:
        queue.put_nowait(delta)


def settle_future(loop: asyncio.AbstractEventLoop, future: asyncio.Future, result=None, exc=None):
    """From any thread: set ``future``'s result (or ``exc``) on ``loop``, if still pending."""
    def settle():
        if not future.done():
            future.set_exception(exc) if exc is not None else future.set_result(result)
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(settle)
