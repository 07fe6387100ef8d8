"""The planner against published GPU training throughput (llama_train/plan/published.py): each published
row's setting and tokens/s per GPU beside the planner's, the ratios inside one publication, and the
median and worst errors of both. docs/calibration.md is this script's output.

    python scripts/plan_published.py                    # the tables, at the one stated efficiency
    python scripts/plan_published.py --efficiency 0.4   # the same rows at another efficiency
"""

import argparse

from llama_train.cli import run_script
from llama_train.plan.published import EFFICIENCY, held


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--efficiency",
        type=float,
        default=EFFICIENCY,
        help="the share of each GPU's dense bf16 peak the model's FLOPs reach, one for every row "
        "(default: %(default)s, the planner's stated H100 and A100 figure)",
    )
    args = p.parse_args(argv)
    if not 0 < args.efficiency <= 1:
        p.error(f"--efficiency must be in (0, 1], got {args.efficiency}")
    return args


def rows_table(result: dict) -> str:
    head = (
        "| row | model | GPUs | interconnect | sequence x micro batch x accumulation | strategy | published "
        "tokens/s/GPU | planner | error | planner's inputs |"
    )
    lines = [head, "|" + "---|" * 10]
    for name, r in result["rows"].items():
        row, m = r["row"], r["machine"]
        inputs = (
            f"{m.peak_flops / 1e12:,.0f} TFLOP/s x {m.mfu:.2f}; bus {m.link_bytes_s / 1e9:,.0f} GB/s"
            + (f"; {row.inter_gbit:,.0f} Gbit/s a host, 8 a host" if row.inter_gbit else "")
            + ("; recompute" if row.checkpointing else "")
        )
        lines.append(
            f"| [{name}]({row.source}) | {row.model_name} | {row.gpus} x {row.gpu.upper()} | {row.interconnect} "
            f"| {row.seq} x {row.micro_batch} x {row.accumulation} | {row.strategy} | {row.tokens_per_s:,.0f} "
            f"| {r['tokens_per_s']:,.0f} | {r['error']:+.0%} | {inputs} |"
        )
    return "\n".join(lines)


def ratios_table(result: dict) -> str:
    lines = ["| ratio inside one publication | published | planner | error |", "|---|---|---|---|"]
    for x in result["ratios"]:
        lines.append(f"| {x['label']} | {x['measured']:.3f} | {x['predicted']:.3f} | {x['error']:+.1%} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    result = held(args.efficiency)
    s = result["summary"]
    print(rows_table(result) + "\n\n" + ratios_table(result) + "\n")
    print(
        f"Ratios: median |error| {s['ratios']['median']:.1%}, worst {s['ratios']['worst']:.1%}. Absolute, at one "
        f"efficiency {args.efficiency:g} for every row: median {s['absolute']['median']:.1%}, worst "
        f"{s['absolute']['worst']:.1%}."
    )
    return 0


if __name__ == "__main__":
    run_script(main)
