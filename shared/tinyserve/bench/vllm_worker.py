"""The vLLM side of ``bench peer --engine vllm``, run by vLLM's own Python (``.venv-vllm``).

    .venv-vllm/bin/python -m tinyserve.bench.vllm_worker job.json

It imports nothing from tinyserve but this file, so vLLM's environment needs only
``pip install --no-deps -e .``. The job names a checkpoint directory, a dtype, the
workloads (token ids and output lengths) it warms up on, how many ``turns`` to run and
a ``control`` directory through which the caller (``bench.vllm_peer.VllmOffline``) drives
it, so that the engine stays loaded and can be timed in turns with other engines on one
machine state (vLLM logs to stdout, so nothing is printed): the worker writes
``ready.json`` (the start-up time) once loaded, waits for the file ``go-<t>`` (that
turn's workloads) and writes the turn as ``turn-<t>.json``: per workload the wall
time, every request's token ids and vLLM's own TTFT/TPOT of each request
(``RequestOutput.metrics``, filled when stats are on). Requests of a workload with
``concurrency`` 1 go one at a time, the others in one ``generate`` call, as a user would.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def request_times(output) -> tuple[float | None, float | None]:
    """(TTFT, TPOT) in seconds from vLLM's per-request stats, or Nones without them."""
    m = output.metrics
    n = len(output.outputs[0].token_ids)
    if m is None or not m.first_token_ts:
        return None, None
    tpot = (m.last_token_ts - m.first_token_ts) / (n - 1) if n > 1 else None
    return m.first_token_latency, tpot


def run(job: dict) -> None:
    from vllm import LLM, SamplingParams, TokensPrompt

    started = time.perf_counter()
    llm = LLM(model=job["model"], dtype=job["dtype"], seed=0, disable_log_stats=False,
              max_model_len=job["max_model_len"], max_num_seqs=job.get("max_num_seqs", 256))
    start_s = time.perf_counter() - started

    def generate(prompts, news):
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in news]
        return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                            use_tqdm=False)

    first = job["workloads"][0]
    generate(first["prompts"][:1], [2])                     # warm-up, untimed
    control = Path(job["control"])
    write(control / "ready.json", {"start_s": start_s})
    for t in range(job["turns"]):
        go = control / f"go-{t}"
        while not go.exists():
            time.sleep(0.01)
        write(control / f"turn-{t}.json", [run_workload(generate, w) for w in json.loads(go.read_text())])


def run_workload(generate, w: dict) -> dict:
    began = time.perf_counter()
    if w["concurrency"] == 1:
        outs = [o for p, n in zip(w["prompts"], w["news"]) for o in generate([p], [n])]
    else:
        outs = generate(w["prompts"], w["news"])
    seconds = time.perf_counter() - began
    times = [request_times(o) for o in outs]
    return {"name": w["name"], "seconds": seconds,
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "ttft": [t for t, _ in times], "tpot": [t for _, t in times]}


def write(path: Path, data) -> None:
    """JSON written whole or not at all: the other side polls for the file (``bench.vllm_peer``
    writes each turn's workloads with it too)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        run(json.load(f))
