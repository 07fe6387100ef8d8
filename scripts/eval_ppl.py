"""Loss, perplexity and bits per byte of an export, a checkpoint or a run; default: the run's eval split.

    python scripts/eval_ppl.py --model outputs/demo/hf                  # the run's eval split, as the trainer scored it
    python scripts/eval_ppl.py --model outputs/demo --split train --max_batches 20
    python scripts/eval_ppl.py --model outputs/demo/hf --split all --data_path my_eval.jsonl

Given a run (its output_dir, a checkpoint in it, or its export, which records the run in
llama_train_run.json), the blocks are rebuilt from the run's `config` record: the same sources,
train/eval split, seed and sequence length; by default exactly the blocks of the trainer's final
evaluation, so the trainer's final eval loss is reproduced. Scoring training data (`--split
train`) or another source (`--split all --data_path ...`) has to be asked for. The output line says
which split and how many tokens were scored.
"""

import argparse
import math

import torch

from llama_train.checkpoint.weights import load_for_inference
from llama_train.cli import HelpFormatter, run_script
from llama_train.errors import ConfigError
from llama_train.gpu import inference_device
from llama_train.train.evaluation import find_run_record, run_split_blocks, score_blocks, with_documents
from utils.data import TextBytes, stream_blocks


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--model", required=True, help="an HF export dir, a checkpoint dir, or a run's output_dir")
    p.add_argument("--tokenizer", help="tokenizer dir (default: the model's)")
    p.add_argument(
        "--split", default="eval", choices=["eval", "train", "all"],
        help="eval: the run's held-out split (default); train: its training split; all: every block of "
        "--data_path in order (another source, or a model without a run record)",
    )  # fmt: skip
    p.add_argument("--data_path", nargs="+", help="--split all: any trainer data source (default: the run's)")
    p.add_argument("--data_output_path", help="data cache to reuse or build in (default: the run's)")
    p.add_argument(
        "--max_seq_len", type=int, help="tokens per block (default: the run's, else the model's context)"
    )
    p.add_argument("--batch_size", type=int, default=8, help="blocks per forward pass")
    p.add_argument(
        "--max_batches", type=int,
        help="score the first this many batches (-1: all). Default: the blocks of the trainer's final "
        "evaluation for --split eval, 50 batches otherwise",
    )  # fmt: skip
    p.add_argument(
        "--device", default="auto", help="auto (the GPU when there is one), cpu, cuda, cuda:1, ..."
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = inference_device(args.device, torch.cuda.is_available())
    model, tokenizer = load_for_inference(args.model, args.tokenizer)
    context = model.config.max_position_embeddings
    if args.max_seq_len is not None and not 1 <= args.max_seq_len <= context:
        raise ConfigError(f"--max_seq_len {args.max_seq_len}: the model's context is {context} tokens")
    record = find_run_record(args.model)
    if args.split == "all":
        if not args.data_path and record is None:
            raise ConfigError("--split all needs --data_path (this model records no run to take it from)")
        data_path = args.data_path or record["args"]["data_path"]
        seq = args.max_seq_len or context
        limit = -1 if args.max_batches == -1 else (args.max_batches or 50) * args.batch_size
        dataset = stream_blocks(tokenizer, data_path, seq, limit)
        if record is not None and record["args"].get("document_mask"):  # scored as the model was trained
            dataset = with_documents(dataset, tokenizer.eos_token_id)
        indices, what = (
            list(range(len(dataset))),
            f"all of {' '.join(data_path)} in order (not a held-out split)",
        )
    elif record is None:
        raise ConfigError(
            f"{args.model} records no run (no llama_train_run.json or metrics.jsonl), so its {args.split} split "
            "is unknown: pass --split all --data_path SRC to score a source"
        )
    else:
        dataset, indices, what = run_split_blocks(record, args.split, tokenizer, args)
    if not indices:
        raise ConfigError(f"{what}: no block of {(args.max_seq_len or context) + 1} tokens to score")
    text_bytes = TextBytes(tokenizer)
    loss, tokens, bpb = score_blocks(model.to(device), dataset, indices, args.batch_size, device, text_bytes)
    print(
        f"eval loss {loss:.4f} | perplexity {math.exp(min(loss, 50)):.2f} | bits per byte {bpb:.4f} | {what}: "
        f"{tokens:,} tokens"
    )
    return 0


if __name__ == "__main__":
    run_script(main)
