"""An in-process aiohttp app (a server or a router) served on a loopback port from its
own event-loop thread, for the server and router tests."""

from __future__ import annotations

import asyncio
import threading

import openai
from aiohttp.test_utils import TestServer


class Background:
    """``app`` served on 127.0.0.1 from its own event-loop thread, so that blocking
    clients (the ``openai`` SDK) and ``asyncio.run`` clients can both talk to it.
    ``runner_kwargs``: a config's ``runner_kwargs()`` (``ServerConfig``, ``RouterConfig``)."""

    def __init__(self, app, **runner_kwargs):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = TestServer(app, host="127.0.0.1")
        runner_kwargs.pop("handler_cancellation", None)       # TestServer sets it
        self._run(self.server.start_server(**runner_kwargs))
        self.host, self.port = "127.0.0.1", self.server.port
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = app

    def _run(self, coro, timeout=60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        self._run(self.server.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    def sdk(self) -> openai.OpenAI:
        """The real ``openai`` client, without its retries (a test sees every answer)."""
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0,
                             timeout=60)
