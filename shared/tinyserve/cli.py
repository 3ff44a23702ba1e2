"""The ``tinyserve`` command: serve a model, route over replicas, benchmark.

    tinyserve serve --model tiny-zh --host 127.0.0.1 --port 8000
    tinyserve route --replicas http://127.0.0.1:8001,http://127.0.0.1:8002 --policy cache_aware --port 8000
    tinyserve bench serve --url http://127.0.0.1:8000 --workload shared-prefix --rate 8 --num-requests 64
    tinyserve bench routing --num-replicas 3          # the routing policies compared, one table
    tinyserve bench kernels | crossover | sim ...      # same as python -m tinyserve.bench
    tinyserve diagnose --url http://127.0.0.1:8000 --window 60 --ttft-slo 0.5 --tpot-slo 0.05 \
        --hardware H100_SXM --model-spec LLAMA_7B --max-num-seqs 256   # the tuning order, live
    tinyserve diagnose --once before.prom after.prom --window 60       # two saved scrapes

``python -m tinyserve ...`` is the same command.
"""

from __future__ import annotations

import argparse
import sys

from tinyserve.hardware import HARDWARE_PRESETS, MODELS

HARDWARE_NAMES, MODEL_NAMES = sorted(HARDWARE_PRESETS), sorted(MODELS)


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
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                   help="--no-enforce-eager speeds up decode steps where that measures faster "
                        "at start (CPU: weights packed once for oneDNN; GPU: one CUDA graph per "
                        "batch bucket); default: on a CPU, packed where a decode step timed at "
                        "start ran faster packed, else eager")


def _limit_args(p: argparse.ArgumentParser, router: bool = False) -> None:
    """Request limits and timeouts of a server or router (issue: serving that survives faults)."""
    p.add_argument("--max-request-bytes", type=int, default=16 * 2**20,
                   help="larger request bodies get 413 (default 16 MiB)")
    p.add_argument("--header-timeout", type=float, default=60.0,
                   help="seconds for a request's line and headers to arrive (default 60)")
    p.add_argument("--body-timeout", type=float, default=60.0,
                   help="seconds for a request's body to arrive (default 60; then 408)")
    if router:
        p.add_argument("--health-interval", type=float, default=2.0,
                       help="seconds between /health probes of each replica (default 2)")
        p.add_argument("--upstream-timeout", type=float, default=120.0,
                       help="seconds to wait for a replica's next bytes (default 120)")
        p.add_argument("--connect-timeout", type=float, default=5.0,
                       help="seconds to connect to a replica before trying another (default 5)")
    else:
        p.add_argument("--max-prompt-chars", type=int, default=None,
                       help="longer prompts get 400 without being tokenized (default: what "
                            "the context could hold)")


def _limits(args, router: bool = False):
    common = dict(max_request_bytes=args.max_request_bytes, header_timeout=args.header_timeout,
                  body_timeout=args.body_timeout)
    if router:
        from tinyserve.serving.router import RouterConfig
        return RouterConfig(health_interval=args.health_interval, read_timeout=args.upstream_timeout,
                            connect_timeout=args.connect_timeout, **common)
    from tinyserve.serving.app import ServerConfig
    return ServerConfig(max_prompt_chars=args.max_prompt_chars, **common)


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


def _diagnose_args(p: argparse.ArgumentParser) -> None:
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--url", help="the server (tinyserve, vLLM or SGLang); /metrics is read twice")
    source.add_argument("--once", nargs=2, metavar=("FILE1", "FILE2"),
                        help="two saved scrapes of /metrics, --window seconds apart")
    p.add_argument("--window", type=float, default=60.0, help="seconds between the scrapes (default 60)")
    p.add_argument("--ttft-slo", type=float, default=0.5, help="seconds (default 0.5)")
    p.add_argument("--tpot-slo", type=float, default=0.05, help="seconds (default 0.05)")
    p.add_argument("--stat", default="p99", choices=["mean", "median", "p99"],
                   help="the statistic compared with the SLOs (default p99)")
    p.add_argument("--hardware", help="GPU preset for the crossover: " + ", ".join(HARDWARE_NAMES))
    p.add_argument("--model-spec", help="model preset for the crossover: " + ", ".join(MODEL_NAMES))
    p.add_argument("--model-dir", help="a checkpoint directory whose config.json gives the model")
    p.add_argument("--dtype", default="fp16", help="weights' dtype for the crossover (default fp16)")
    p.add_argument("--crossover", type=float, default=None, help="a crossover batch you measured")
    p.add_argument("--max-num-seqs", type=int, default=None, help="the server's batch cap")
    p.add_argument("--prefix-share", type=float, default=None,
                   help="share of prompt tokens you expect to be a reusable prefix (0-1)")
    p.add_argument("--routing", default=None, help="the router's policy in front of the server, if any")
    p.add_argument("--model", default=None, help="the model_name label, when the server has several")
    p.add_argument("--timeout", type=float, default=10.0,
                   help="seconds for each whole scrape: connect, headers and body (default 10)")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")


def _diagnose(args) -> None:
    from tinyserve.serving.live_diagnose import crossover_of, diagnose_files, diagnose_url
    found = crossover_of(args.hardware, args.model_spec, args.model_dir, args.dtype)
    crossover, note = (args.crossover, "given") if args.crossover is not None else (found or (None, None))
    knobs = dict(ttft_slo=args.ttft_slo, tpot_slo=args.tpot_slo, crossover=crossover, crossover_note=note,
                 max_num_seqs=args.max_num_seqs, prefix_share=args.prefix_share, routing=args.routing,
                 stat=args.stat)
    if args.once:
        live = diagnose_files(*args.once, args.window, model=args.model, **knobs)
    else:
        live = diagnose_url(args.url, args.window, model=args.model, timeout=args.timeout, **knobs)
    print(live.to_json() if args.json else live)


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `tinyserve bench kernels|crossover|sim ...` belongs to tinyserve.bench.
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in ("kernels", "crossover", "sim"):
        from tinyserve.bench import main as bench_main
        bench_main(argv[1:])
        return
    parser = argparse.ArgumentParser(prog="tinyserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_args(serve_parser := sub.add_parser("serve", help="OpenAI-compatible streaming server"))
    _limit_args(serve_parser)
    _route_args(route_parser := sub.add_parser("route", help="streaming router over replicas"))
    _limit_args(route_parser, router=True)
    bench = sub.add_parser("bench", help="benchmarks: serve, routing (kernels, crossover, sim)")
    bsub = bench.add_subparsers(dest="bench", required=True)
    _bench_serve_args(bsub.add_parser("serve", help="load-test an OpenAI-compatible server"))
    _bench_routing_args(bsub.add_parser("routing", help="routing policies over real replicas"))
    bsub.add_parser("kernels", help="see python -m tinyserve.bench kernels --help")
    bsub.add_parser("crossover", help="see python -m tinyserve.bench crossover --help")
    bsub.add_parser("sim", help="see python -m tinyserve.bench sim --help")
    _diagnose_args(sub.add_parser("diagnose", help="the tuning order on a live server's /metrics"))
    args = parser.parse_args(argv)

    if args.command == "diagnose":
        try:
            _diagnose(args)
        except (ValueError, ConnectionError, OSError) as exc:
            parser.exit(2, f"tinyserve diagnose: error: {exc}\n")
    elif args.command == "serve":
        from tinyserve.serving.app import serve
        serve(model=args.model, host=args.host, port=args.port,
              served_model_name=args.served_model_name, threads=args.threads, seed=args.seed,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
              enable_prefix_caching=args.enable_prefix_caching, policy=args.policy,
              device=args.device, dtype=args.dtype, enforce_eager=args.enforce_eager,
              config=_limits(args))
    elif args.command == "route":
        from tinyserve.serving.router import route
        replicas = [u for u in args.replicas.split(",") if u]
        route(replicas, args.policy, host=args.host, port=args.port,
              config=_limits(args, router=True), **_policy_kwargs(args))
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
