"""The engine thread: one dedicated thread owns an ``LLMEngine`` and does nothing but ``step()``.

The aiohttp event loop (``tinyserve.serving.app``) parses requests and writes
responses; ``EngineLoop`` runs the engine on its own thread. They meet in a
thread-safe inbox (add / abort / call commands) going in, and
``loop.call_soon_threadsafe`` pushing each step's new tokens (``Delta``) into a
per-request ``asyncio.Queue`` coming out. The engine thread sleeps on a
condition variable while it has nothing to do, so an idle server uses no CPU.
Because only the engine thread touches the engine, the scheduler and the block
manager need no locks.

A client that disconnects aborts its request: aiohttp cancels the handler,
whose ``finally`` posts an abort that the engine thread applies before its
next step, which frees the request's KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from tinyserve.engine import LLMEngine, RequestOutput
from tinyserve.request import SamplingParams


@dataclass
class Delta:
    """What one engine step produced for one request (sent to its handler)."""
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int


class EngineError(Exception):
    """The engine thread failed while running a request."""


class RequestHandle:
    """A handler's end of one request: its id and the queue its ``Delta``s arrive on."""

    def __init__(self, request_id: str, queue: asyncio.Queue):
        self.request_id = request_id
        self.queue = queue
        self.finished = False

    async def next_delta(self) -> Delta:
        """The next step's ``Delta``; raises the ``EngineError`` if the engine failed."""
        item = await self.queue.get()
        if isinstance(item, EngineError):
            raise item
        if item.finished:
            self.finished = True
        return item


class EngineLoop:
    """Owns an ``LLMEngine`` on one dedicated thread; handlers talk to it via an inbox."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: deque[tuple] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        # request_id -> (event loop, queue); touched only by the engine thread.
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        # Counters for /metrics (written by the engine thread only).
        self.num_steps = 0
        self.request_success_total = 0
        self.request_abort_total = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

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
    async def add(self, prompt, params: SamplingParams) -> RequestHandle:
        """Queue a request; raise ``ValueError`` if the engine rejects it."""
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future = loop.create_future()
        queue: asyncio.Queue = asyncio.Queue()
        request_id = f"cmpl-{uuid.uuid4().hex}"
        self._post(("add", request_id, prompt, params, loop, queue, accepted))
        try:
            await accepted
        except asyncio.CancelledError:      # the client left before the engine took it
            self.abort(request_id)
            raise
        return RequestHandle(request_id, queue)

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
            except Exception as exc:            # keep serving: fail what was running
                self._fail_all(exc)
                continue
            self.num_steps += 1
            self._deliver(outputs)
        self._fail_all(EngineError("server is shutting down"))

    def _apply(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, prompt, params, loop, queue, accepted = command
            try:
                self.engine.add_request(prompt, params, request_id=request_id)
            except ValueError as exc:
                settle_future(loop, accepted, exc=exc)
                return
            self._streams[request_id] = (loop, queue)
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

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        # One call_soon_threadsafe per event loop per step, not one per token.
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            self.generation_tokens_total += len(out.new_token_ids)
            if out.finished:
                self._streams.pop(out.request_id, None)
                self.prompt_tokens_total += len(out.prompt_token_ids)
                if out.finish_reason in ("stop", "length"):
                    self.request_success_total += 1
            if stream is None:
                continue
            loop, queue = stream
            delta = Delta(out.new_text, list(out.new_token_ids), out.finished, out.finish_reason,
                          len(out.prompt_token_ids), out.num_output_tokens)
            batches.setdefault(loop, []).append((queue, delta))
        for loop, items in batches.items():
            with contextlib.suppress(RuntimeError):      # the loop has closed (shutdown)
                loop.call_soon_threadsafe(_put_all, items)

    def _fail_all(self, exc: Exception) -> None:
        for request_id, (loop, queue) in list(self._streams.items()):
            with contextlib.suppress(Exception):
                self.engine.abort(request_id)
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(queue.put_nowait, EngineError(str(exc)))
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
