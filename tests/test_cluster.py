"""Simulated replicas behind a router, and prefill/decode disaggregation."""

from __future__ import annotations

import pytest

from tinyserve.sim.cluster import simulate_cluster
from tinyserve.hardware import LLAMA_7B, kv_bytes_per_token
from tinyserve.routing import RoutingPolicy
from tinyserve.sim import simulate
from tinyserve.workload import RequestSpec, make_workload


def test_one_replica_is_the_single_engine_simulator():
    specs = make_workload("mixed", 300, rate=20.0, seed=5)
    cluster = simulate_cluster(specs, num_replicas=1)
    single = simulate(specs)
    assert [o.metrics.token_times for o in cluster] == [o.metrics.token_times for o in single]


def test_routing_spreads_requests_and_every_block_comes_back():
    specs = make_workload("mixed", 400, rate=60.0, seed=1)
    result = simulate_cluster(specs, num_replicas=4, routing="round_robin")
    assert result.routed == [100, 100, 100, 100]
    assert [o.replica for o in result][:5] == [0, 1, 2, 3, 0]
    assert all(o.metrics.num_output_tokens == o.spec.output_len for o in result)
    assert all(e.block_manager.num_free_blocks == e.block_manager.num_blocks for e in result.engines)


def test_a_custom_policy_object_is_used():
    class AlwaysLast(RoutingPolicy):
        name = "always_last"

        def choose(self, key, outstanding):
            return len(outstanding) - 1
    result = simulate_cluster(make_workload("mixed", 50, rate=5.0), 3, AlwaysLast(3))
    assert result.routed == [0, 0, 50] and result.routing == "always_last"


def test_cache_aware_routing_raises_the_prefix_hit_rate():
    # 16 groups of a 1024-token prefix; each replica's cache holds only a few of them.
    specs = make_workload("shared-prefix", 600, rate=30.0, seed=0, num_prefix_groups=16,
                          prefix_len=1024)
    kw = dict(num_replicas=4, enable_prefix_caching=True, num_kv_blocks=600)
    rr = simulate_cluster(specs, routing="round_robin", **kw).summary()
    ca = simulate_cluster(specs, routing="cache_aware", **kw).summary()
    assert ca["prefix_cache_hit_rate"] > rr["prefix_cache_hit_rate"] + 0.1
    assert ca["mean_ttft"] < rr["mean_ttft"]


def test_disaggregated_requests_pay_the_kv_transfer_between_first_and_second_token():
    spec = RequestSpec(0.0, 1000, 5)
    bandwidth = 10e9
    result = simulate_cluster([spec], disaggregated=(1, 1), kv_link_bandwidth=bandwidth)
    out = result.outputs[0]
    m = out.metrics
    transfer = 1000 * kv_bytes_per_token(LLAMA_7B, "fp16") / bandwidth      # ~52 ms
    assert out.replica == 1 and m.num_output_tokens == 5 and len(m.token_times) == 5
    assert m.first_token_time == result.engines[0].steps[-1].start + result.engines[0].steps[-1].duration
    assert m.token_times[1] - m.token_times[0] >= transfer
    assert m.token_times[1] - m.token_times[0] < transfer + 0.05
    assert all(e.block_manager.num_free_blocks == e.block_manager.num_blocks for e in result.engines)


def test_disaggregation_keeps_prefill_out_of_decode_steps():
    specs = make_workload("long-in-short-out", 300, rate=20.0, seed=2)
    result = simulate_cluster(specs, disaggregated=(2, 2), record_batches=True)
    prefill_pool, decode_pool = result.engines[:2], result.engines[2:]
    assert all(s.num_decode_tokens == 0 for e in prefill_pool for s in e.steps)
    assert all(o.metrics.num_output_tokens == o.spec.output_len for o in result)
    # A decode replica takes each request's context (prompt + first token) once, in one
    # step or a few chunks, never again (no recompute), then one token per step.
    scheduled: dict[str, list[int]] = {}
    for engine in decode_pool:
        for step in engine.steps:
            for rid, n in step.batch:
                scheduled.setdefault(rid, []).append(n)
    assert len(scheduled) == sum(1 for spec in specs if spec.output_len > 1)
    for rid, counts in scheduled.items():
        spec, received, i = specs[int(rid)], 0, 0
        while received < spec.prompt_len + 1:
            received, i = received + counts[i], i + 1
        assert received == spec.prompt_len + 1 and counts[i:] == [1] * (spec.output_len - 2), rid
    # Taking a context is a KV write, not a prefill: no decode-pool step costs as much as
    # computing 512 prompt tokens did in the prefill pool.
    prefill_512 = min(s.duration for e in prefill_pool for s in e.steps if s.num_prefill_tokens >= 512)
    assert max(s.duration for e in decode_pool for s in e.steps) < prefill_512


def test_bad_arguments():
    specs = [RequestSpec(0.0, 10, 2)]
    with pytest.raises(ValueError, match="num_replicas must be an integer >= 1"):
        simulate_cluster(specs, num_replicas=0)
    with pytest.raises(ValueError, match=r"disaggregated must be \(num_prefill, num_decode\)"):
        simulate_cluster(specs, disaggregated=(0, 2))
    with pytest.raises(ValueError, match="kv_link_bandwidth must be > 0"):
        simulate_cluster(specs, kv_link_bandwidth=0)
    with pytest.raises(ValueError, match="longer than the model's context"):
        simulate_cluster([RequestSpec(0.0, 5000, 2)])
