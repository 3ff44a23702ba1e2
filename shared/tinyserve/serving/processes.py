"""Running servers as subprocesses (tests, notebooks, the router benchmark).

    with ServerProcess(["serve", "--model", "tiny"]).wait() as server:
        waiting = fetch_metrics(server.url).total("tinyserve:num_requests_waiting")

``ServerProcess`` runs ``python -m tinyserve <command>`` on a free loopback port;
``launch_servers`` starts several at once and waits until all are healthy.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request


def setup_logging() -> None:
    """One line per event on stderr for the ``tinyserve.*`` loggers (a server process)."""
    logger = logging.getLogger("tinyserve")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout: float = 120.0, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"server process exited with code {process.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not become healthy within {timeout} s")


def stop_group(process: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM to ``process``'s group (started with ``start_new_session``), SIGKILL to it
    if the leader has not exited within ``timeout``; children never outlive it."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)        # whatever of the group is left
    except ProcessLookupError:
        pass
    process.wait()


class ServerProcess:
    """A ``python -m tinyserve <command>`` subprocess on a free loopback port.

    Use as a context manager (or call ``stop()``) so that it never outlives you.
    """

    def __init__(self, args: list[str], host: str = "127.0.0.1", port: int | None = None,
                 program: list[str] | None = None, env: dict | None = None):
        """``program`` (default ``python -m tinyserve``) runs with ``args`` and the address;
        another OpenAI server with ``--host``/``--port`` and ``/health`` (vLLM's) works too."""
        self.host, self.port = host, port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        program = [sys.executable, "-m", "tinyserve"] if program is None else program
        cmd = [*program, *args, "--host", host, "--port", str(self.port)]
        # stderr goes to a file, not a pipe: a pipe nobody reads can fill up and block it.
        self._stderr = tempfile.TemporaryFile()
        # Its own process group, so that stop() also ends what it started (vLLM's engine
        # core and workers), even when it has to be killed.
        self.process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self._stderr,
                                        env={**(os.environ if env is None else env),
                                             "PYTHONUNBUFFERED": "1"}, start_new_session=True)

    def wait(self, timeout: float = 120.0) -> "ServerProcess":
        try:
            wait_healthy(self.url, timeout, self.process)
        except Exception:
            err = self.stop()
            raise RuntimeError(f"{self.url} failed to start: {err[-6000:]}") from None
        return self

    def stop(self, timeout: float = 10.0) -> str:
        """SIGTERM, then SIGKILL if needed; returns what it wrote to stderr."""
        stop_group(self.process, timeout)
        if self._stderr.closed:
            return ""
        self._stderr.seek(0)
        err = self._stderr.read()
        self._stderr.close()
        return err.decode(errors="replace")

    def __enter__(self) -> "ServerProcess":
        self._guard = contextlib.ExitStack()
        self._guard.enter_context(sigterm_as_exit())
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        self._guard.close()


@contextlib.contextmanager
def sigterm_as_exit():
    """While inside, a SIGTERM to this process raises SystemExit (main thread only).

    What we start runs in a session of its own (``stop_group``), so a SIGTERM to us (a
    job's time limit, ``kill``) would end us without running the ``finally`` blocks and
    ``__exit__``s that stop it, and leave it running: a vLLM holds gigabytes and every core."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        yield
    finally:
        if previous is not None:            # None: a handler not set from Python
            signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def launch_servers(n: int, model: str = "tiny", extra_args: list[str] | None = None,
                   timeout: float = 120.0) -> list[ServerProcess]:
    """Start ``n`` servers at once and wait until all are healthy (all stopped on failure)."""
    procs = [ServerProcess(["serve", "--model", model, *(extra_args or [])]) for _ in range(n)]
    try:
        for p in procs:
            p.wait(timeout)
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return procs

