"""Perplexity of an export, a checkpoint or a run on any data source.

    python scripts/eval_ppl.py --model outputs/demo/hf --data_path builtin --max_batches 20
    python scripts/eval_ppl.py --model outputs/demo --data_path my_eval.jsonl --max_seq_len 256

Documents are tokenized with the model's tokenizer, joined with EOS and cut into blocks of
max_seq_len + 1 tokens, exactly as in training; the loss is the token-weighted mean.
"""

import argparse
import math

import torch
from tqdm.auto import tqdm

from llama_train.gpu import inference_device
from llama_train.hf import load_for_inference
from utils.data.sources import iter_documents, resolve_sources


def blocks(tokenizer, data_path: list[str], seq_len: int, max_blocks: int):
    """Yield (seq_len + 1)-token blocks from the documents, streaming."""
    buf, made = [], 0
    for doc in iter_documents(resolve_sources(data_path)):
        buf += tokenizer(doc, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        while len(buf) >= seq_len + 1 and made < max_blocks:
            yield torch.tensor(buf[: seq_len + 1])
            buf, made = buf[seq_len:], made + 1
        if made >= max_blocks:
            return


@torch.no_grad()
def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--model", required=True, help="an HF export dir, a checkpoint dir, or a run's output_dir")
    p.add_argument("--tokenizer", help="tokenizer dir (default: the model's)")
    p.add_argument("--data_path", nargs="+", default=["builtin"], help="any trainer data source")
    p.add_argument("--max_seq_len", type=int, default=256, help="tokens per block")
    p.add_argument("--batch_size", type=int, default=8, help="blocks per forward pass")
    p.add_argument("--max_batches", type=int, default=50, help="stop after this many batches")
    p.add_argument(
        "--device", default="auto", help="auto (the GPU when there is one), cpu, cuda, cuda:1, ..."
    )
    args = p.parse_args(argv)

    device = inference_device(args.device, torch.cuda.is_available())
    model, tokenizer = load_for_inference(args.model, args.tokenizer)
    model = model.to(device)
    total, count, batch = 0.0, 0, []
    stream = blocks(tokenizer, args.data_path, args.max_seq_len, args.batch_size * args.max_batches)
    for block in tqdm(stream, total=args.batch_size * args.max_batches, desc="eval", unit="block"):
        batch.append(block)
        if len(batch) == args.batch_size:
            x = torch.stack(batch).to(device)
            logits = model(input_ids=x[:, :-1]).logits  # targets are the next tokens, as in training
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
            n = x[:, 1:].numel()
            total, count, batch = total + loss.item() * n, count + n, []
    if count == 0:
        raise SystemExit(
            f"error: {args.data_path} gave fewer than {args.batch_size} blocks of {args.max_seq_len + 1} tokens"
        )
    loss = total / count
    print(f"eval loss {loss:.4f} | perplexity {math.exp(loss):.2f} | {count:,} tokens")


if __name__ == "__main__":
    main()
