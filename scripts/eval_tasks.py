"""Score an export, a checkpoint or a run on downstream tasks, as the trainer's --eval_tasks does.

    python scripts/eval_tasks.py --model outputs/demo/hf --tasks builtin
    python scripts/eval_tasks.py --model outputs/demo/hf --tasks builtin,hellaswag_val.jsonl --limit 200
    deepspeed --num_gpus 2 scripts/eval_tasks.py --model outputs/demo/hf --tasks builtin --ds_inference --compare

The same scorer as in the loop (llama_train/train/tasks.py: lm-evaluation-harness's requests, encoding,
truncation and metrics), on a transformers model; the built-in task is the run's (its --data_split and
--seed from the run record, else 98,2 and 1234). --ds_inference runs the model through DeepSpeed's
inference engine, tensor parallel over the launcher's ranks (llama_train/distributed/inference.py);
--compare also scores the plain model and prints the largest per-item log-likelihood difference,
whether every prediction is the same, and the seconds each took (exit 1 when they differ).
"""

import argparse
import copy
import time

import torch

from llama_train.checkpoint.weights import load_for_inference
from llama_train.cli import HelpFormatter, run_script
from llama_train.gpu import inference_device
from llama_train.train.evaluation import find_run_record
from llama_train.train.tasks import prepare_tasks, score_tasks, write_samples

LL_TOLERANCE = 1e-5  # relative, fp32


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--model", required=True, help="an HF export dir, a checkpoint dir, or a run's output_dir")
    p.add_argument("--tokenizer", help="tokenizer dir (default: the model's)")
    p.add_argument(
        "--tasks", required=True, help="builtin and/or task JSONL files, comma-separated (as --eval_tasks)"
    )
    p.add_argument("--limit", type=int, default=-1, help="the first N items of each task (-1: all)")
    p.add_argument("--batch_size", type=int, default=8, help="requests per forward pass")
    p.add_argument(
        "--max_seq_len", type=int, help="the window (default: the run's, else the model's context)"
    )
    p.add_argument("--data_output_path", help="where the built-in task is cached (default: the run's)")
    p.add_argument("--output_dir", help="write every item's scores to OUTPUT_DIR/eval_tasks/step_0.jsonl")
    p.add_argument("--device", default="auto", help="auto (the GPU when there is one), cpu, cuda, ...")
    p.add_argument(
        "--ds_inference", action="store_true", help="through deepspeed.init_inference (AutoTP over the ranks)"
    )
    p.add_argument(
        "--compare", action="store_true", help="with --ds_inference: the plain model too, compared"
    )
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    return p.parse_args(argv)


def task_flags(args, model) -> argparse.Namespace:
    """What prepare_tasks reads, as the trainer's flags: the run's split, seed and window where known."""
    run = (find_run_record(args.model) or {}).get("args", {})
    return argparse.Namespace(
        eval_tasks=args.tasks,
        eval_task_limit=args.limit,
        data_split=run.get("data_split", "98,2"),
        seed=run.get("seed", 1234),
        data_output_path=args.data_output_path or run.get("data_output_path", "data_cache"),
        max_seq_len=args.max_seq_len or run.get("max_seq_len") or model.config.max_position_embeddings,
    )


def scored(model, taskset, device, batch_size: int) -> tuple[dict, dict, float]:
    from llama_train.distributed.inference import Logits

    t0 = time.perf_counter()
    metrics, samples = score_tasks(Logits(model), taskset, device, 0, 1, batch_size)
    return metrics, samples, time.perf_counter() - t0


def agreement(a: dict, b: dict) -> tuple[float, bool]:
    """(largest relative per-item log-likelihood difference, every prediction the same) of two scorings."""
    pairs = [(x, y) for t in a for s, r in zip(a[t], b[t]) for x, y in zip(s["lls"], r["lls"])]
    worst = max(abs(x - y) / max(abs(y), 1e-12) for x, y in pairs)
    keys = ("pred", "acc", "acc_norm", "greedy")
    same = all([s.get(k) for k in keys] == [r.get(k) for k in keys] for t in a for s, r in zip(a[t], b[t]))
    return worst, same


def main(argv=None) -> int:
    args = parse_args(argv)
    device = inference_device(args.device, torch.cuda.is_available())
    model, tokenizer = load_for_inference(args.model, args.tokenizer)
    model, rank, plain = model.to(device), 0, None
    taskset = prepare_tasks(
        task_flags(args, model), tokenizer, -1 if args.local_rank < 1 else args.local_rank
    )
    if args.ds_inference:
        from llama_train.distributed.inference import ds_inference, setup_inference

        rank, world = setup_inference(torch.device(device).type)
        plain = copy.deepcopy(model) if args.compare else None
        model = ds_inference(model, world, next(model.parameters()).dtype)
    metrics, samples, seconds = scored(model, taskset, device, args.batch_size)
    ok, lines = (
        True,
        [f"{name}: " + ", ".join(f"{k} {v:.4g}" for k, v in m.items()) for name, m in metrics.items()],
    )
    lines.append(
        f"scored {len(taskset.requests)} requests in {seconds:.2f} s{' (ds_inference)' * args.ds_inference}"
    )
    if plain is not None:
        _, reference, plain_s = scored(plain, taskset, device, args.batch_size)
        worst, same = agreement(samples, reference)
        ok = same and worst <= LL_TOLERANCE
        lines.append(f"plain model: {plain_s:.2f} s; per-item log-likelihoods within {worst:.2e} (relative), "
                     f"predictions {'identical' if same else 'DIFFER'}")  # fmt: skip
    if rank == 0:
        print("\n".join(lines), flush=True)
        if args.output_dir:
            print(f"item scores: {write_samples(args.output_dir, 0, samples, rank)}")
    return 0 if ok else 1


if __name__ == "__main__":
    run_script(main)
