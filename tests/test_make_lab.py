"""`make lab` as a reader or student runs it: JupyterLab serves, opens notebook 00, and
hides nbgrader's teacher tools unless TEACHER=1 (checked over HTTP on the live server)."""

import json
import os
import re
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tinyserve.serving.processes import free_port

ROOT = Path(__file__).resolve().parents[1]
TEACHER_PLUGINS = ["@jupyter/nbgrader:formgrader", "@jupyter/nbgrader:create-assignment",
                   "@jupyter/nbgrader:course-list", "@jupyter/nbgrader:menu"]


def status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


def wait_until_serving(base: str, deadline: float) -> None:
    """Jupyter logs its URL a moment before the socket accepts connections."""
    while True:
        try:
            status(f"{base}/api/status")
            return
        except urllib.error.URLError:
            if time.time() > deadline:
                raise
            time.sleep(0.2)


def page_config(html: str) -> dict:
    found = re.search(r'<script id="jupyter-config-data" type="application/json">(.*?)</script>', html, re.S)
    assert found, "the /lab page carries no jupyter-config-data"
    return json.loads(found.group(1))


@pytest.fixture
def make_lab():
    servers = []

    def start(*make_vars):
        port = free_port()
        proc = subprocess.Popen(["make", "--no-print-directory", "lab", f"PORT={port}", "HOST=127.0.0.1", *make_vars],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, env={**os.environ, "BROWSER": "true"})
        servers.append(proc)
        deadline, log = time.time() + 120, []
        while time.time() < deadline:
            line = proc.stdout.readline()
            log.append(line)
            found = re.search(rf"(http://127\.0\.0\.1:{port}/lab\S*\?token=(\w+))", line)
            if found:
                base = f"http://127.0.0.1:{port}"
                wait_until_serving(base, deadline)
                return base, found.group(2), found.group(1)
            if proc.poll() is not None:
                break
        pytest.fail("make lab did not print its URL:\n" + "".join(log[-30:]))

    yield start
    for proc in servers:
        subprocess.run(["pkill", "-TERM", "-g", str(proc.pid)], check=False)
        proc.wait(timeout=30)


def test_make_lab_opens_notebook_00_and_hides_the_teacher_tools(make_lab):
    base, token, url = make_lab()
    assert "/lab/tree/chapters/ch05_engine_and_scheduling/00_overview.ipynb" in url
    with urllib.request.urlopen(f"{base}/lab?token={token}", timeout=10) as response:
        disabled = page_config(response.read().decode())["disabledExtensions"]
    assert set(TEACHER_PLUGINS) <= set(disabled)
    assert status(f"{base}/formgrader?token={token}") == 404
    assert status(f"{base}/api/contents/labs?token={token}") == 200


def test_make_lab_teacher_shows_the_nbgrader_tools(make_lab):
    base, token, _ = make_lab("TEACHER=1")
    with urllib.request.urlopen(f"{base}/lab?token={token}", timeout=10) as response:
        disabled = page_config(response.read().decode()).get("disabledExtensions", [])
    assert not set(TEACHER_PLUGINS) & set(disabled)
    assert status(f"{base}/formgrader?token={token}") != 404
