"""Generate text from an exported model with transformers' `generate`, or through DeepSpeed's inference engine.

python scripts/generate.py --model outputs/demo/hf --prompt "The list" --max_new_tokens 40
deepspeed --num_gpus 2 scripts/generate.py --model outputs/demo/hf --ds_inference --compare --temperature 0

--ds_inference runs the model through `deepspeed.init_inference`, tensor parallel over the launcher's
ranks (AutoTP, no kernel injection: llama_train/distributed/inference.py); --compare also runs the plain
model on each rank and prints, per prompt, whether the greedy tokens are identical, the largest logit
difference and each one's latency and tokens/s (exit 1 when the tokens differ or, in fp32, a logit
differs by more than 1e-5).
"""

import argparse
import copy
import time

import torch

from llama_train.checkpoint.weights import load_for_inference
from llama_train.cli import HelpFormatter, run_script
from llama_train.gpu import inference_device

LOGIT_TOLERANCE = 1e-5  # fp32: the engine's split matmuls sum in another order, nothing more


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--model", required=True, help="an HF export dir, a checkpoint dir, or a run's output_dir")
    p.add_argument(
        "--tokenizer", help="tokenizer dir (default: the export's, or the run's <output_dir>/tokenizer)"
    )
    p.add_argument("--prompt", nargs="+", default=["The"], help="one or more prompts")
    p.add_argument("--max_new_tokens", type=int, default=40, help="tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (0: greedy)")
    p.add_argument("--top_k", type=int, default=50, help="sample from the k most likely tokens")
    p.add_argument("--top_p", type=float, default=0.95, help="nucleus sampling mass")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument(
        "--device", default="auto", help="auto (the GPU when there is one), cpu, cuda, cuda:1, ..."
    )
    p.add_argument(
        "--ds_inference",
        action="store_true",
        help="through DeepSpeed's inference engine (deepspeed.init_inference), tensor parallel over the ranks of "
        "`deepspeed --num_gpus N` (AutoTP; fp32 weights as exported)",
    )
    p.add_argument(
        "--compare",
        action="store_true",
        help="with --ds_inference: the plain model too, greedy tokens and logits compared, latency and tokens/s of both",
    )
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    return p.parse_args(argv)


def generate(model, tokenizer, prompt: str, args, device) -> tuple[torch.Tensor, float]:
    """(prompt + generated ids, seconds) of one prompt: sampled, or greedy with --temperature 0."""
    ids = tokenizer(prompt, return_tensors="pt").to(device)
    sample = args.temperature > 0
    torch.manual_seed(args.seed)  # every rank of a tensor-parallel engine draws the same token
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            **ids,
            max_new_tokens=args.max_new_tokens,
            do_sample=sample,
            temperature=args.temperature if sample else None,
            top_k=args.top_k if sample else None,
            top_p=args.top_p if sample else None,
            pad_token_id=tokenizer.eos_token_id,
        )
    return out, time.perf_counter() - t0


def compare_line(prompt_len: int, plain, engine, seconds: tuple[float, float], logits) -> tuple[str, bool]:
    """One prompt's comparison: identical tokens, the largest logit difference, latency and tokens/s."""
    same = torch.equal(plain, engine)
    diff = (logits[0] - logits[1]).abs().max().item()
    new = plain.shape[1] - prompt_len
    speed = ", ".join(
        f"{name} {s * 1000:.0f} ms ({new / s:,.1f} tokens/s)"
        for name, s in zip(("plain", "ds_inference"), seconds)
    )
    ok = same and diff <= LOGIT_TOLERANCE
    return f"  greedy tokens {'identical' if same else 'DIFFER'}, max |logit diff| {diff:.2e}; {speed}", ok


def main(argv=None):
    args = parse_args(argv)
    device = inference_device(args.device, torch.cuda.is_available())
    model, tokenizer = load_for_inference(args.model, args.tokenizer)
    model = model.to(device)
    rank, plain, ok = 0, None, True
    if args.ds_inference:
        from llama_train.distributed.inference import ds_inference, setup_inference

        rank, world = setup_inference(torch.device(device).type)
        plain = copy.deepcopy(model) if args.compare else None  # the engine splits `model` in place
        model = ds_inference(model, world, next(model.parameters()).dtype).module
    for prompt in args.prompt:
        out, seconds = generate(model, tokenizer, prompt, args, device)
        if rank == 0:
            print(f"> {tokenizer.decode(out[0], skip_special_tokens=True)}", flush=True)
        if plain is not None:
            ref, ref_seconds = generate(plain, tokenizer, prompt, args, device)
            with torch.no_grad():
                logits = [m(input_ids=ref, use_cache=False).logits for m in (plain, model)]
            n = len(tokenizer(prompt)["input_ids"])
            line, same = compare_line(n, ref, out, (ref_seconds, seconds), logits)
            ok = ok and same
            if rank == 0:
                print(line, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    run_script(main)
