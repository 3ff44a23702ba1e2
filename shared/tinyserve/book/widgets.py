"""Interactive explorers for the notebooks (ipywidgets).

Each explorer wraps a plain plotting function from :mod:`tinyserve.book.plots`, which
the notebook calls once with defaults first, so the executed notebook (stored
without widget state) still shows a static figure.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

from tinyserve import hardware as hwm
from tinyserve.book import plots


def crossover_calculator(measured: hwm.HardwareSpec | None = None, hardware: str = "A100_SXM_80GB",
                         model: str = "LLAMA_7B", dtype: str = "fp16", context_len: int = 0,
                         extra_models: dict | None = None):
    """Hardware, model size, dtype and context length -> weight-read floor,
    crossover batch, per-user and total tokens/s against batch size.

    ``measured``: a spec from ``measure.measure_device()``, offered as the
    hardware choice "measured" (it only knows the dtypes it measured).
    ``extra_models``: more ``ModelSpec``s by name (e.g. the ``cpu-bench`` preset).
    Returns the widget: leave it as a cell's last expression to show it.
    """
    import ipywidgets as W

    hws = dict(hwm.HARDWARE_PRESETS)
    if measured is not None:
        hws["measured"] = measured
    models = dict(hwm.MODELS, **(extra_models or {}))
    hw_w = W.Dropdown(options=list(hws), value=hardware, description="hardware")
    model_w = W.Dropdown(options=list(models), value=model, description="model")
    dtype_w = W.Dropdown(options=sorted(hwm.BYTES_PER_ELEMENT), value=dtype, description="dtype")
    ctx_w = W.IntSlider(value=context_len, min=0, max=32768, step=256, description="context",
                        continuous_update=False)
    summary = W.HTML()
    out = W.Output()

    def update(*_):
        hw, spec, dt, ctx = hws[hw_w.value], models[model_w.value], dtype_w.value, ctx_w.value
        out.clear_output(wait=True)
        if dt not in hw.flops:
            summary.value = f"<b>{hw.name}</b> has no peak for {dt}; known: {', '.join(sorted(hw.flops))}"
            return
        floor = hwm.weight_read_time(hw, spec, dt)
        per_req = hwm.per_request_compute_time(hw, spec, dt)
        cross = plots.crossover_with_context(hw, spec, dt, ctx)
        text = (f"weight read (floor): <b>{floor * 1e3:.2f} ms</b> &middot; compute per request: "
                f"<b>{per_req * 1e6:.1f} &micro;s</b> &middot; ")
        if cross == float("inf"):
            text += "<b>no crossover</b>: each request's KV reads cost more than its compute"
        else:
            per_user, total = hwm.tokens_per_second(hw, spec, max(1.0, cross), dt, ctx)
            text += (f"crossover: <b>B = {cross:.0f}</b> &middot; there: {per_user:.0f} tok/s per user, "
                     f"{total:.0f} tok/s in total")
        summary.value = text
        with out:
            plots.crossover_explorer(hw, spec, dt, ctx)
            plt.show()

    for w in (hw_w, model_w, dtype_w, ctx_w):
        w.observe(update, names="value")
    update()
    return _with_static_text(W.VBox([W.HBox([hw_w, model_w]), W.HBox([dtype_w, ctx_w]), summary, out]),
                             STATIC_TEXT)


# What a notebook saved without widget state shows in place of the controls (JupyterLab
# before the cell is run, GitHub): a sentence instead of ``VBox(children=(...))``.
STATIC_TEXT = ("交叉点计算器：运行这一格就能拨动硬件、模型、精度和上下文长度（上一格是默认参数下的静态图）。"
               "/ The crossover calculator: run this cell for the live controls "
               "(the cell above is its static figure for the defaults).")


def _with_static_text(widget, text: str):
    """``widget``, whose plain-text view (what is shown where no widget can be) is ``text``."""
    shown = widget._repr_mimebundle_

    def bundle(**kwargs):
        data = shown(**kwargs)
        if isinstance(data, tuple):
            return ({**data[0], "text/plain": text}, *data[1:])
        return {**(data or {}), "text/plain": text}

    widget._repr_mimebundle_ = bundle
    return widget


# ---- notebook 06: scheduling policies ----------------------------------------------

PLAYGROUND_POLICIES = ("fcfs", "sjf", "sjf+aging", "priority", "bucket", "prefill-first")


def _playground_policy(name: str):
    from tinyserve.policies import SJFPolicy, make_policy
    return SJFPolicy(aging=200.0) if name == "sjf+aging" else make_policy(name)


def scheduling_playground(workload: str = "mixed", rate: float = 16.0, policy: str = "fcfs",
                          max_num_batched_tokens: int = 8192, num_requests: int = 600,
                          hardware: str = "A100_SXM_80GB", ttft_slo: float = 1.0,
                          tpot_slo: float = 0.05, seed: int = 1):
    """Policy, arrival rate, workload and token budget -> TTFT/TPOT CDFs and queue length,
    simulated with the real scheduler (FCFS drawn alongside as the reference).
    Returns the widget: leave it as a cell's last expression to show it."""
    import ipywidgets as W

    from tinyserve.sim import simulate
    from tinyserve.workload import make_workload

    wl_w = W.Dropdown(options=["mixed", "short-in-long-out", "long-in-short-out"], value=workload,
                      description="workload")
    pol_w = W.Dropdown(options=list(PLAYGROUND_POLICIES), value=policy, description="policy")
    rate_w = W.FloatSlider(value=rate, min=1.0, max=40.0, step=1.0, description="rate (req/s)",
                           continuous_update=False)
    budget_w = W.Dropdown(options=[256, 512, 1024, 2048, 4096, 8192, 16384],
                          value=max_num_batched_tokens, description="token budget")
    summary = W.HTML()
    out = W.Output()

    def update(*_):
        specs = make_workload(wl_w.value, num_requests, rate=rate_w.value, seed=seed)
        kw = dict(hardware=hardware, max_num_batched_tokens=budget_w.value)
        runs = {pol_w.value: simulate(specs, policy=_playground_policy(pol_w.value), **kw)}
        if pol_w.value != "fcfs":
            runs["fcfs"] = simulate(specs, policy="fcfs", **kw)
        rows = []
        for name, r in runs.items():
            s = r.summary(ttft_slo=ttft_slo, tpot_slo=tpot_slo)
            rows.append(f"<b>{name}</b>: median TTFT {s['median_ttft'] * 1e3:.0f} ms, p99 TTFT "
                        f"{s['p99_ttft']:.2f} s, mean TPOT {s['mean_tpot'] * 1e3:.1f} ms, "
                        f"goodput {s['goodput']:.2f} req/s ({s['slo_attainment']:.0%} within "
                        f"TTFT&le;{ttft_slo} s, TPOT&le;{tpot_slo * 1e3:.0f} ms), max queue "
                        f"{s['max_queue_length']}, preemptions {s['num_preemptions']}")
        summary.value = "<br>".join(rows)
        out.clear_output(wait=True)
        with out:
            plots.scheduling_dashboard(runs, ttft_slo=ttft_slo, tpot_slo=tpot_slo)
            plt.show()

    for w in (wl_w, pol_w, rate_w, budget_w):
        w.observe(update, names="value")
    update()
    return _with_static_text(W.VBox([W.HBox([wl_w, pol_w]), W.HBox([rate_w, budget_w]), summary, out]),
                             PLAYGROUND_TEXT)


PLAYGROUND_TEXT = ("调度策略游乐场：运行这一格就能拨动策略、到达率、负载和 token 预算（上一格是一组参数下的静态图）。"
                   "/ The scheduling playground: run this cell for the live controls "
                   "(the cell above is its static figure for one setting).")
