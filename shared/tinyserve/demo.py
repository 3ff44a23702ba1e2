"""Static vs continuous batching on one mixed workload: ``python -m tinyserve.demo``.

Both runs use the same ~100M-parameter model (``cpu-bench``), the same requests
(mostly short chats, a few long generations, all arriving at once) and the same
seats and token budget; only the batching mode differs. Prints one table with
output tok/s, TTFT and TPOT of each, the continuous/static ratio measured in
this run, and how much of a full step (32 running requests) goes to the
scheduler and bookkeeping rather than to the model.
"""

from __future__ import annotations

import argparse
import random
import statistics

from tinyserve.engine import LLM
from tinyserve.metrics import summarize
from tinyserve.request import SamplingParams


def mixed_workload(num_requests: int, seed: int = 0, long_fraction: float = 0.15):
    """Prompt token ids and sampling params: short chats plus a few long generations."""
    rng = random.Random(seed)
    prompts, params = [], []
    for _ in range(num_requests):
        if rng.random() < long_fraction:
            prompt_len, output_len = rng.randint(128, 384), rng.randint(192, 256)
        else:
            prompt_len, output_len = rng.randint(16, 96), rng.randint(8, 32)
        prompts.append([rng.randrange(2045) for _ in range(prompt_len)])
        params.append(SamplingParams(max_tokens=output_len, ignore_eos=True))
    return prompts, params


def run(batching: str, prompts, params, max_num_seqs: int, budget: int, seed: int):
    llm = LLM("cpu-bench", seed=seed, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
              batching=batching)
    llm.generate(prompts[:2], [SamplingParams(max_tokens=2)] * 2, use_tqdm=False)   # warm-up
    llm.engine.step_stats.clear()
    print(f"{batching} batching:")
    outputs = llm.generate(prompts, params, use_tqdm=True)
    return outputs, llm.engine.step_stats


def overhead_at(steps, running: int) -> tuple[float, float, int]:
    """Mean share of a decode step spent outside the model, over steps with ``running`` seats full."""
    full = [s for s in steps if s.num_running == running and s.num_prefill_tokens == 0]
    if not full:
        return float("nan"), float("nan"), 0
    step = statistics.fmean(s.duration for s in full)
    scheduler = statistics.fmean(s.schedule_time for s in full)
    packing = statistics.fmean(s.prepare_time for s in full)
    return scheduler / step, (scheduler + packing) / step, len(full)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=96)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    prompts, params = mixed_workload(args.num_requests, args.seed)
    out_lens = [p.max_tokens for p in params]
    print(f"workload: {len(prompts)} requests, prompt {min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens, output {min(out_lens)}-{max(out_lens)} tokens "
          f"(mean {statistics.fmean(out_lens):.0f}); seats {args.max_num_seqs}, "
          f"token budget {args.max_num_batched_tokens}\n")

    rows = {}
    steps_by_mode = {}
    for mode in ("static", "continuous"):
        outputs, steps = run(mode, prompts, params, args.max_num_seqs,
                             args.max_num_batched_tokens, args.seed)
        rows[mode] = summarize([o.metrics for o in outputs])
        rows[mode]["steps"] = len(steps)
        steps_by_mode[mode] = steps

    print()
    header = f"{'':22}{'static':>12}{'continuous':>12}{'cont/static':>13}"
    print(header)
    print("-" * len(header))
    lines = [("output tok/s", "output_throughput", 1, True),
             ("mean TTFT (s)", "mean_ttft", 1, False),
             ("p99 TTFT (s)", "p99_ttft", 1, False),
             ("mean TPOT (ms)", "mean_tpot", 1e3, False),
             ("engine steps", "steps", 1, False),
             ("wall time (s)", "duration", 1, False)]
    for label, key, scale, higher_better in lines:
        s, c = rows["static"][key] * scale, rows["continuous"][key] * scale
        print(f"{label:22}{s:12.2f}{c:12.2f}{c / s:12.2f}x")
    ratio = rows["continuous"]["output_throughput"] / rows["static"]["output_throughput"]
    print(f"\ncontinuous / static output throughput: {ratio:.2f}x (measured in this run)")

    sched, total, n = overhead_at(steps_by_mode["continuous"], args.max_num_seqs)
    print(f"at batch {args.max_num_seqs} ({n} decode steps): scheduler + bookkeeping "
          f"{sched:.2%} of step time; with packing the batch into tensors {total:.2%}")


if __name__ == "__main__":
    main()
