"""Who runs in the next step, and for how many tokens.

Each call to ``Scheduler.schedule`` plans one forward pass under three limits:
seats (``max_num_seqs``), a token budget (``max_num_batched_tokens``) and free
KV blocks. Two batching modes share the code:

* ``continuous``: every step, requests that finished last step have already
  left (their blocks freed); running requests go first, then waiting ones are
  admitted while seats, budget and blocks allow.
* ``static``: a batch is formed only when nobody is running; it runs until its
  last member finishes, and nobody joins in between (finished members leave
  empty seats behind).

When a running request needs a block and none is free, the most recently
admitted request that holds blocks is *preempted by recompute*: its blocks are
freed and it goes back to the front of the queue; when re-admitted, its prompt
and the tokens it already produced are prefilled again, so its output does not
change. A member of a static batch that has not run yet holds no blocks:
preempting it would free nothing, so it keeps its seat and waits for blocks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tinyserve.kv_cache import BlockManager, blocks_for
from tinyserve.policies import Policy, make_policy
from tinyserve.request import Request, RequestStatus


# ---- configuration and plan -------------------------------------------------------

BATCHING_MODES = ("continuous", "static")


@dataclass
class SchedulerConfig:
    """Knob names and meanings follow vLLM's scheduler config."""
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256
    block_size: int = 16
    batching: str = "continuous"
    policy: str | Policy = "fcfs"   # a name in POLICIES or a Policy instance
    enable_chunked_prefill: bool = True
    max_model_len: int = 512

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.batching not in BATCHING_MODES:
            raise ValueError(f"batching: unknown batching mode {self.batching!r}; "
                             f"choose one of {list(BATCHING_MODES)}")
        make_policy(self.policy)


@dataclass(slots=True)     # one per request per step: keep it light
class ScheduledRequest:
    request: Request
    num_new_tokens: int           # tokens whose K/V this step computes
    block_table: list[int]
    # Does this step reach the request's last known token (so it emits one)?
    samples: bool = False
    # One new token after earlier outputs (not a prefill chunk or a recompute).
    is_decode: bool = False


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_waiting: int = 0          # queue length after this plan
    num_running: int = 0

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.policy = make_policy(config.policy)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []    # in admission order
        self.num_preemptions = 0

    # ---- queue ---------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str, now: float) -> Request | None:
        for queue in (self.running, self.waiting):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    self._finish(request, "abort", now)
                    return request
        return None

    # ---- planning --------------------------------------------------------------

    def schedule(self, now: float) -> SchedulerOutput:
        cfg = self.config
        out = SchedulerOutput()
        budget = cfg.max_num_batched_tokens

        if cfg.batching == "static" and not self.running:
            # Form a new batch: seats are the only limit here; the token budget and
            # blocks are applied below as its members get scheduled.
            while self.waiting and len(self.running) < cfg.max_num_seqs:
                index = self.policy.select(self.waiting, now, self.running)
                if index is None:
                    break
                self._admit(self.waiting[index])
                del self.waiting[index]

        if self.policy.prefill_first and cfg.batching == "continuous":
            # Prefill-only steps while there is prompt work; decodes wait for a step
            # with no prefill in it.
            budget = self._schedule_running(out, budget, now, prefills_only=True)
            if not out.preempted:
                budget = self._admit_waiting(out, budget, now)
            if out.scheduled:
                return self._finish_plan(out)

        # 1. Running requests first (decodes and unfinished prefill chunks).
        budget = self._schedule_running(out, budget, now)
        # 2. Admit waiting requests (continuous batching only), unless we just had
        #    to preempt: then the cache is full and admitting would thrash.
        if cfg.batching == "continuous" and not out.preempted:
            self._admit_waiting(out, budget, now)
        return self._finish_plan(out)

    def _finish_plan(self, out: SchedulerOutput) -> SchedulerOutput:
        out.num_waiting, out.num_running = len(self.waiting), len(self.running)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, now: float,
                          prefills_only: bool = False) -> int:
        bm = self.block_manager
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if prefills_only and not request.is_prefilling:
                i += 1
                continue
            if not request.prefix_checked:
                # A static batch's new member: reuse cached prefix blocks if they fit.
                hits = self._prefix_hits(request)
                if bm.num_blocks_to_claim(hits) > bm.num_free_blocks:
                    hits = []
                self._claim_prefix(request, hits)
            n = self._tokens_to_run(request, budget)
            if n == 0:                      # a whole prompt that does not fit this step
                i += 1
                continue
            fits = bm.can_allocate(request.request_id, request.num_computed_tokens + n)
            while not fits:
                victim = self._victim(i)
                if victim is None:
                    break
                self.running.remove(victim)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
                fits = bm.can_allocate(request.request_id, request.num_computed_tokens + n)
            if request.status is RequestStatus.PREEMPTED:
                break
            if not fits:
                i += 1                      # holds no blocks, and none can be freed for it
                continue
            out.scheduled.append(self._schedule(request, n, now))
            budget -= n
            i += 1
        return budget

    def _victim(self, start: int) -> Request | None:
        """The most recently admitted of ``running[start:]`` (not yet scheduled this step)
        that holds blocks, or None."""
        for request in reversed(self.running[start:]):
            if self.block_manager.block_table(request.request_id):
                return request
        return None

    def _admit_waiting(self, out: SchedulerOutput, budget: int, now: float) -> int:
        bm = self.block_manager
        while self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0:
            index = self.policy.select(self.waiting, now, self.running)
            if index is None:
                break
            request = self.waiting[index]
            hits = self._prefix_hits(request)
            cached = len(hits) * bm.block_size
            n = self._tokens_to_run(request, budget, cached)
            need = (blocks_for(cached + n, bm.block_size) - len(hits)
                    + bm.num_blocks_to_claim(hits))
            if n == 0 or need > bm.num_free_blocks:
                break
            del self.waiting[index]
            self._admit(request)
            self._claim_prefix(request, hits)
            out.scheduled.append(self._schedule(request, n, now))
            budget -= n
        return budget

    def _tokens_to_run(self, request: Request, budget: int, cached: int = 0) -> int:
        remaining = request.num_tokens - max(request.num_computed_tokens, cached)
        if self.config.enable_chunked_prefill:
            return min(remaining, budget)
        return remaining if remaining <= budget else 0

    def _prefix_hits(self, request: Request) -> list[int]:
        """Cached blocks a request with nothing computed yet could start from."""
        if request.num_computed_tokens or not self.block_manager.enable_prefix_caching:
            return []
        # Only a preempted request has output tokens to look up: no prompt copy otherwise.
        tokens = request.all_token_ids if request.output_token_ids else request.prompt_token_ids
        return self.block_manager.find_cached_prefix(tokens, request.block_hashes)

    def _claim_prefix(self, request: Request, hits: list[int]) -> None:
        request.prefix_checked = True
        request.block_hashes = []
        if not self.block_manager.enable_prefix_caching:
            return
        cached = self.block_manager.claim_cached_prefix(request.request_id, hits, request.num_tokens)
        request.num_computed_tokens = cached
        if not request.cached_tokens_per_admission:
            request.num_cached_tokens = cached
        request.cached_tokens_per_admission.append(cached)

    def _admit(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _schedule(self, request: Request, n: int, now: float) -> ScheduledRequest:
        self.block_manager.allocate(request.request_id, request.num_computed_tokens + n)
        if request.first_scheduled_time is None:
            request.first_scheduled_time = now
        request.schedule_log.append((now, n))
        remaining = request.num_tokens - request.num_computed_tokens
        # The live table (no copy): valid for this step, which is all the executor needs.
        return ScheduledRequest(request, n, self.block_manager.block_table(request.request_id),
                                samples=n == remaining,
                                is_decode=bool(request.output_token_ids) and remaining == 1)

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.prefix_checked = False
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ---- after the forward pass ---------------------------------------------------

    def update(self, out: SchedulerOutput, sampled: dict[str, int], now: float) -> list[Request]:
        """Record the step's results; retire finished requests and free their blocks."""
        finished = []
        bm = self.block_manager
        for item in out.scheduled:
            request = item.request
            request.num_computed_tokens += item.num_new_tokens
            bm.cache_full_blocks(request.request_id, request.num_computed_tokens,
                                 request.token_ids_between)
            if not item.samples:
                continue
            request.output_token_ids.append(sampled[request.request_id])
            request.token_times.append(now)
            if request.first_token_time is None:
                request.first_token_time = now
            reason = request.check_stop(self.config.max_model_len)
            if reason is not None:
                self.running.remove(request)
                self._finish(request, reason, now)
                finished.append(request)
        return finished

    def _finish(self, request: Request, reason: str, now: float) -> None:
        self.block_manager.free(request.request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finished_time = now
