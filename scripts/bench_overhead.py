"""How close the trainers get to the machine's limit: ratios, each measured side by side.

    python scripts/bench_overhead.py                                  # overhead, hf, mfu
    python scripts/bench_overhead.py --sections head                  # the loss head: memory, speed
    python scripts/bench_overhead.py --sections mfu --compile         # MFU eager and compiled, 125m
    python scripts/bench_overhead.py --sections hf --hf_shapes 125m:4x256 --compile --profile   # where the time goes

overhead  A minimal hand-written loop (our Transformer, fused torch AdamW as the trainers use
          it, gradient clipping at the trainers' --grad_clip, the same batches from the same
          dataset through the trainers' own data code: the same math as a trainer step, none of
          the plumbing) against `python train_deepspeed.py` (ZeRO-0) and `python train_ddp.py`,
          each one process with the same thread count: tokens/s of the trainer over tokens/s of
          the raw loop. Goal >= 0.97: the trainers add almost nothing.
hf        Our Transformer against transformers' LlamaForCausalLM (SDPA) at the same config
          (llama_train.hf.to_hf_config), at each shape of `--hf_shapes`: forward + backward + AdamW
          step, fp32, same random batch, the models taking turns step by step in one process (the
          order rotates every step). Per shape: the median over step pairs of HF's step time over
          ours, with its spread (min-max over the pairs). Goal >= 1.0. `--compile` adds our model
          compiled (llama_train.distributed.compile) as a third contender.
mfu       Single-process ZeRO-0 runs of `--mfu_preset`: model FLOP/s over the fp32 matmul rate
          the runs measured at start-up (the trainer's own `mfu`). Goal >= 0.8 eager. `--compile`
          interleaves runs with the trainer's --compile: their MFU (goal >= 0.65) and the
          compiled / eager tokens/s ratio (goal >= 1.2); compile time is left out (warm-up steps).
head      The loss head at --mfu_preset, --batch_size x --max_seq_len: peak memory of a step (peak RSS of
          a process per variant) with the full fp32 logits (loss_chunk_tokens 0) and with the chunked
          head, then their step times in one process, alternating step by step. Goal: the chunked
          head at least 0.97x as fast. Not in the default sections (run it with --sections head).

Every number is a median: of per-step times after `--warmup_steps`, then over `--repeats` runs
whose order rotates, so load from elsewhere on the machine hits all contenders alike. Writes
overhead.json and overhead.md to --output_dir and prints the table.
"""

import argparse
import sys

from llama_train.bench.flags import add_flags
from llama_train.bench.overhead import SECTION_NAMES, OverheadSetup, head_child, parse_shapes, raw_loop, run

D = OverheadSetup()  # the defaults
# flag -> help, "{}" standing for the default; each flag's type and default are OverheadSetup's
FLAGS = {
    "preset": "model preset of the overhead section (default: {})",
    "hf_shapes": "shapes of the HF comparison, PRESET:BATCHxSEQ comma-separated (default: {})",
    "mfu_preset": "preset of the MFU run (default: {})",
    "max_seq_len": "tokens per sequence (default: {})",
    "batch_size": "sequences per step (default: {})",
    "steps": "optimizer steps per run, warm-up included (default: {})",
    "warmup_steps": "first steps left out of each median (default: {})",
    "repeats": "runs per contender, interleaved (default: {})",
    "threads": "torch threads for every contender (default: all cores)",
    "data_output_path": "tokenizer + token cache (default: <repo>/data_cache)",
    "output_dir": "overhead.json, overhead.md and run dirs go here",
}


def parse_args(argv=None) -> OverheadSetup:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--sections",
        default=",".join(D.sections),
        help="which of overhead,hf,mfu,head to run (default: overhead,hf,mfu)",
    )
    add_flags(p, D, FLAGS)
    p.add_argument(
        "--profile",
        action="store_true",
        help="hf, head sections: print the top ops of one step of each contender (torch.profiler)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="hf: add our model compiled; mfu: add ZeRO-0 runs with --compile (off by default: a cold "
        "compile adds about a minute per run on CPU)",
    )
    args = p.parse_args(argv)
    args.sections = [s for s in args.sections.split(",") if s]
    if unknown := set(args.sections) - set(SECTION_NAMES):
        p.error(f"unknown section(s) {sorted(unknown)}; choose from {list(SECTION_NAMES)}")
    if not 0 <= args.warmup_steps < args.steps:
        p.error(f"--warmup_steps must be in [0, --steps={args.steps})")
    try:
        parse_shapes(args.hf_shapes)
    except ValueError as e:
        p.error(f"--hf_shapes: {e}")
    return OverheadSetup(**vars(args))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child_raw"]:  # internal: the raw loop, given OUT_JSON and the trainers' flags
        return raw_loop(argv[1], argv[2:])
    if argv[:1] == ["--child_head"]:  # internal: OUT_JSON PRESET BATCH SEQ CHUNK STEPS
        return head_child(argv[1], argv[2], *map(int, argv[3:7]))
    print(run(parse_args(argv)))


if __name__ == "__main__":
    main()
