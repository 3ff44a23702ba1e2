"""The engine loop: requests in, one scheduled forward pass per step, tokens out.

``LLMEngine`` is the step-by-step interface a server drives (add_request, step,
abort); ``LLM`` wraps it for offline use: ``LLM("tiny").generate(prompts)``.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from tinyserve import packed_gemm
from tinyserve.checkpoint import load_pretrained, save_pretrained, saved_dtype
from tinyserve.compiled_step import CAPTURE_SIZES, capture_sizes_for
from tinyserve.core import DEFAULT_STEP_STATS_WINDOW, EngineCore
from tinyserve.executor import ModelExecutor
from tinyserve.hf_tokenizer import load_checkpoint_tokenizer
from tinyserve.kv_cache import BlockManager, blocks_for
from tinyserve.metrics import RequestMetrics, StepStats, request_metrics
from tinyserve.model import TRAINED_MODELS, LlamaForServing, default_device, get_preset
from tinyserve.request import Request, SamplingParams
from tinyserve.scheduler import SchedulerConfig
from tinyserve.tokenizer import (TOKENIZER_FILE, ByteBPETokenizer, StreamDetokenizer,  # noqa: F401
                                 load_default_tokenizer)

Prompt = str | Sequence[int]
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tokenized:
    """A validated prompt with its token ids, and when its tokenization started and ended."""
    prompt: Prompt
    token_ids: list[int]
    received: float
    done: float


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    request: Request = field(repr=False)
    text: str | None = None         # filled when finished
    new_text: str = ""              # printable text added by this step (streaming)
    num_output_tokens: int = 0      # output length at this step

    @property
    def token_ids(self) -> list[int]:
        """Every output token up to this step (copied when read: a streamed token costs O(1))."""
        return self.request.output_token_ids[:self.num_output_tokens]

    @property
    def new_token_ids(self) -> list[int]:
        """The token this step produced (for streaming)."""
        return self.request.output_token_ids[self.num_output_tokens - 1:self.num_output_tokens]

    @property
    def metrics(self) -> RequestMetrics:
        """The request's timings, built when read (streaming never pays for them)."""
        return request_metrics(self.request)


class LLMEngine:
    """The real engine: tokenization and streaming text around ``core.EngineCore``
    running ``ModelExecutor``. ``step_stats`` keeps the last ``step_stats_window`` steps."""

    def __init__(self, model: LlamaForServing, tokenizer: ByteBPETokenizer,
                 config: SchedulerConfig, num_kv_blocks: int, seed: int = 0,
                 clock: Callable[[], float] = time.perf_counter,
                 enable_prefix_caching: bool = False,
                 step_stats_window: int | None = DEFAULT_STEP_STATS_WINDOW,
                 enforce_eager: bool | None = True, capture_sizes: tuple[int, ...] = CAPTURE_SIZES):
        if model.config.vocab_size < tokenizer.vocab_size:
            raise ValueError(f"model: vocab_size {model.config.vocab_size} is smaller than the "
                             f"tokenizer's {tokenizer.vocab_size}")
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.clock = clock
        self.block_manager = BlockManager(num_kv_blocks, config.block_size, enable_prefix_caching)
        # A model may have more output rows than its tokenizer has tokens (Qwen pads its
        # vocabulary): never sample an id that cannot be detokenized.
        self.executor = ModelExecutor(
            model, num_kv_blocks, config.block_size, seed=seed, vocab_size=tokenizer.vocab_size,
            enforce_eager=enforce_eager,
            max_blocks_per_seq=blocks_for(config.max_model_len, config.block_size),
            capture_sizes=capture_sizes_for(config.max_num_seqs, capture_sizes))
        self.core = EngineCore(config, self.block_manager, self.executor, clock,
                               step_stats_window=step_stats_window)
        self.scheduler = self.core.scheduler
        self.step_stats = self.core.step_stats
        self.last_step: StepStats | None = None     # kept whatever step_stats_window is
        self.requests: dict[str, Request] = {}
        self._detokenizers: dict[str, StreamDetokenizer] = {}
        self._ids = itertools.count()
        # Checkpoints may end a turn with several ids (Llama-3: <|eot_id|> and
        # <|end_of_text|>; generation_config.json lists them).
        self._extra_eos = tuple(t for t in getattr(tokenizer, "eos_token_ids", ())
                                if t != tokenizer.eos_token_id)

    # ---- input -------------------------------------------------------------------

    def to_token_ids(self, prompt: Prompt) -> list[int]:
        """Validate a prompt (text or token ids) and return its token ids."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple)):
            raise ValueError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}")
        if not prompt:
            raise ValueError("prompt must not be empty")
        vocab = self.model.config.vocab_size
        for t in prompt:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"prompt token id {t!r} is outside the vocabulary [0, {vocab})")
        return list(prompt)

    def check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Reject a request the engine could never finish, before it takes a seat."""
        self.core.check_fits(num_prompt_tokens, params.max_tokens)

    def tokenize(self, prompt: Prompt | Tokenized) -> Tokenized:
        """Validate a prompt and tokenize it once, timing the encode (``LLM.generate``
        checks every prompt this way before adding any)."""
        if isinstance(prompt, Tokenized):
            return prompt
        received = self.clock()
        ids = self.to_token_ids(prompt)          # tokenization happens here, on the CPU
        return Tokenized(prompt, ids, received, self.clock())

    def add_request(self, prompt: Prompt | Tokenized, params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    priority: int = 0) -> str:
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        tokenized = self.tokenize(prompt)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text = tokenized.prompt if isinstance(tokenized.prompt, str) else None
        request = Request(request_id, tokenized.token_ids, params,
                          arrival_time=tokenized.received if arrival_time is None else arrival_time,
                          prompt=text, eos_token_id=self.tokenizer.eos_token_id,
                          priority=priority, extra_eos_token_ids=self._extra_eos)
        request.tokenize_time = tokenized.done - tokenized.received
        request.queued_time = tokenized.done
        self.core.add_request(request)            # raises if it could never finish
        self.requests[request_id] = request
        self._detokenizers[request_id] = StreamDetokenizer(self.tokenizer)
        return request_id

    def abort(self, request_id: str) -> bool:
        if self.core.abort(request_id) is None:
            return False
        del self.requests[request_id]
        del self._detokenizers[request_id]
        return True

    def forget(self, request_id: str) -> None:
        """Drop a finished request the caller will not read (a step that failed after
        retiring it); its blocks are already free."""
        self.requests.pop(request_id, None)
        self._detokenizers.pop(request_id, None)

    def isolate_sample_failures(self) -> None:
        """A server's mode: a request whose sampling raises fails alone
        (``take_sample_failures``); the rest of its step goes on."""
        self.executor.isolate_sample_failures()

    def take_sample_failures(self) -> dict[str, Exception]:
        """Requests whose sampling raised since the last call (id -> error)."""
        return self.executor.take_sample_failures()

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    # ---- the loop ----------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step of the core loop; returns the requests that emitted a token."""
        result = self.core.step()
        self.last_step = result.stats
        outputs = [self._output(item.request) for item in result.plan.scheduled if item.samples]
        for request in result.finished:
            del self.requests[request.request_id]
            del self._detokenizers[request.request_id]
        return outputs

    def _output(self, request: Request) -> RequestOutput:
        done = request.is_finished
        # Streaming detokenization: only whole characters leave, never half of one.
        started = self.clock()
        detokenizer = self._detokenizers[request.request_id]
        new_text = detokenizer.push(request.output_token_ids[-1])
        if done:
            new_text += detokenizer.flush()
        request.detokenize_time += self.clock() - started
        return RequestOutput(
            request_id=request.request_id, prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            finished=done, finish_reason=request.finish_reason, request=request,
            text=detokenizer.text if done else None, new_text=new_text,
            num_output_tokens=len(request.output_token_ids))


# ---- the offline front door ---------------------------------------------------------

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
AUTO_DTYPE = "auto"     # a checkpoint's own dtype (config.json); float32 for presets


class LLM:
    """Offline batch generation, with vLLM's knob names.

    ``model`` is a preset name (random weights from ``seed``) or a Hugging Face
    checkpoint directory (Llama, Mistral, Qwen2, Qwen3). ``dtype="auto"`` keeps the
    checkpoint's saved dtype. ``num_kv_blocks=None`` sizes the cache to hold
    ``max_num_seqs`` full-length requests, within ``kv_cache_memory`` bytes.
    ``kernels="triton"`` runs the memory-bound ops as fused Triton kernels
    (in Triton's interpreter when there is no GPU: correct, but slow).
    ``step_stats_window``: how many recent steps ``engine.step_stats`` keeps.
    ``enforce_eager=False``: on a CPU (fp32; bf16 where oneDNN packs it) every step
    runs on weights packed once for oneDNN, which replace the dense ones
    (``packed_gemm.py``); bf16 on a CPU without native bf16 keeps its weights and
    computes GEMMs of several rows in fp32 (``packed_gemm.UpcastLinear``); elsewhere pure decode steps of each batch bucket up to
    ``max_num_seqs`` run on one compiled graph per bucket (``torch.compile``;
    ``compiled_step.py``). ``None`` picks the default (``default_enforce_eager``:
    on a CPU whose oneDNN packs the dtype, packed if a decode step timed at start
    found that faster, else eager; bf16 without native bf16: the fp32 compute; the choice is logged and kept in
    ``engine.executor.decode_path``).
    """

    def __init__(self, model: str = "tiny", seed: int = 0, max_num_seqs: int = 8,
                 max_num_batched_tokens: int = 256, block_size: int = 16,
                 num_kv_blocks: int | None = None, enable_prefix_caching: bool = True,
                 enable_chunked_prefill: bool = True, batching: str = "continuous",
                 policy: str = "fcfs", max_model_len: int | None = None,
                 dtype: str = "float32", device: str | None = None, kernels: str = "torch",
                 kv_cache_memory: int = 512 * 2**20,
                 step_stats_window: int | None = DEFAULT_STEP_STATS_WINDOW,
                 enforce_eager: bool | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        if enforce_eager not in (None, True, False):
            raise ValueError(f"enforce_eager must be True, False or None, got {enforce_eager!r}")
        if dtype not in DTYPES and dtype != AUTO_DTYPE:
            raise ValueError(f"dtype: unknown dtype {dtype!r}; choose one of "
                             f"{sorted(DTYPES) + [AUTO_DTYPE]}")
        net, tokenizer = load_model(model, seed, dtype, device or default_device())
        net.use_kernels(kernels)
        self.model = net
        self.tokenizer = tokenizer
        torch_dtype = net.lm_head.weight.dtype
        context = net.config.max_position_embeddings
        if max_model_len is None:
            max_model_len = context
        elif not isinstance(max_model_len, int) or not 1 <= max_model_len <= context:
            raise ValueError(f"max_model_len must be in [1, {context}], got {max_model_len!r}")
        config = SchedulerConfig(max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=max_num_batched_tokens,
                                 block_size=block_size, batching=batching, policy=policy,
                                 enable_chunked_prefill=enable_chunked_prefill,
                                 max_model_len=max_model_len)
        if num_kv_blocks is None:
            per_block = net.config.kv_bytes_per_token(torch_dtype) * block_size
            wanted = max_num_seqs * blocks_for(max_model_len, block_size)
            num_kv_blocks = max(1, min(wanted, kv_cache_memory // per_block))
        elif not isinstance(num_kv_blocks, int) or num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be an integer >= 1, got {num_kv_blocks!r}")
        self.engine = LLMEngine(self.model, tokenizer, config, num_kv_blocks, seed=seed, clock=clock,
                                enable_prefix_caching=enable_prefix_caching,
                                step_stats_window=step_stats_window,
                                enforce_eager=(default_enforce_eager(net) if enforce_eager is None
                                               else enforce_eager))
        path = self.engine.executor.decode_path
        if path is not None:
            log.info("decode path: %s", path.describe())

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in prompt order."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: got {len(params)} for {len(prompts)} prompts")
        engine = self.engine
        # Validate (and tokenize, once) everything first so that one bad prompt adds nothing.
        tokenized = []
        for prompt, p in zip(prompts, params):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params must be SamplingParams, got {type(p).__name__}")
            tokenized.append(engine.tokenize(prompt))
            engine.check_fits(len(tokenized[-1].token_ids), p)
        ids = [engine.add_request(t, p) for t, p in zip(tokenized, params)]
        results: dict[str, RequestOutput] = {}
        wanted = set(ids)
        bar = _progress(len(ids), use_tqdm)
        while len(results) < len(ids):
            if not engine.has_unfinished_requests():
                raise RuntimeError("engine stopped with requests unfinished")
            for out in engine.step():
                if out.finished and out.request_id in wanted:
                    results[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [results[i] for i in ids]

    def save_pretrained(self, path: str | Path) -> Path:
        with self.engine.executor.dense_weights():
            path = save_pretrained(self.model, path, self.tokenizer)
        self.tokenizer.save(Path(path) / TOKENIZER_FILE)
        return path


def default_enforce_eager(model: LlamaForServing) -> bool | None:
    """``enforce_eager=None``: a faster path where it pays and costs little at start.
    On a CPU whose oneDNN packs the weights' dtype (``packed_gemm.packs``): None, pack
    them (about a second) only if the first layers of a decode step, timed both ways at
    start, ran faster packed in some bucket. That holds for weights that stay in the
    last-level cache too: eager ``F.linear`` re-lays a weight out on every call, which
    costs the most where a GEMM is small (the 4 M-parameter ``small`` on an AMD EPYC
    Zen 5, 32 MiB L3: 4-row decode steps 2.2 ms eager, 1.05 ms packed). On a GPU,
    compiled CUDA graphs cost a compile per bucket at every start and have not been
    measured on hardware yet: eager there, as for fp16 on a CPU. Bf16 weights on a CPU
    without native bf16: None, and every step runs on them with fp32 compute wherever
    that is faster (``packed_gemm.UpcastLinear``; nothing is copied)."""
    return True if packed_gemm.form(model) is None else None


def _progress(total: int, use_tqdm: bool | None):
    if use_tqdm is None:
        use_tqdm = total >= 64
    if not use_tqdm:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc="generate", unit="req")


def load_model(model: str, seed: int, dtype: str = "float32",
               device: torch.device | str = "cpu") -> tuple[LlamaForServing, ByteBPETokenizer]:
    """A checkpoint directory (loaded straight into ``dtype`` on ``device``) or a preset
    (random weights from ``seed``), with its tokenizer."""
    if not isinstance(model, (str, Path)):
        raise ValueError(f"model must be a preset name or a directory, got {type(model).__name__}")
    path = TRAINED_MODELS.get(str(model), Path(model))
    if path.is_dir() and (path / "config.json").exists():
        name = saved_dtype(path) if dtype == AUTO_DTYPE else dtype
        if name not in DTYPES:
            raise ValueError(f"dtype: {name!r} ({path / 'config.json'} for auto) is not one "
                             f"of {sorted(DTYPES)}")
        net = load_pretrained(path, dtype=DTYPES[name], device=device)
        return net, load_tokenizer(path)
    net = LlamaForServing.from_seed(get_preset(str(model)), seed)
    torch_dtype = torch.float32 if dtype == AUTO_DTYPE else DTYPES[dtype]
    return net.to(device=device, dtype=torch_dtype), load_default_tokenizer()


def load_tokenizer(path: Path):
    """The tokenizer of a checkpoint directory: ours when it was saved with it
    (``LLM.save_pretrained``), else the checkpoint's own ``tokenizer.json``, else our
    default one (a directory of bare weights, e.g. made by hand for a test)."""
    tokenizer_file = path / TOKENIZER_FILE
    if tokenizer_file.exists():
        return ByteBPETokenizer.load(tokenizer_file)
    own = load_checkpoint_tokenizer(path)
    return own if own is not None else load_default_tokenizer()
