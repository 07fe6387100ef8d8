"""Generate text from an exported model with transformers' `generate`.

python scripts/generate.py --model outputs/demo/hf --prompt "The list" --max_new_tokens 40
"""

import argparse

import torch

from llama_train.checkpoint.weights import load_for_inference
from llama_train.cli import HelpFormatter, run_script
from llama_train.gpu import inference_device


def main(argv=None):
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
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    device = inference_device(args.device, torch.cuda.is_available())
    model, tokenizer = load_for_inference(args.model, args.tokenizer)
    model = model.to(device)
    sample = args.temperature > 0
    for prompt in args.prompt:
        ids = tokenizer(prompt, return_tensors="pt").to(device)
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
        print(f"> {tokenizer.decode(out[0], skip_special_tokens=True)}")
    return 0


if __name__ == "__main__":
    run_script(main)
