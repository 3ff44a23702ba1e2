"""Every figure the notebooks show, as plain functions of measured data.

One module per notebook (``batching`` 01, ``fusion`` 02, ``continuous`` 03,
``crossover`` 04, ``journey`` 05, ``policies`` 06, ``orchestration`` 07,
``tuning`` 08), with the shared axes helpers and the book's one figure style in ``common``. Each function takes
data (lists, dicts, step stats) and an optional matplotlib ``ax``, draws, and
returns the axes, so notebooks, widgets and labs share them. Everything public is
re-exported here: notebooks write ``from tinyserve.book import plots`` and call
``plots.<name>(...)`` whichever module the figure lives in.
"""

from tinyserve.book.plots.common import (  # noqa: F401  (re-exported; importing it sets the style)
    DPI, SMALL, MEDIUM, TITLE, ensure_axes, finish,
)
from tinyserve.book.plots.batching import (  # noqa: F401
    plot_step_time_vs_batch, plot_per_request_time, plot_tradeoff_bars, plot_request_timeline,
    plot_queue_length, plot_ttft_vs_arrival,
)
from tinyserve.book.plots.fusion import (  # noqa: F401
    bytes_moved_bars, bandwidth_bars, bytes_vs_context,
)
from tinyserve.book.plots.continuous import (  # noqa: F401
    assign_seats, gantt, kv_blocks_timeline, predicted_vs_measured, step_cost_fit,
)
from tinyserve.book.plots.crossover import (  # noqa: F401
    crossover_with_context, crossover_explorer, roofline, measured_vs_roofline,
    latency_throughput,
)
from tinyserve.book.plots.journey import (  # noqa: F401
    WATERFALL_STAGES, waterfall_spans, waterfall, itl_spikes, refcount_map, tokenizer_vs_engine,
)
from tinyserve.book.plots.policies import (  # noqa: F401
    cdf, starvation_vs_aging, metric_bars, goodput_heatmap, scheduling_dashboard,
    simulator_vs_engine, cost_models_vs_published, live_vllm_sweep,
)
from tinyserve.book.plots.orchestration import (  # noqa: F401
    layer_trace, routing_policy_bars, routing_vs_replicas, disaggregation_bars, kv_transfer_scatter,
)
from tinyserve.book.plots.tuning import (  # noqa: F401
    plot_before_after, plot_waiting_queue, plot_capacity,
)
