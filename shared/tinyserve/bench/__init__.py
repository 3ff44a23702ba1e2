"""Benchmarks that print tables (and write JSON for the notebooks): fused vs unfused
kernels (``kernels``), the batch-size crossover on this machine (``crossover``), the
decode step against the weight-read floor, eager and compiled (``step``),
tinyserve against transformers' ``generate`` or a real vLLM on the same weights (``peer``),
the simulator against the real engine (``sim``), a server under rounds of streams and
hostile requests (``soak``: errors, RSS and KV blocks per round), the cost of a
prefix-cache block hash (``prefix-hash``), and every GPU
measurement the book needs in one run (``gpu-evidence``, see ``gpu_evidence``).
Run ``python -m tinyserve.bench``.
"""


def main(argv=None) -> None:
    import argparse
    import sys

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["gpu-evidence"]:      # its own parser takes every option after the name
        from tinyserve.bench import gpu_evidence
        sys.exit(gpu_evidence.main(argv[1:]))

    from tinyserve.bench import crossover, kernels, peer, prefix_hash, sim, soak, step
    parser = argparse.ArgumentParser(prog="python -m tinyserve.bench",
                                     description="tinyserve benchmarks; each prints a table")
    sub = parser.add_subparsers(dest="bench", required=True)
    kp = sub.add_parser("kernels", help="fused vs unfused kernels, in GB/s against a copy")
    kp.add_argument("--out", help="also write the results as JSON to this path")
    kp.add_argument("--gib", type=float, default=1.0,
                    help="CPU: GiB the fused add+RMSNorm touches per call (default 1)")
    kp.add_argument("--repeats", type=int, default=5, help="CPU: timed calls per variant")
    kp.add_argument("--dtype", choices=sorted(kernels.DTYPES), default="bfloat16",
                    help="CPU: dtype of the add+RMSNorm tensors (default bfloat16)")
    kp.add_argument("--cpu", action="store_true", help="run the CPU benchmark even with a GPU")
    cp = sub.add_parser("crossover", help="decode step time vs batch size: the roofline knee")
    crossover.add_arguments(cp)
    stp = sub.add_parser("step", help="decode step vs the weight-read floor, eager and compiled")
    step.add_arguments(stp)
    peer.add_arguments(sub.add_parser("peer", help="tinyserve vs transformers' generate and "
                                                   "generate_batch, same weights and workload"))
    sp = sub.add_parser("sim", help="the simulator against the real engine on this CPU and its speed, "
                                    "or (--fidelity) against published vLLM measurements")
    sim.add_arguments(sp)
    soak.add_arguments(sub.add_parser("soak", help="a server under rounds of streams and hostile "
                                                   "requests: errors, RSS, KV blocks per round"))
    prefix_hash.add_arguments(sub.add_parser("prefix-hash", help="ns per prefix-cache block: "
                                                                 "builtin hash vs sha256 vs blake2b"))
    sub.add_parser("gpu-evidence", add_help=False,
                   help="every GPU measurement the book needs, as JSON (see gpu-evidence --help)")
    args = parser.parse_args(argv)
    if args.bench == "kernels":
        kernels.kernels_main(args)
    elif args.bench == "crossover":
        crossover.main(args)
    elif args.bench == "step":
        step.main(args)
    elif args.bench == "peer" and args.engine == "vllm":
        from tinyserve.bench import vllm_peer
        vllm_peer.main(args)
    elif args.bench == "peer":
        peer.main(args)
    elif args.bench == "sim":
        sim.main(args)
    elif args.bench == "soak":
        sys.exit(soak.main(args))
    elif args.bench == "prefix-hash":
        prefix_hash.main(args)
