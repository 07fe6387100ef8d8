"""Export a checkpoint (DeepSpeed, any ZeRO stage, or DDP) to a transformers directory.

    python scripts/export_hf.py --checkpoint outputs/run --output_dir outputs/run/hf_step
    python scripts/export_hf.py --checkpoint outputs/run/checkpoints/step_00001000 --output_dir exp --dtype bfloat16

The result (safetensors + tokenizer) loads with AutoModelForCausalLM / AutoTokenizer.
"""

import argparse
import os

import torch

from llama_train.checkpoint.store import resolve_checkpoint, run_dir
from llama_train.checkpoint.weights import consolidated_state_dict
from llama_train.cli import HelpFormatter, run_script
from llama_train.hf import export_hf
from llama_train.model import ModelArgs
from llama_train.train.evaluation import record_run
from utils.data import load_tokenizer


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    p.add_argument(
        "--checkpoint", required=True, help="a checkpoint dir, or a run's output_dir (uses its latest)"
    )
    p.add_argument("--output_dir", required=True, help="where to write the transformers directory")
    p.add_argument("--tokenizer", help="tokenizer dir or .model (default: the run's <output_dir>/tokenizer)")
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weights dtype"
    )
    args = p.parse_args(argv)
    ckpt = resolve_checkpoint(args.checkpoint)
    state_dict, model = consolidated_state_dict(ckpt)
    run = run_dir(ckpt)
    tokenizer = load_tokenizer(args.tokenizer or os.path.join(run, "tokenizer"))
    export_hf(
        state_dict, ModelArgs(**model), args.output_dir, tokenizer=tokenizer, dtype=getattr(torch, args.dtype)
    )
    record_run(args.output_dir, run)  # so scripts/eval_ppl.py finds the run's eval split
    print(f"exported {ckpt} -> {args.output_dir}")
    return 0


if __name__ == "__main__":
    run_script(main)
