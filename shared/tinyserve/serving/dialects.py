"""Which Prometheus metric means what, in tinyserve's, vLLM's and SGLang's ``/metrics``.

The live diagnosis (``tinyserve.serving.live_diagnose``) needs the same dozen
quantities from every engine: running and waiting requests, KV-cache usage,
finished requests, token counters, prefix-cache lookups and hits, preemptions,
and the TTFT, TPOT, inter-token, end-to-end and queue-time histograms. Each
engine names them its own way, and vLLM renamed several between versions, so
each role lists the names that carry it, the current one first; the one found
is reported with its note. Names are as they appear on the wire (a counter's
``_total`` included; a histogram by its family name, without ``_bucket``).

Where the names come from (read with the search tool, not copied):

* vLLM, ``vllm/v1/metrics/loggers.py`` (``PrometheusStatLogger``):
  commit a6f0308cfe806b7731ad4979c9bea6e470c35efd (the v0.8 line: ``gpu_cache_usage_perc``,
  ``gpu_prefix_cache_{queries,hits}`` counted in blocks, ``time_per_output_token_seconds``
  observed once per generated token); commit 005a810bc40faa25b8870fbc8559c3462581eee3
  (the v0.10 line: ``kv_cache_usage_perc`` and ``prefix_cache_{queries,hits}`` in tokens,
  the ``gpu_*`` names "deprecated in 0.9"); and the v0.12 line as stored in the search
  index ("Deprecated in 0.11 - Renamed as vllm:inter_token_latency_seconds ... remove in
  0.13.0"): the v0.11 line adds ``inter_token_latency_seconds`` beside the old name, the
  v0.12 line the per-request ``request_time_per_output_token_seconds``; later lines add
  reuse through a KV connector
  (``external_prefix_cache_{queries,hits}``, ``prompt_tokens_by_source`` with ``source`` =
  local_compute / local_cache_hit / external_kv_transfer, and ``prompt_tokens_cached``,
  local + external). ``docs/design/metrics.md`` at
  f7e3a0879e633f9924d477b85a3775cb1ae2a2e5 lists the v1 set with types.
* SGLang, ``python/sglang/srt/metrics/collector.py``: commit 93d04878cfb9b08645fae7b11bd340ee33b34acf
  (``num_running_reqs``, ``num_queue_reqs``, ``token_usage``, ``cache_hit_rate``,
  ``queue_time_seconds``, and in ``TokenizerMetricsCollector`` the token and request
  counters, ``cached_tokens_total`` and the TTFT / inter-token / e2e histograms) and
  commit 00ae9c1590d2d0bb6c0bfff39e312c34ae3dd538 (adds the ``num_retracted_requests_total``
  counter: SGLang calls a preemption a retraction); ``TokenizerMetricsCollector``'s
  ``num_aborted_requests_total`` counts aborts apart from ``num_requests_total``.
  Scheduler metrics carry ``engine_type``, ``tp_rank`` and ``pp_rank`` labels besides
  ``model_name`` (one series per rank; the ranks of one group report the same batch).
  ``docs/references/production_metrics.md``
  at 40ef116f011cf1599811af1089ddf00971092bcf shows the older ``time_per_output_token_seconds``,
  whose count matches the generated tokens: it too was per token.
* tinyserve: ``tinyserve.serving.app`` (``/metrics``, the ``tinyserve:`` prefix, a
  ``model_name`` label). It has no inter-token or queue-time histogram; its tokens per
  step carry vLLM's name (``iteration_tokens_total``), in power-of-two buckets.

Per-token histograms (vLLM's ``inter_token_latency_seconds`` and its older name,
SGLang's) are inter-token latency (ITL), not TPOT: TPOT is one number per request.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Every role: the Prometheus type that carries it, and what it is.
ROLES = {
    "running": ("gauge", "running-requests gauge"),
    "waiting": ("gauge", "waiting-requests gauge"),
    "kv_usage": ("gauge", "KV-cache usage gauge"),
    "prefix_hit_rate": ("gauge", "prefix-cache hit-rate gauge"),
    "finished": ("counter", "finished-requests counter"),
    "rejected": ("counter", "rejected-requests counter"),
    "aborted": ("counter", "aborted-requests counter counted apart from the finished ones"),
    "prompt_tokens": ("counter", "prompt-token counter"),
    "generation_tokens": ("counter", "generated-token counter"),
    "prefix_queries": ("counter", "prefix-cache lookup counter"),
    "prefix_hits": ("counter", "prefix-cache hit counter"),
    "cached_prompt_tokens": ("counter", "counter of prompt tokens served from any cache (local + KV connector)"),
    "prompt_by_source": ("counter", "prompt-token counter by source (computed, local hit, KV transfer)"),
    "external_queries": ("counter", "KV-connector (external) prefix-cache lookup counter"),
    "external_hits": ("counter", "KV-connector (external) prefix-cache hit counter"),
    "preemptions": ("counter", "preemption counter"),
    "ttft": ("histogram", "TTFT histogram"),
    "tpot": ("histogram", "per-request TPOT histogram"),
    "itl": ("histogram", "inter-token latency histogram"),
    "e2e": ("histogram", "end-to-end latency histogram"),
    "queue_time": ("histogram", "queue-time histogram"),
    "step_tokens": ("histogram", "tokens-per-step histogram"),
}
#: Roles whose names are distinct outcomes to add up, not alternatives.
SUMMED = {"finished"}
#: Gauges that are fractions: averaged over series instead of summed.
FRACTIONS = {"kv_usage", "prefix_hit_rate"}


@dataclass(frozen=True)
class Name:
    metric: str
    note: str = ""          # the version it belongs to, or what is special about it

    def __str__(self) -> str:
        return f"{self.metric} ({self.note})" if self.note else self.metric


@dataclass(frozen=True)
class Dialect:
    engine: str
    prefix: str
    names: dict             # role -> tuple of Name, preferred first

    def candidates(self, role: str) -> tuple:
        return self.names.get(role, ())


def names(*items) -> tuple:
    return tuple(Name(*item) if isinstance(item, tuple) else Name(item) for item in items)


TINYSERVE = Dialect("tinyserve", "tinyserve:", {
    "running": names("tinyserve:num_requests_running"),
    "waiting": names("tinyserve:num_requests_waiting"),
    "kv_usage": names("tinyserve:kv_cache_usage_perc"),
    "finished": names("tinyserve:request_success_total", "tinyserve:request_abort_total",
                      "tinyserve:request_failure_total"),
    "rejected": names("tinyserve:request_rejected_total"),
    "prompt_tokens": names("tinyserve:prompt_tokens_total"),
    "generation_tokens": names("tinyserve:generation_tokens_total"),
    "prefix_queries": names("tinyserve:prefix_cache_queries_total"),
    "prefix_hits": names("tinyserve:prefix_cache_hits_total"),
    "prefix_hit_rate": names(("tinyserve:prefix_cache_hit_rate", "since the server started")),
    "preemptions": names("tinyserve:num_preemptions_total"),
    "ttft": names("tinyserve:time_to_first_token_seconds"),
    "tpot": names(("tinyserve:time_per_output_token_seconds", "per request")),
    "e2e": names("tinyserve:e2e_request_latency_seconds"),
    "step_tokens": names(("tinyserve:iteration_tokens_total", "tokens per engine step")),
})

VLLM = Dialect("vllm", "vllm:", {
    "running": names("vllm:num_requests_running"),
    "waiting": names("vllm:num_requests_waiting"),
    "kv_usage": names("vllm:kv_cache_usage_perc",
                      ("vllm:gpu_cache_usage_perc", "vLLM < 0.10 name, deprecated in 0.9")),
    # finished_reason="stop" | "length" | "abort": every finished request.
    "finished": names("vllm:request_success_total"),
    "prompt_tokens": names("vllm:prompt_tokens_total"),
    "generation_tokens": names("vllm:generation_tokens_total"),
    "prefix_queries": names("vllm:prefix_cache_queries_total",
                            ("vllm:gpu_prefix_cache_queries_total", "vLLM < 0.10 name; v0.8 counted blocks")),
    "prefix_hits": names("vllm:prefix_cache_hits_total",
                         ("vllm:gpu_prefix_cache_hits_total", "vLLM < 0.10 name; v0.8 counted blocks")),
    "prefix_hit_rate": names(("vllm:gpu_prefix_cache_hit_rate", "vLLM v0 engine gauge")),
    # Reuse through a KV connector (LMCache, NIXL...) as well as the local prefix cache.
    "cached_prompt_tokens": names(("vllm:prompt_tokens_cached_total", "local + external (KV connector)")),
    "prompt_by_source": names(("vllm:prompt_tokens_by_source_total",
                               "source = local_compute | local_cache_hit | external_kv_transfer")),
    "external_queries": names(("vllm:external_prefix_cache_queries_total", "KV connector")),
    "external_hits": names(("vllm:external_prefix_cache_hits_total", "KV connector")),
    "preemptions": names("vllm:num_preemptions_total"),
    "ttft": names("vllm:time_to_first_token_seconds"),
    "tpot": names(("vllm:request_time_per_output_token_seconds", "per request; added after the v0.11 line")),
    "itl": names(("vllm:inter_token_latency_seconds", "vLLM >= 0.11"),
                 ("vllm:time_per_output_token_seconds",
                  "the per-token gaps' name before 0.11; deprecated in 0.11, hidden in 0.12, removed in 0.13")),
    "e2e": names("vllm:e2e_request_latency_seconds"),
    "queue_time": names("vllm:request_queue_time_seconds"),
    # Tokens scheduled per engine step (prefill + decode): pinned at one value while
    # requests wait, it is the --max-num-batched-tokens budget that holds them back.
    "step_tokens": names(("vllm:iteration_tokens_total", "tokens per engine step")),
})

SGLANG = Dialect("sglang", "sglang:", {
    "running": names("sglang:num_running_reqs"),
    "waiting": names("sglang:num_queue_reqs"),
    "kv_usage": names(("sglang:token_usage", "share of KV-cache token slots in use")),
    "finished": names("sglang:num_requests_total"),
    # The tokenizer manager counts an abort (a client that hung up) here, and a request
    # aborted while waiting never reaches num_requests_total.
    "aborted": names(("sglang:num_aborted_requests_total", "aborts, counted apart from num_requests_total")),
    # Prompt tokens of finished requests are what the radix cache was asked for.
    "prefix_queries": names(("sglang:prompt_tokens_total", "prompt tokens: what the radix cache is asked")),
    "prefix_hits": names("sglang:cached_tokens_total"),
    "prefix_hit_rate": names(("sglang:cache_hit_rate", "gauge of the last batches")),
    "prompt_tokens": names("sglang:prompt_tokens_total"),
    "generation_tokens": names("sglang:generation_tokens_total"),
    "preemptions": names(("sglang:num_retracted_requests_total", "retractions; newer SGLang")),
    "ttft": names("sglang:time_to_first_token_seconds"),
    "itl": names("sglang:inter_token_latency_seconds",
                 ("sglang:time_per_output_token_seconds", "older SGLang name of the per-token gaps")),
    "e2e": names("sglang:e2e_request_latency_seconds"),
    "queue_time": names("sglang:queue_time_seconds"),
})

DIALECTS = {d.engine: d for d in (TINYSERVE, VLLM, SGLANG)}
