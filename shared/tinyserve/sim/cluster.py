"""Many simulated replicas as one service: routing and prefill/decode disaggregation.

The orchestration layer above the engine, in the simulator. Every replica is a
``SimEngine`` (the engine's own scheduler and block manager on a roofline
clock); a router sends each arriving request to one of them with the same
``tinyserve.routing`` policies the HTTP router (``tinyserve.serving.router``) uses.

Disaggregation splits the GPUs into a prefill pool and a decode pool. A request
is prefilled on a prefill replica, which produces its first token; its KV cache
then crosses a link (``prompt tokens x KV bytes per token / kv_link_bandwidth``)
to the least loaded decode replica, which generates the rest. Decode steps no
longer share a GPU with long prefills, at the price of the transfer and of a
fixed split of GPUs between the two jobs.

    from tinyserve.sim.cluster import simulate_cluster
    simulate_cluster(specs, num_replicas=8, routing="cache_aware",
                     enable_prefix_caching=True).summary(ttft_slo=1.0, tpot_slo=0.05)
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Sequence

from tinyserve.hardware import LLAMA_7B, HardwareSpec, ModelSpec, kv_bytes_per_token
from tinyserve.metrics import RequestMetrics, StepStats, request_metrics, summarize
from tinyserve.request import Request
from tinyserve.sim.executor import SIM_TOKEN
from tinyserve.routing import LeastOutstanding, RoutingPolicy, make_routing_policy
from tinyserve.sim.simulator import (SimEngine, SimOutput, load_stats, resolve_hardware_and_model,
                                     step_summary)
from tinyserve.workload import RequestSpec, prompt_token_ids

ARRIVAL, TRANSFER = 0, 1


@dataclass
class ClusterResult:
    outputs: list[SimOutput]              # in input order; .replica says where it was served
    engines: list[SimEngine]              # prefill pool first when disaggregated
    routing: str
    disaggregated: tuple[int, int] | None = None
    routed: list[int] = field(default_factory=list)     # requests sent to each front replica

    def __iter__(self):
        return iter(self.outputs)

    def __len__(self):
        return len(self.outputs)

    @property
    def metrics(self) -> list[RequestMetrics]:
        return [o.metrics for o in self.outputs]

    @property
    def steps(self) -> list[StepStats]:
        return [s for e in self.engines for s in e.steps]

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Over the replicas that prefill: prompt tokens found cached / prompt tokens looked up."""
        front = self.engines[:self.disaggregated[0]] if self.disaggregated else self.engines
        queried = sum(e.block_manager.num_queried_tokens for e in front)
        hits = sum(e.block_manager.num_hit_tokens for e in front)
        return hits / queried if queried else 0.0

    def summary(self, ttft_slo: float | None = None, tpot_slo: float | None = None,
                e2e_slo: float | None = None) -> dict[str, float]:
        s = summarize(self.metrics, ttft_slo=ttft_slo, tpot_slo=tpot_slo, e2e_slo=e2e_slo)
        # Step keys are per replica (mean batch of one GPU, longest queue on one GPU).
        s.update(step_summary(self.steps))
        s.update(load_stats(self))
        s["num_replicas"] = len(self.engines)
        s["prefix_cache_hit_rate"] = self.prefix_cache_hit_rate
        s["num_preemptions"] = sum(e.scheduler.num_preemptions for e in self.engines)
        s["unfinished"] = sum(1 for m in self.metrics if m.finished_time is None)
        if self.routed:
            s["load_imbalance"] = max(self.routed) / max(1, min(self.routed))
        return s


def simulate_cluster(requests: Sequence[RequestSpec], num_replicas: int = 4,
                     routing: str | RoutingPolicy = "round_robin",
                     hardware: HardwareSpec | str = "A100_SXM_80GB",
                     model: ModelSpec | str = LLAMA_7B, dtype: str = "fp16", *,
                     disaggregated: tuple[int, int] | None = None,
                     kv_link_bandwidth: float = 25e9, **engine_kwargs) -> ClusterResult:
    """Serve ``requests`` on ``num_replicas`` simulated GPUs behind a router.

    ``routing``: a name in ``tinyserve.routing.ROUTING_POLICIES`` or a policy
    object (``choose(key, outstanding) -> replica``); the key is the prompt's
    token ids. ``disaggregated=(P, D)``: P prefill and D decode replicas
    (``num_replicas`` is then ignored); the router places prefills, and decodes
    go to the decode replica with the fewest requests. ``kv_link_bandwidth`` in
    bytes/s (25e9: a 200 Gb/s network link). ``engine_kwargs`` go to every
    ``SimEngine`` (the engine's knobs).
    """
    hardware, model = resolve_hardware_and_model(hardware, model)
    num_replicas = _checked_num_replicas(num_replicas, disaggregated, kv_link_bandwidth)
    engines = [SimEngine(hardware, model, dtype, **engine_kwargs) for _ in range(num_replicas)]
    num_front = disaggregated[0] if disaggregated else num_replicas
    policy = make_routing_policy(routing, num_front) if isinstance(routing, str) else routing
    for index, spec in enumerate(requests):
        engines[0].check_fits(spec, str(index))
    transfer_time_per_token = kv_bytes_per_token(model, dtype) / kv_link_bandwidth

    run = _ClusterRun(requests, engines, num_front, policy, transfer_time_per_token)
    run.run()
    return ClusterResult(run.outputs(), engines, getattr(policy, "name", type(policy).__name__),
                         tuple(disaggregated) if disaggregated else None, run.routed)


def _checked_num_replicas(num_replicas, disaggregated, kv_link_bandwidth) -> int:
    """Validate the cluster's shape; with ``disaggregated=(P, D)`` there are P + D replicas."""
    if disaggregated is not None:
        if (len(disaggregated) != 2 or not all(isinstance(n, int) and n >= 1 for n in disaggregated)):
            raise ValueError(f"disaggregated must be (num_prefill, num_decode) with both >= 1, "
                             f"got {disaggregated!r}")
        num_replicas = sum(disaggregated)
    if not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas must be an integer >= 1, got {num_replicas!r}")
    if not kv_link_bandwidth > 0:
        raise ValueError(f"kv_link_bandwidth must be > 0, got {kv_link_bandwidth!r}")
    return num_replicas


class _ClusterRun:
    """One simulation in progress: the front (prefill) and back (decode) replicas, the
    event heap of arrivals and KV transfers, and where every request was placed.

    The front replicas and the events are interleaved in time order: whichever is
    earlier, the next step of the front replica with the smallest clock or the next
    event, goes first. The decode pool is only advanced when KV arrives, and drained
    at the end.
    """

    def __init__(self, requests: Sequence[RequestSpec], engines: list[SimEngine], num_front: int,
                 policy: RoutingPolicy, transfer_time_per_token: float):
        self.requests = requests
        self.num_front = num_front
        self.front, self.back = engines[:num_front], engines[num_front:]
        self.policy = policy
        self.back_policy = LeastOutstanding(len(self.back)) if self.back else None
        self.transfer_time_per_token = transfer_time_per_token
        self.events = [(spec.arrival, ARRIVAL, index) for index, spec in enumerate(requests)]
        heapq.heapify(self.events)
        self.keys: dict[str, list[int]] = {}
        self.placed: dict[str, tuple[int, Request]] = {}     # request id -> (replica, request)
        self.decoded: dict[str, tuple[int, Request]] = {}
        self.routed = [0] * num_front

    def run(self) -> None:
        """Step replicas and handle events until neither is left, then finish every decode."""
        while self._advance():
            pass
        for engine in self.back:
            engine.drain()

    def _advance(self) -> bool:
        """Do the next thing in time order (one front step or one event); False when idle."""
        front = self.front
        busy = [i for i, e in enumerate(front) if e.scheduler.has_unfinished_requests()]
        next_step = min((front[i].clock for i in busy), default=float("inf"))
        next_event = self.events[0][0] if self.events else float("inf")
        if next_step == next_event == float("inf"):
            return False
        if next_step < next_event:           # front replicas run in time order
            replica = min(busy, key=lambda i: front[i].clock)
            self._finish(replica, front[replica].step())
            return True
        t, kind, index = heapq.heappop(self.events)
        if kind == ARRIVAL:
            self._arrive(index)
        else:                                # KV arrived at the decode pool
            self._start_decode(t, index)
        return True

    def _arrive(self, index: int) -> None:
        """Route a new request to a front replica (prefill only when disaggregated)."""
        spec, rid = self.requests[index], str(index)
        self.keys[rid] = prompt_token_ids(spec, index)
        replica = self.policy.choose(self.keys[rid], [e.num_outstanding for e in self.front])
        self.routed[replica] += 1
        self.placed[rid] = (replica, self.front[replica].add(
            spec, rid, token_ids=self.keys[rid], output_len=1 if self.back else None))

    def _start_decode(self, t: float, index: int) -> None:
        """The KV cache reached the decode pool at ``t``: continue on the least loaded decode replica."""
        spec, rid = self.requests[index], str(index)
        back = self.back
        for engine in back:
            engine.advance_to(t)
        replica = self.back_policy.choose((), [e.num_outstanding for e in back])
        self.decoded[rid] = (self.num_front + replica, back[replica].add(
            spec, rid, token_ids=self.keys[rid] + [SIM_TOKEN], arrival=t,
            output_len=spec.output_len - 1))
        back[replica].executor.preloaded.add(rid)

    def _finish(self, replica: int, done: list[Request]) -> None:
        """Tell the router about finished requests; when disaggregated, ship their KV onward."""
        for request in done:
            self.policy.on_finish(replica, self.keys[request.request_id])
            if self.back:   # the first token is out: ship the KV cache to the decode pool
                spec = self.requests[int(request.request_id)]
                if spec.output_len > 1:
                    ready = request.finished_time + spec.prompt_len * self.transfer_time_per_token
                    heapq.heappush(self.events, (ready, TRANSFER, int(request.request_id)))

    def outputs(self) -> list[SimOutput]:
        """One ``SimOutput`` per request, in input order, prefill and decode joined."""
        outputs = []
        for index, spec in enumerate(self.requests):
            replica, request = self.placed[str(index)]
            metrics = request_metrics(request)
            if str(index) in self.decoded:
                replica, second = self.decoded[str(index)]
                metrics = _joined(metrics, request_metrics(second), spec)
            outputs.append(SimOutput(str(index), spec, metrics,
                                     "length" if metrics.finished_time is not None else None,
                                     replica))
        return outputs


def _joined(prefill: RequestMetrics, decode: RequestMetrics, spec: RequestSpec) -> RequestMetrics:
    """One request's metrics across the two pools: first token from prefill, the rest from decode."""
    return RequestMetrics(
        arrival_time=prefill.arrival_time, first_scheduled_time=prefill.first_scheduled_time,
        first_token_time=prefill.first_token_time, finished_time=decode.finished_time,
        token_times=prefill.token_times + decode.token_times,
        num_prompt_tokens=spec.prompt_len,
        num_output_tokens=prefill.num_output_tokens + decode.num_output_tokens,
        num_cached_tokens=prefill.num_cached_tokens,
        num_preemptions=prefill.num_preemptions + decode.num_preemptions,
        schedule_log=prefill.schedule_log + decode.schedule_log)
