"""Plan before launching: predicted memory per rank for every strategy (DDP, ZeRO-0..3, offload,
FSDP2), which fit the device, and (--recommend) those that fit, ranked by expected step time.

    python scripts/plan_memory.py --preset 1b --world_size 8 --batch_size 4 --max_seq_len 2048 --device_mem_gib 80
    python scripts/plan_memory.py --preset 7b --world_size 8 --batch_size 1 --max_seq_len 4096 --recommend
    python scripts/plan_memory.py --preset 7b --world_size 16 --batch_size 1 --max_seq_len 4096 --gradient_checkpointing
    python scripts/plan_memory.py --preset 25m --world_size 2 --batch_size 4 --max_seq_len 128 --device cpu --json

Model states come from the ZeRO paper's formula corrected by what DeepSpeed 0.19 was measured to hold
(an fp32 master copy, whole buckets, offload staging buffers), or FSDP2's gathered units; activations from the model's shapes
(checked against autograd's saved tensors); the logits and their gradients; and on CPU the
runtime's resident memory, measured. Communication per step is the paper's figure and what DeepSpeed or
FSDP2 really moves (measured: docs/memory.md 'What ZeRO costs, read together'; FSDP2: docs/fsdp.md). Prints a
Markdown table; --recommend the strategies that fit, fastest expected step first (llama_train/plan/steptime.py:
compute at the --machine's peak, the bytes at its link bandwidth where they do not hide behind compute, a
cost per collective and per parameter DeepSpeed hooks, recomputation, host transfers; offload last; within
5% a tie: the lower stage, then DDP), and those that do not; --json a list of objects (strategy,
model_state_bytes, activation_bytes, total_bytes, fits, rank, step_s and its terms, ...).
"""

import argparse
import json
import sys
from dataclasses import replace

from llama_train.cli import run_script
from llama_train.config import DTYPES
from llama_train.distributed.strategies import DEFAULT_STRATEGIES, STRATEGIES
from llama_train.model import PRESETS, preset
from llama_train.optim.registry import OPTIMIZERS
from llama_train.plan.planner import Workload, advice, plan
from llama_train.plan.steptime import MACHINES, read_machine

GiB = 2**30


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--preset",
        default="1b",
        help=f"model preset: {', '.join(PRESETS)} (default: %(default)s, TinyLlama's shape: a typical first GPU run)",
    )
    for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size"):
        p.add_argument(f"--{name}", type=int, help=f"{name} (overrides the preset, as in the trainers)")
    p.add_argument("--tie_embeddings", action="store_true", help="share input embedding and output weights")
    p.add_argument(
        "--world_size", type=int, default=8, help="data-parallel ranks (default: %(default)s, one 8-GPU node)"
    )
    p.add_argument(
        "--batch_size", type=int, default=4, help="micro batch per rank, sequences (default: %(default)s)"
    )
    p.add_argument(
        "--max_seq_len",
        type=int,
        default=2048,
        help="tokens per sequence (default: %(default)s, the 1b preset's context)",
    )
    p.add_argument(
        "--accumulation_steps",
        type=int,
        default=1,
        help="micro batches per step: ZeRO-2/3 communicate for each (default: %(default)s)",
    )
    p.add_argument(
        "--dtype",
        default="bfloat16",
        help="float32, bfloat16 or float16 (default: %(default)s, what --dtype auto picks on an Ampere+ GPU)",
    )
    p.add_argument("--gradient_checkpointing", action="store_true", help="recompute blocks in backward")
    p.add_argument(
        "--checkpoint_every",
        type=int,
        help="with --gradient_checkpointing: every k-th block only (default 1: every block), as in the trainers",
    )
    p.add_argument(
        "--device",
        default="gpu",
        help="gpu: CUDA memory per rank (the runtime left out, "
        "--reserve_gib for it); cpu: the process's peak RSS, runtime included (default: %(default)s)",
    )
    p.add_argument(
        "--device_mem_gib",
        type=float,
        default=80.0,
        help="memory per rank, GiB (default: %(default)s, an H100)",
    )
    p.add_argument(
        "--reserve_gib",
        type=float,
        default=1.0,
        help="gpu: memory CUDA's context, NCCL and the "
        "caching allocator's slack take beside the tensors (an assumption, default: %(default)s)",
    )
    p.add_argument(
        "--strategies", default=",".join(DEFAULT_STRATEGIES), help="comma-separated (default: %(default)s)"
    )
    p.add_argument(
        "--machine",
        choices=list(MACHINES),
        help="whose numbers the step-time model uses (llama_train/plan/steptime.py; default: h100 with "
        "--device gpu, cpu with --device cpu)",
    )
    p.add_argument(
        "--peak_tflops", type=float, help="the machine's peak per device instead of its stated one"
    )
    p.add_argument(
        "--link_gb_s",
        type=float,
        help="the bus bandwidth a rank's collectives reach within a host, GB/s, instead of the machine's (e.g. "
        "360 for NVLink 4 as NCCL reaches it); the table adds each strategy's bytes at it. Between hosts: "
        "--link_gbit",
    )
    p.add_argument(
        "--link_gbit",
        type=float,
        help="the links between hosts: Gbit/s a host sends on the wire, all its NICs together (e.g. 3200 for "
        "8 x 400 Gbit/s InfiniBand, 25 for one 25 GbE port); with --ranks_per_host, a ring's bytes cross them "
        "once a host. Default: every rank on one host",
    )
    p.add_argument(
        "--ranks_per_host",
        type=int,
        help="ranks (GPUs) that share a host and its links (default: the machine's, 8 for the GPUs; with "
        "--link_gbit and fewer ranks than this, one host)",
    )
    p.add_argument(
        "--latency_us",
        type=float,
        help="the network's latency per message, microseconds (a ring all-reduce waits 2(N-1) of them a call); "
        "default: the machine's",
    )
    p.add_argument(
        "--calibration",
        help="a machine measured by make bench-cluster (its machine_hN.json): peak, link, latency, the "
        "simulated hosts' shared cores; --link_gbit and the others apply on top",
    )
    p.add_argument(
        "--recommend",
        action="store_true",
        help="print the strategies that fit, ranked by expected step time (offload last; within 5%% a tie: "
        "the lower stage, DDP), with the time's terms and their spare memory, then those that do not fit",
    )
    p.add_argument(
        "--optimizer",
        default="adamw",
        choices=list(OPTIMIZERS),
        help="plan with this optimizer's state (its record: llama_train/optim/; muon: the blocks' matrices hold "
        "one momentum buffer instead of AdamW's two moments)",
    )
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    return p.parse_args(argv)


def problems(args) -> list[str]:
    """Everything wrong with the flags, at once."""
    out = []
    for k in ("world_size", "batch_size", "max_seq_len", "accumulation_steps"):
        if getattr(args, k) < 1:
            why = " (a micro batch holds at least one sequence)" if k == "batch_size" else ""
            out.append(f"--{k} must be >= 1, got {getattr(args, k)}{why}")
    if args.preset not in PRESETS:
        out.append(f"unknown preset {args.preset!r}; choose one of {', '.join(PRESETS)}")
    elif args.max_seq_len > PRESETS[args.preset].max_seq_len:
        out.append(
            f"--max_seq_len {args.max_seq_len} is above the {args.preset!r} preset's {PRESETS[args.preset].max_seq_len}"
        )
    if args.dtype not in DTYPES[1:]:
        out.append(f"--dtype must be one of {', '.join(DTYPES[1:])}, got {args.dtype!r}")
    if args.device not in ("gpu", "cpu"):
        out.append(f"--device must be gpu or cpu, got {args.device!r}")
    if args.device_mem_gib <= 0 or args.reserve_gib < 0:
        out.append("--device_mem_gib must be > 0 and --reserve_gib >= 0")
    for k in ("link_gb_s", "link_gbit", "peak_tflops"):
        if getattr(args, k) is not None and getattr(args, k) <= 0:
            out.append(f"--{k} must be > 0, got {getattr(args, k)}")
    if args.ranks_per_host is not None and args.ranks_per_host < 1:
        out.append(f"--ranks_per_host must be >= 1, got {args.ranks_per_host}")
    if args.latency_us is not None and args.latency_us < 0:
        out.append(f"--latency_us must be >= 0, got {args.latency_us}")
    unknown = [s for s in args.strategies.split(",") if s not in STRATEGIES]
    if unknown:
        out.append(f"unknown strategies {unknown}; known: {', '.join(STRATEGIES)}")
    return out


def table(rows: list[dict], args) -> str:
    """The rows as Markdown, then the verdict."""
    head = (
        "| strategy | model states (GiB) | buffers (GiB) | activations (GiB) | runtime (GiB) | total/rank (GiB) "
        f"| fits {args.device_mem_gib:g} GiB | offloaded to host (GiB) | comm/step, paper (GiB) | comm/step, as run (GiB) |"
    )
    if args.link_gb_s:
        head += f" at {args.link_gb_s:g} GB/s (ms) |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        cells = [
            r[k] / GiB
            for k in ("model_state_bytes", "buffer_bytes", "activation_bytes", "runtime_bytes", "total_bytes")
        ]
        comm = [r[k] / GiB for k in ("host_bytes", "paper_comm_bytes", "comm_bytes")]
        fits = ("**yes**" if r["recommended"] else "yes") if r["fits"] else "no"
        lines.append(
            f"| {r['strategy']} | "
            + " | ".join(f"{c:,.2f}" for c in cells)
            + f" | {fits} | "
            + " | ".join(f"{c:,.2f}" for c in comm)
            + " |"
            + (f" {r['comm_bytes'] / (args.link_gb_s * 1e9) * 1000:,.1f} |" if args.link_gb_s else "")
        )
    best = [r for r in rows if r["recommended"]]
    if best:
        verdict = (
            f"Fastest expected step that fits: **{best[0]['strategy']}** (~{best[0]['step_s'] * 1000:,.0f} ms, "
            f"{best[0]['total_bytes'] / GiB:,.2f} GiB a "
            "rank); --recommend ranks every strategy that fits."
        )
    else:
        lean = min(rows, key=lambda r: r["total_bytes"])
        verdict = (
            f"Nothing fits in {args.device_mem_gib:g} GiB: the leanest, {lean['strategy']}, needs "
            f"{lean['total_bytes'] / GiB:,.2f} GiB a rank; try --gradient_checkpointing, a smaller --batch_size or more ranks."
        )
    return "\n".join(lines) + "\n\n" + verdict


def main(argv=None) -> int:
    args = parse_args(argv)
    if found := problems(args):
        print("error: " + "; ".join(found), file=sys.stderr)
        return 2
    overrides = {k: getattr(args, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size")}
    model = preset(
        args.preset,
        **overrides,
        tie_embeddings=args.tie_embeddings or None,
        gradient_checkpointing=args.gradient_checkpointing,
        checkpoint_every=args.checkpoint_every,
        max_seq_len=PRESETS[args.preset].max_seq_len,
    )
    if bad := model.problems():
        print("error: model: " + "; ".join(bad), file=sys.stderr)
        return 2
    work = Workload(
        model,
        args.world_size,
        args.batch_size,
        args.max_seq_len,
        args.dtype,
        args.accumulation_steps,
        args.device,
        args.optimizer,
    )
    rows = plan(
        work,
        args.device_mem_gib * GiB,
        args.strategies.split(","),
        args.reserve_gib * GiB * (args.device == "gpu"),
        machine_of(args),
    )
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(recommendation(rows, args) if args.recommend else table(rows, args))
    return 0


def machine_of(args):
    """--machine (default by --device) or --calibration, with --peak_tflops, the link flags applied."""
    machine = MACHINES[args.machine or ("h100" if args.device == "gpu" else "cpu")]
    if args.calibration:
        machine = read_machine(args.calibration)
    changes = {
        "peak_flops": args.peak_tflops and args.peak_tflops * 1e12,
        "link_bytes_s": args.link_gb_s and args.link_gb_s * 1e9,
        "inter_bytes_s": args.link_gbit and args.link_gbit * 1e9 / 8,
        "ranks_per_host": args.ranks_per_host,
        "hop_s": args.latency_us is not None and args.latency_us * 1e-6,
    }
    return replace(machine, **{k: v for k, v in changes.items() if v not in (None, False)})


def recommendation(rows: list[dict], args) -> str:
    """--recommend: what the run is, then planner.advice's ranking."""
    head = (
        f"{args.preset}, {args.world_size} rank(s), micro batch {args.batch_size} x {args.max_seq_len} tokens, "
        f"{args.dtype}, {args.device_mem_gib:g} GiB a rank, {machine_of(args).name}: the strategies that fit, "
        "fastest expected step first (offload last; within 5% a tie: the lower stage, DDP)"
    )
    return "\n".join([head, "", *advice(rows, args.device_mem_gib * GiB)])


if __name__ == "__main__":
    run_script(main)
