"""`kiln generate` (text from any model source, through the engine) and `kiln bench infer` (the engine's
latency and throughput, kiln.infer.bench). `kiln bench cuda` (the CUDA C++ ladder, kiln.profile.cuda_ladder)
and `kiln bench collectives` (kiln.dist.collectives_bench) are registered beside it, under the same `bench`
command."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from kiln.errors import KilnError


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def _read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompts_file is None:
        return [args.prompt]
    path = Path(args.prompts_file)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise KilnError(f"--prompts-file {path} does not exist") from None
    except (IsADirectoryError, UnicodeDecodeError) as e:
        raise KilnError(f"--prompts-file {path} is not a UTF-8 text file ({type(e).__name__})") from None
    prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise KilnError(f"--prompts-file {path} holds no prompt (one prompt per non-empty line)")
    return prompts


def _generate(args: argparse.Namespace, extra: list[str]) -> int:
    from kiln.infer.config import EngineConfig
    from kiln.infer.engine import LLM
    from kiln.infer.loading import load_generation_source
    from kiln.infer.sampling_params import SamplingParams
    from kiln.model.generate import ENDOFTEXT, check_sampling, plan_generation

    check_sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.n)
    prompts = _read_prompts(args)
    cfg = EngineConfig(device=args.device or "auto", dtype=args.dtype, block_size=16)
    device = cfg.resolve_device()
    model, tok = load_generation_source(args.checkpoint, device, cfg.resolve_dtype(device))
    context = model.config.max_seq_len
    plans = []
    for prompt in prompts:
        plan = plan_generation(tok, prompt, args.max_new_tokens, context)
        if plan.prompt_cut:
            print(f"kiln: note: the prompt fills the model's {context}-token context: its first "
                  f"{plan.prompt_cut} tokens are dropped", file=sys.stderr)  # fmt: skip
        if plan.max_new_tokens < args.max_new_tokens:
            print(f"kiln: note: --max-new-tokens {args.max_new_tokens} capped at {plan.max_new_tokens}: the "
                  f"model's context is {context} tokens and the prompt takes {len(plan.ids)}", file=sys.stderr)  # fmt: skip
        plans.append(plan)
    if all(p.max_new_tokens == 0 for p in plans):
        print("\n---\n".join(prompts))
        return 0
    # a KV cache for exactly these requests (the engine's default takes most of the free device memory)
    need = sum(-(-(len(p.ids) + p.max_new_tokens) // cfg.block_size) for p in plans) * args.n
    cfg.num_blocks = need
    cfg.max_num_seqs = max(1, min(256, len(prompts) * args.n))
    eot = tok.special_tokens.get(ENDOFTEXT)
    llm = LLM(model, tokenizer=tok, eos_token_ids=[] if eot is None else [eot], log=None, **vars(cfg))
    params = [
        SamplingParams(
            max_tokens=max(p.max_new_tokens, 1),
            temperature=args.temperature,
            top_k=args.top_k or -1,
            top_p=args.top_p,
            n=args.n,
            seed=args.seed,
        )  # fmt: skip
        for p in plans
    ]
    if len(prompts) == 1 and args.n == 1 and not args.no_stream:
        print(prompts[0], end="", flush=True)
        shown = 0
        for state in llm.stream(plans[0].ids, params[0]):
            text = state.outputs[0].text
            if not state.finished and text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for it
                continue
            print(text[shown:], end="", flush=True)
            shown = len(text)
        print()
        return 0
    outs = llm.generate([p.ids for p in plans], params)
    samples = [prompt + o.text for prompt, out in zip(prompts, outs) for o in out.outputs]
    print("\n---\n".join(samples))
    return 0


def _bench_cuda(args: argparse.Namespace, extra: list[str]) -> int:
    from kiln.profile import cuda_ladder

    cuda_ladder.run(args.out, cuda_ladder.__file__)
    return 0


def _bench_collectives(args: argparse.Namespace, extra: list[str]) -> int:
    import torch

    from kiln.dist import collectives_bench as cb
    from kiln.profile.report import format_table, write_json

    backend = args.backend or cb.default_backend()
    top = 1 << 30 if backend == "nccl" else 64 << 20
    sizes = cb.sizes_between(args.min_bytes, args.max_bytes or top)
    nprocs = args.nprocs or (torch.cuda.device_count() if backend == "nccl" else 2)
    rows, fits = cb.summarize(cb.spawn(nprocs, sizes, backend))
    print(
        f"kiln bench collectives: {backend}, {nprocs} ranks (bench/collectives.py: the same with provenance)"
    )
    print(format_table(fits, [("op", "op"), ("alpha_us", "alpha us"), ("beta_GBps", "beta GB/s")]))
    cols = [
        ("op", "op"),
        ("bytes", "bytes"),
        ("us", "time us"),
        ("model_us", "model us"),
        ("busbw_GBps", "busbw GB/s"),
    ]
    print(format_table(rows, cols))
    if args.out:
        write_json(args.out, {"backend": backend, "p": nprocs, "fits": fits, "cases": rows})
    return 0


def _bench_infer(args: argparse.Namespace, extra: list[str]) -> int:
    import torch

    from kiln.infer import bench
    from kiln.infer.config import EngineConfig
    from kiln.infer.engine import LLM
    from kiln.model.config import KernelConfig
    from kiln.model.transformer import build_model

    points = {"batch_sizes": [1, 8, 64], "prompt_len": 128, "output_len": 128}
    workload = {"min_len": 100, "max_len": 1024, "temperature": 0.6, "seed": 0}
    wrong = [k for k in (points if args.requests else workload) if getattr(args, k) is not None]
    if wrong:
        flags = ", ".join("--" + k.replace("_", "-") for k in wrong)
        raise KilnError(
            f"{flags}: not used {'with' if args.requests else 'without'} --requests (the batch points take "
            "--batch-sizes, --prompt-len, --output-len; --requests takes --min-len, --max-len, --temperature, --seed)"
        )
    for k, v in {**points, **workload}.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.requests and args.min_len > args.max_len:
        raise KilnError(f"--min-len {args.min_len} is larger than --max-len {args.max_len}")
    seqs = min(args.requests, 256) if args.requests else max(args.batch_sizes)
    need = 2 * args.max_len if args.requests else args.prompt_len + args.output_len
    engine = dict(
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=seqs,
        max_num_batched_tokens=max(args.max_num_batched_tokens, seqs),
        decode_backend=args.decode_backend,
        max_graph_batch=seqs,
        async_scheduling=args.async_scheduling,
        kernels=KernelConfig(linear=args.linear, attention="kiln"),
    )
    cfg = EngineConfig(**engine)
    if args.model:
        llm = LLM(args.model, **engine)
        what = args.model
    else:  # random weights of a reference shape: speed does not depend on the values
        device = cfg.resolve_device()
        mcfg = bench.qwen2_1p5b_config(max_seq_len=need)
        model = build_model(mcfg, device=device, dtype=cfg.resolve_dtype(device), seed=0)
        llm = LLM(model, **engine)
        what = "random-init Qwen2.5-1.5B shape"
    if need > llm.engine.max_model_len:
        flags = "2 x --max-len" if args.requests else "--prompt-len + --output-len"
        raise KilnError(
            f"{flags} = {need} exceeds the model's context of {llm.engine.max_model_len}: lower them"
        )
    result: dict = {}
    if args.requests:
        print(f"kiln bench infer: {what}, {args.requests} requests, input and output lengths "
              f"{args.min_len}-{args.max_len} (seed {args.seed}), temperature {args.temperature}, EOS ignored")  # fmt: skip
        reqs = bench.workload(args.requests, args.min_len, args.max_len, llm.engine.vocab_size, args.seed)
        warm = bench.workload(
            min(16, args.requests), args.min_len, args.max_len, llm.engine.vocab_size, args.seed + 1
        )
        bench.drive(llm.engine, [(p, min(m, 8)) for p, m in warm], args.temperature)  # compile, autotune
        r = bench.throughput(llm.engine, reqs, args.temperature, seed=args.seed)
        ms = {k: {q: r[k][q] * 1e3 for q in ("p50", "p99")} for k in ("ttft_s", "itl_s", "tpot_s")}
        print(f"{r['output_tokens']} output tokens in {r['time_s']:.2f} s: {r['output_tok_s']:.1f} output tok/s "
              f"({r['total_tok_s']:.1f} with the prompts)")  # fmt: skip
        for k, name in (("ttft_s", "TTFT"), ("itl_s", "ITL"), ("tpot_s", "TPOT")):
            print(f"{name:5s} p50 {ms[k]['p50']:9.2f} ms   p99 {ms[k]['p99']:9.2f} ms")
        result["throughput"] = r
    else:
        print(f"kiln bench infer: {what}, prompt {args.prompt_len}, output {args.output_len} tokens")
        result["points"] = bench.run(llm.engine, args.batch_sizes, args.prompt_len, args.output_len)
    if args.out:
        from kiln.io.atomic import atomic_write_text

        meta = {
            "model": what,
            "device": torch.cuda.get_device_name() if llm.engine.device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "decode_backend": args.decode_backend,
            "async_scheduling": llm.engine.async_scheduling,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        atomic_write_text(Path(args.out), json.dumps({**meta, **result}, indent=2) + "\n")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser(
        "generate",
        help="sample text from a run, a checkpoint or a model directory (through the inference engine)",
        description="Continue a prompt (streamed to the terminal), or every line of --prompts-file (batched "
        "through the engine, samples separated by ---).",
    )
    g.add_argument(
        "--checkpoint",
        "--model",  # the name `kiln serve`, `kiln quantize` and `kiln profile` give the same argument
        dest="checkpoint",
        required=True,
        help="a run directory, its checkpoints/ or a .pt file, or a kiln / Hugging Face model directory "
        "written by `kiln convert` (it holds the tokenizer beside the weights)",
    )
    g.add_argument("--prompt", default="", help="text to continue")
    g.add_argument("--prompts-file", help="a UTF-8 file with one prompt per line, generated as one batch")
    g.add_argument(
        "--max-new-tokens", type=int, default=200, help=">= 0; capped (with a note) at the model's context"
    )
    g.add_argument("--temperature", type=float, default=0.8, help=">= 0 and finite; 0 is greedy")
    g.add_argument("--top-k", type=int, default=50, help=">= 1; 0 disables")
    g.add_argument("--top-p", type=float, default=0.95, help="in (0, 1]; 1 disables")
    g.add_argument("--n", type=int, default=1, help="number of samples per prompt (>= 1)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", help="auto (default), cpu, cuda, cuda:N")
    g.add_argument(
        "--dtype", default="auto", choices=("auto", "fp32", "bf16", "fp16"), help="auto: bf16 on CUDA"
    )
    g.add_argument(
        "--no-stream", action="store_true", help="print the text at the end instead of as it comes"
    )
    g.set_defaults(func=_generate)

    p = sub.add_parser(
        "bench",
        help="measure kiln (the inference engine: `kiln bench infer`; the CUDA C++ ladder: `kiln bench cuda`; "
        "collectives: `kiln bench collectives`)",
    )
    areas = p.add_subparsers(dest="area", required=True)
    b = areas.add_parser(
        "infer",
        help="the engine's TTFT and decode/total tokens per second at several batch sizes",
        description="Greedy decoding of random prompts through the engine. Without --model, a random-init "
        "model of the Qwen2.5-1.5B shape (speed does not depend on the weights).",
    )
    b.add_argument("--model", help="HF directory, kiln model directory or run (default: a reference shape)")
    b.add_argument("--batch-sizes", type=_ints, help="comma-separated (default 1,8,64)")
    b.add_argument("--prompt-len", type=_positive, help="default 128")
    b.add_argument("--output-len", type=_positive, help="default 128")
    b.add_argument("--max-num-batched-tokens", type=_positive, default=8192)
    b.add_argument("--linear", choices=("auto", "torch", "kiln"), default="auto", help="matmul backend")
    b.add_argument(
        "--decode-backend",
        choices=("graphs", "compile", "eager"),
        default="graphs",
        help="decode steps as CUDA graphs (default), torch.compile'd then captured, or eager",
    )
    b.add_argument(
        "--async-scheduling",
        choices=("auto", "on", "off"),
        default="auto",
        help="launch step N+1 before step N's ids reach the host (auto: on for CUDA, off on CPU)",
    )
    b.add_argument(
        "--requests",
        type=_positive,
        help="instead of the batch points: nano-vllm's throughput benchmark, this many requests (it uses "
        "256) of random ids, input and output lengths uniform in --min-len..--max-len, all submitted at once: "
        "output tok/s, TTFT / ITL / TPOT p50 and p99",
    )
    b.add_argument("--min-len", type=_positive, help="with --requests (default 100)")
    b.add_argument("--max-len", type=_positive, help="with --requests (default 1024)")
    b.add_argument("--temperature", type=float, help="with --requests (default nano-vllm's 0.6)")
    b.add_argument("--seed", type=int, help="with --requests: the workload's seed (default 0)")
    b.add_argument("--device", default="auto")
    b.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16", "fp16"))
    b.add_argument("--out", help="write the points (or the throughput figures) as JSON here")
    b.set_defaults(func=_bench_infer)
    c = areas.add_parser(
        "cuda",
        help="the CUDA C++ ladder: vector add, memory probes, SGEMM steps and tensor-core GEMMs vs cuBLAS",
        description="Builds kiln.kernels.cuda (first use) and measures it; tables on stdout, JSON and PNGs.",
    )
    c.add_argument("--out", default="bench/results/cuda_ladder.json", help="result JSON (PNGs beside it)")
    c.set_defaults(func=_bench_cuda)
    d = areas.add_parser(
        "collectives",
        help="all_reduce / reduce_scatter / all_gather and kiln's ring and recursive-doubling all-reduce: "
        "busbw and the fitted alpha-beta model",
        description="Spawns --nprocs ranks (gloo on CPU, NCCL with a GPU each; kiln.dist.collectives_bench).",
    )
    d.add_argument("--nprocs", type=_positive, help="ranks (default 2 with gloo, every GPU with NCCL)")
    d.add_argument("--backend", choices=("gloo", "nccl"), help="default: nccl with 2+ GPUs, else gloo")
    d.add_argument("--min-bytes", type=_positive, default=1 << 10, help="smallest message in bytes (1024)")
    d.add_argument("--max-bytes", type=_positive, help="largest (default 64 MiB gloo, 1 GiB nccl)")
    d.add_argument("--out", help="write the fits and cases as JSON here")
    d.set_defaults(func=_bench_collectives)
