"""tinyserve against the library a reader would otherwise use, on the same weights:
``python -m tinyserve.bench peer [--model cpu-bench] [--quick] [--out FILE]``.

One process, one checkpoint (a preset's random weights handed to transformers'
``LlamaForCausalLM`` tensor for tensor, or a checkpoint directory both load),
one workload: prompts of mixed lengths, greedy, with at most B requests at a
time. transformers' ``generate`` runs them as static batches of B (left
padded; a batch runs until its longest output is done), its
``generate_batch`` (continuous batching, where this transformers has it) and
tinyserve (eager and ``enforce_eager=False``) take them all at once. Every
engine's greedy tokens are compared with transformers' ``generate``; the
table gives output tokens per second and each engine's ratio to ``generate``.

``--engine vllm`` puts a real vLLM (its CPU build) beside tinyserve instead:
``bench.vllm_peer``.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

PROMPT_LENS = (32, 192)       # prompt tokens, uniform in this range
FIXED_NEW = 64
MIXED_NEW = (16, 128)         # output tokens of the mixed-length scenario
BATCHED_TOKENS = 512          # tokens per engine step, for every engine that has such a limit


@dataclass(frozen=True)
class Scenario:
    name: str
    concurrency: int          # B: requests running at once
    requests: int
    mixed_outputs: bool = False

    def workload(self, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
        rng = random.Random(f"{seed}:{self.name}")
        prompts = [[rng.randrange(10, vocab) for _ in range(rng.randint(*PROMPT_LENS))]
                   for _ in range(self.requests)]
        news = [rng.randint(*MIXED_NEW) if self.mixed_outputs else FIXED_NEW
                for _ in range(self.requests)]
        return prompts, news


SCENARIOS = (Scenario("B=1", 1, 2), Scenario("B=8", 8, 16), Scenario("B=32", 32, 32),
             Scenario("B=32, mixed outputs", 32, 32, mixed_outputs=True))
QUICK = (Scenario("B=1", 1, 1), Scenario("B=16, mixed outputs", 16, 16, mixed_outputs=True))


def hf_model(net, device="cpu"):
    """``transformers.LlamaForCausalLM`` holding ``net``'s very tensors (names line up)."""
    import transformers

    from tinyserve.checkpoint import hf_config
    c = net.config
    hf = {k: v for k, v in hf_config(c, None, None, net.lm_head.weight.dtype).items()
          if k not in ("architectures", "model_type", "torch_dtype")}
    # Built for real, not on meta: its non-persistent buffers (RoPE) are made at init.
    # In the weights' dtype, so the throwaway init is 13 GB for 7B, not 27.
    default = torch.get_default_dtype()
    torch.set_default_dtype(net.lm_head.weight.dtype)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf))
    finally:
        torch.set_default_dtype(default)
    model.load_state_dict(net.state_dict(), assign=True)                      # no copy
    return model.eval()


def load_reference(model: str, net):
    """transformers' model of the same weights: the checkpoint directory itself, or the
    preset's tensors."""
    import transformers

    if Path(model).is_dir():
        return transformers.AutoModelForCausalLM.from_pretrained(
            model, dtype=net.lm_head.weight.dtype).eval()
    return hf_model(net, net.lm_head.weight.device)


def no_stop(hf) -> None:
    # Greedy to the requested length: no EOS stop (and no EOS masking, which
    # min_new_tokens would do), as tinyserve's ignore_eos.
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0


def hf_static(hf, prompts, news, batch: int) -> list[list[int]]:
    """``generate`` on static, left-padded batches of ``batch`` prompts in arrival order."""
    out = []
    for i in range(0, len(prompts), batch):
        group, wanted = prompts[i:i + batch], news[i:i + batch]
        width = max(map(len, group))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        with torch.inference_mode():
            gen = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(wanted),
                              do_sample=False)
        out += [row[width:width + n] for row, n in zip(gen.tolist(), wanted)]
    return out


def hf_continuous(hf, prompts, news, batch: int) -> list[list[int]] | None:
    """``generate_batch`` (transformers' continuous batching), or None where this
    transformers lacks it. It takes one output length for all: the longest.

    Its limits are tinyserve's: ``batch`` requests and ``BATCHED_TOKENS`` per step, a
    cache just large enough for the workload. Left to itself it sizes the cache from
    free memory (90% of it, gigabytes on a CPU) and spends most of a short run
    zero-filling it: 74 s for one 64-token request on one core of an AMD EPYC."""
    import transformers

    if not hasattr(hf, "generate_batch"):
        return None
    config = transformers.GenerationConfig(max_new_tokens=max(news), do_sample=False,
                                           eos_token_id=-1, pad_token_id=0)
    kwargs = {}
    if hasattr(transformers, "ContinuousBatchingConfig"):
        cb = transformers.ContinuousBatchingConfig(max_batch_tokens=BATCHED_TOKENS,
                                                   max_requests_per_batch=batch)
        cb.num_blocks = sum(-(-(len(p) + max(news)) // cb.page_size) for p in prompts)
        kwargs["continuous_batching_config"] = cb
    with torch.inference_mode():
        result = hf.generate_batch(prompts, generation_config=config, progress_bar=False, **kwargs)
    ordered = sorted(result.values(), key=lambda r: int(str(r.request_id).rsplit("_", 1)[-1]))
    return [list(r.generated_tokens)[:n] for r, n in zip(ordered, news)]


def tinyserve_engine(model: str, batch: int, enforce_eager: bool, seed: int):
    from tinyserve import LLM
    started = time.perf_counter()
    llm = LLM(model, seed=seed, max_num_seqs=batch, max_num_batched_tokens=BATCHED_TOKENS,
              max_model_len=PROMPT_LENS[1] + MIXED_NEW[1] + 8, enforce_eager=enforce_eager)
    return llm, time.perf_counter() - started


def tinyserve_run(llm, prompts, news) -> list[list[int]]:
    from tinyserve import SamplingParams
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in news]
    return [o.token_ids for o in llm.generate(prompts, params)]


def run(model: str = "cpu-bench", scenarios=SCENARIOS, seed: int = 0, verbose: bool = True,
        continuous: bool = True) -> dict:
    """Every scenario on every engine, on all usable cores; the report (``print_report``)."""
    from tinyserve import host
    with host.fixed_threads():
        return _run(model, scenarios, seed, verbose, continuous)


def _run(model, scenarios, seed, verbose, continuous) -> dict:
    from tinyserve import measure
    say = print if verbose else (lambda *a, **k: None)
    report = {"benchmark": "peer", "model": model, "machine": measure.this_machine().as_dict(),
              "scenarios": []}
    hf = None
    for sc in scenarios:
        engines = {}
        for name, eager in (("tinyserve eager", True), ("tinyserve enforce_eager=False", False)):
            engines[name] = tinyserve_engine(model, sc.concurrency, eager, seed)
        if hf is None:
            hf = load_reference(model, engines["tinyserve eager"][0].model)
            no_stop(hf)
        prompts, news = sc.workload(engines["tinyserve eager"][0].tokenizer.vocab_size, seed)
        runs = {"transformers generate (static batches)": lambda: hf_static(hf, prompts, news, sc.concurrency)}
        if continuous and hasattr(hf, "generate_batch"):
            runs["transformers generate_batch"] = lambda: hf_continuous(hf, prompts, news, sc.concurrency)
        for name, (llm, _) in engines.items():
            runs[name] = lambda llm=llm: tinyserve_run(llm, prompts, news)
        warm = (prompts[:1], [2])
        hf_static(hf, *warm, 1)
        for llm, _ in engines.values():
            tinyserve_run(llm, *warm)
        rows, reference = [], None
        for name, fn in runs.items():
            started = time.perf_counter()
            tokens = fn()
            seconds = time.perf_counter() - started
            if reference is None:
                reference = tokens
            equal = sum(a == b for a, b in zip(tokens, reference))
            rows.append({"engine": name, "seconds": seconds, "tok_per_s": sum(news) / seconds,
                         "equal": equal, "start_s": engines[name][1] if name in engines else None})
            say(f"  {sc.name}: {name} {sum(news) / seconds:.0f} tok/s", flush=True)
        base = rows[0]["tok_per_s"]
        for row in rows:
            row["ratio"] = row["tok_per_s"] / base
        path = engines["tinyserve enforce_eager=False"][0].engine.executor.decode_path
        report["scenarios"].append({"name": sc.name, "concurrency": sc.concurrency,
                                    "requests": sc.requests, "output_tokens": sum(news),
                                    "longest_output": max(news),
                                    "rows": rows,
                                    "decode_path": path.describe() if path else None})
    if verbose:
        print_report(report)
    return report


def print_report(r: dict) -> None:
    m = r["machine"]
    print(f"\n{r['model']} on {m.get('cpu', '?')}: output tokens/s, greedy, prompts "
          f"{PROMPT_LENS[0]}-{PROMPT_LENS[1]} tokens")
    labels = [f"{sc['name']} ({sc['requests']} req)" for sc in r["scenarios"]]
    width = max(map(len, labels + ["workload"])) + 2
    print(f"{'workload':<{width}}{'engine':<40}{'tok/s':>8}{'vs generate':>13}{'tokens equal':>14}")
    for sc, label in zip(r["scenarios"], labels):
        for row in sc["rows"]:
            print(f"{label:<{width}}{row['engine']:<40}{row['tok_per_s']:>8.0f}{row['ratio']:>12.2f}x"
                  f"{row['equal']:>9}/{sc['requests']}")
            label = ""


def add_arguments(parser) -> None:
    parser.add_argument("--engine", choices=("transformers", "vllm"), default="transformers",
                        help="the peer: transformers' generate (default) or vLLM's CPU build "
                             "(make vllm), offline and through each engine's OpenAI server")
    parser.add_argument("--model", default="cpu-bench", help="preset or checkpoint directory")
    parser.add_argument("--quick", action="store_true", help="only B=1 and 16 mixed-length requests")
    parser.add_argument("--no-continuous", action="store_true",
                        help="skip transformers' generate_batch")
    parser.add_argument("--out", help="also write the report as JSON to this path")
    parser.add_argument("--models", default="cpu-bench,qwen2.5-0.5b-shape",
                        help="with --engine vllm: comma-separated shapes (cpu-bench, qwen2.5-0.5b-shape)")
    parser.add_argument("--dtypes", default="float32,bfloat16",
                        help="with --engine vllm: comma-separated dtypes")
    parser.add_argument("--engines", default=None,
                        help="with --engine vllm: a comma-separated subset of " + ", ".join(
                            ("tinyserve packed", "tinyserve eager", "vLLM defaults", "vLLM tuned")))
    parser.add_argument("--no-server", action="store_true",
                        help="with --engine vllm: the offline APIs only, no OpenAI servers")
    parser.add_argument("--rounds", type=int, default=None,
                        help="with --engine vllm: offline rounds, the engines loaded together taking "
                             "turns (default 3)")


def main(args) -> dict:
    report = run(args.model, QUICK if args.quick else SCENARIOS, continuous=not args.no_continuous)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1, ensure_ascii=False))
        print(f"wrote {args.out}")
    return report
