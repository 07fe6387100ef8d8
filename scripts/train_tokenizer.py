"""Train a LLaMA-style sentencepiece BPE tokenizer and save it as a transformers tokenizer dir.

    python scripts/train_tokenizer.py --data_path builtin --vocab_size 8192 --output_dir tokenizers/builtin-8k
    python scripts/train_tokenizer.py --data_path corpus/*.jsonl extra.txt --vocab_size 32000 --output_dir tok32k

The directory loads with `transformers.AutoTokenizer.from_pretrained(DIR)` (LlamaTokenizer) and
with `utils.data.tokenizer.load_tokenizer(DIR)`; pass it to the trainers as `--tokenizer DIR`.
"""

import argparse
import time

from llama_train.cli import run_script, user_error
from llama_train.errors import UserError
from utils.data import DEFAULT_MAX_TRAIN_CHARS, DEFAULT_VOCAB_SIZE, load_tokenizer, train_tokenizer


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--data_path", nargs="+", default=["builtin"],
        help="text sources, in order: builtin (Python's own docs, offline), .txt (one document per "
        "blank-line-separated block) / .jsonl / .json (field 'text') / .parquet (column 'text') files, "
        "directories, globs, or hf:NAME[:CONFIG] (needs `datasets` and network). Default: builtin",
    )  # fmt: skip
    p.add_argument(
        "--vocab_size", type=int, default=DEFAULT_VOCAB_SIZE,
        help=f"tokens in the vocabulary, including <unk> <s> </s> and the 256 byte tokens; the model's "
        f"--vocab_size must be at least this. Default: {DEFAULT_VOCAB_SIZE}",
    )  # fmt: skip
    p.add_argument(
        "--output_dir", required=True, help="directory to write tokenizer.model, tokenizer.json, ..."
    )
    p.add_argument(
        "--max_chars", type=int, default=DEFAULT_MAX_TRAIN_CHARS,
        help="train on at most this many characters, taken from the sources in order: bounds time and "
        f"memory on large corpora. Default: {DEFAULT_MAX_TRAIN_CHARS:,}",
    )  # fmt: skip
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    try:
        out = train_tokenizer(args.data_path, args.vocab_size, args.output_dir, max_chars=args.max_chars)
    except UserError as e:  # a problem with the input: one `error:` line that says what to do, exit 2
        return user_error(e)
    tok = load_tokenizer(out)
    sample = "Tokenizers split text into pieces: 12345 😀"
    print(f"saved {type(tok).__name__} with {len(tok)} tokens to {out} in {time.perf_counter() - start:.1f}s")
    print(f"  {sample!r} -> {tok.tokenize(sample)}")
    return 0


if __name__ == "__main__":
    run_script(main)
