"""The ``tinyserve`` command: serve a model, route over replicas, benchmark.

    tinyserve serve --model tiny-zh --host 127.0.0.1 --port 8000
    tinyserve route --replicas http://127.0.0.1:8001,http://127.0.0.1:8002 --policy cache_aware --port 8000
    tinyserve bench serve --url http://127.0.0.1:8000 --workload shared-prefix --rate 8 --num-requests 64
    tinyserve bench routing --num-replicas 3          # the routing policies compared, one table
    tinyserve bench kernels | crossover | sim ...      # same as python -m tinyserve.bench

``python -m tinyserve ...`` is the same command.
"""

from __future__ import annotations

import argparse
import sys


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-zh", help="preset name or HF-format directory "
                   "(default tiny-zh, the trained demo model)")
    p.add_argument("--served-model-name", help="the name clients use (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--seed", type=int, default=0, help="weights of a preset without a checkpoint")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV-cache size in blocks (default: max-num-seqs full-length requests)")
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                   action="store_false")
    p.add_argument("--policy", default="fcfs", help="scheduling policy (fcfs, sjf, priority, ...)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default="auto",
                   help="auto (a checkpoint's own dtype; float32 for presets), float32, bfloat16, float16")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def _route_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", required=True, help="comma-separated replica URLs")
    p.add_argument("--policy", default="cache_aware",
                   choices=["round_robin", "least_outstanding", "cache_aware"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--balance-abs-threshold", type=int, default=None)
    p.add_argument("--balance-rel-threshold", type=float, default=None)
    p.add_argument("--min-match-ratio", type=float, default=None)
    p.add_argument("--max-tree-size", type=int, default=None)


def _policy_kwargs(args) -> dict:
    names = ("balance_abs_threshold", "balance_rel_threshold", "min_match_ratio", "max_tree_size")
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def _bench_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions",
                   help="/v1/completions (token-id prompts) or /v1/chat/completions")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    p.add_argument("--workload", default="mixed", help="a name in tinyserve.workload.WORKLOADS")
    p.add_argument("--rate", type=float, default=float("inf"), help="requests/s (default inf)")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--burstiness", type=float, default=1.0, help="1 = Poisson; < 1 burstier")
    p.add_argument("--max-len", type=int, default=4096, help="prompt + output fit in this")
    p.add_argument("--length-scale", type=float, default=1.0, help="shrink lengths for small models")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--ttft-slo", type=float, default=None, help="seconds")
    p.add_argument("--tpot-slo", type=float, default=None, help="seconds")
    p.add_argument("--e2e-slo", type=float, default=None, help="seconds")
    p.add_argument("--out", default=None, help="write the full result as JSON here")
    p.add_argument("--no-progress", dest="progress", action="store_false")


def _bench_routing_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", default=None, help="comma-separated URLs of running tinyserve "
                   "servers (default: start --num-replicas of them)")
    p.add_argument("--num-replicas", type=int, default=3)
    p.add_argument("--model", default="small")
    p.add_argument("--replica-args", default="--threads 1 --num-kv-blocks 128",
                   help="extra `tinyserve serve` arguments for started replicas")
    p.add_argument("--workload", default="shared-prefix")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--rate", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--length-scale", type=float, default=0.75,
                   help="0.75: a 384-token shared prefix per group")
    p.add_argument("--num-prefix-groups", type=int, default=12)


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `tinyserve bench kernels|crossover|sim ...` belongs to tinyserve.bench.
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in ("kernels", "crossover", "sim"):
        from tinyserve.bench import main as bench_main
        bench_main(argv[1:])
        return
    parser = argparse.ArgumentParser(prog="tinyserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_args(sub.add_parser("serve", help="OpenAI-compatible streaming server"))
    _route_args(sub.add_parser("route", help="streaming router over replicas"))
    bench = sub.add_parser("bench", help="benchmarks: serve, routing (kernels, crossover, sim)")
    bsub = bench.add_subparsers(dest="bench", required=True)
    _bench_serve_args(bsub.add_parser("serve", help="load-test an OpenAI-compatible server"))
    _bench_routing_args(bsub.add_parser("routing", help="routing policies over real replicas"))
    bsub.add_parser("kernels", help="see python -m tinyserve.bench kernels --help")
    bsub.add_parser("crossover", help="see python -m tinyserve.bench crossover --help")
    bsub.add_parser("sim", help="see python -m tinyserve.bench sim --help")
    args = parser.parse_args(argv)

    if args.command == "serve":
        from tinyserve.serving.app import serve
        serve(model=args.model, host=args.host, port=args.port,
              served_model_name=args.served_model_name, threads=args.threads, seed=args.seed,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
              enable_prefix_caching=args.enable_prefix_caching, policy=args.policy,
              device=args.device, dtype=args.dtype)
    elif args.command == "route":
        from tinyserve.serving.router import route
        replicas = [u for u in args.replicas.split(",") if u]
        route(replicas, args.policy, host=args.host, port=args.port, **_policy_kwargs(args))
    elif args.bench == "serve":
        from tinyserve.serving.client import benchmark, format_summary, save_result
        from tinyserve.workload import make_workload
        specs = make_workload(args.workload, num_requests=args.num_requests, rate=args.rate,
                              seed=args.seed, burstiness=args.burstiness, max_len=args.max_len,
                              length_scale=args.length_scale)
        result = benchmark(args.url, specs, model=args.model, endpoint=args.endpoint,
                           seed=args.seed, ttft_slo=args.ttft_slo, tpot_slo=args.tpot_slo,
                           e2e_slo=args.e2e_slo, max_concurrency=args.max_concurrency,
                           progress=args.progress)
        print(format_summary(result))
        if args.out:
            save_result(result, args.out)
            print(f"wrote {args.out}")
    elif args.bench == "routing":
        import shlex
        from tinyserve.serving.router import bench_routing
        bench_routing(num_replicas=args.num_replicas, model=args.model,
                      replica_args=shlex.split(args.replica_args),
                      replicas=[u for u in (args.replicas or "").split(",") if u] or None,
                      workload=args.workload, num_requests=args.num_requests, rate=args.rate,
                      seed=args.seed, max_len=args.max_len, length_scale=args.length_scale,
                      num_prefix_groups=args.num_prefix_groups)


if __name__ == "__main__":
    main()
