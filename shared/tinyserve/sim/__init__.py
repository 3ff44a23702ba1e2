"""Serving at GPU scale on a laptop: the engine's own core loop on a virtual clock
(``simulator``), each step priced by a cost model (``executor``, ``cost_model``: the
roofline, or one calibrated on published vLLM measurements, checked by ``fidelity``);
many replicas behind a router (``cluster``) with the routing policies the HTTP
router uses (``tinyserve.routing``).

    from tinyserve.sim import simulate
"""

from tinyserve.sim.executor import SIM_TOKEN, SimExecutor
from tinyserve.sim.simulator import (SimEngine, SimOutput, SimResult, default_num_kv_blocks,
                                     simulate)

__all__ = ["SIM_TOKEN", "SimEngine", "SimExecutor", "SimOutput", "SimResult",
           "default_num_kv_blocks", "simulate"]
