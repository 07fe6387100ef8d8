"""What a run trains on, recorded in every checkpoint (trainer_state.json's `data`) and held on
resume: its tokenizer and its data. A mixture has the same number of blocks whatever its weights,
and another corpus may happen to give the same count, so the sequence count alone (checkpoint.
check_data_size) does not notice a change; the identity does, before any data is built.

A resume reads the run's own tokenizer (<output_dir>/tokenizer, written on the run's fresh start
only), so a requeued `--init_from` job does not train a new one on --data_path."""

import os

from llama_train.checkpoint.store import run_dir
from llama_train.errors import CheckpointError
from utils.data import parse_mixture, pretrain_cache_dir, tokenizer_fingerprint

CHANGE_FLAG = "--allow_data_change"


def run_tokenizer(args, start) -> str | None:
    """The tokenizer path a run starts from: --tokenizer when given (a resume checks it against the
    recorded one); on a resume, the run's own <output_dir>/tokenizer; else None (trained on --data_path)."""
    if start is None or args.tokenizer:
        return args.tokenizer
    saved = os.path.join(run_dir(start.path), "tokenizer")
    return saved if os.path.isdir(saved) else None


def data_identity(args, tokenizer, tokenizer_path: str | None) -> dict:
    """The tokenizer's content fingerprint (and where it came from), each dataset cache's key (its
    sources' content, tokenizer, split, seed, sequence length), the mixture weights, the split."""
    mixture = parse_mixture(args.data_path)
    parts = [[src] for _, src in mixture] if mixture else [args.data_path]
    caches = [
        pretrain_cache_dir(
            p, args.data_split, args.data_output_path, args.seed, tokenizer, args.max_seq_len
        ).name
        for p in parts
    ]
    return {
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "tokenizer_path": tokenizer_path or tokenizer.name_or_path,
        "caches": caches,
        "weights": [round(share, 6) for share, _ in mixture] if mixture else None,
        "data_split": args.data_split,
        "documents": document_rows(args),
    }


def data_changes(was: dict | None, now: dict) -> list[str]:
    """What differs between two data identities (data_identity), one phrase each; none for a checkpoint
    from before the identity was recorded."""
    names = {
        "weights": "mixture weights",
        "caches": "dataset caches (--data_path content)",
        "data_split": "data_split",
        "documents": "documents in rows (--document_mask, --bos_aligned_rows)",
    }
    if not was:
        return []
    return [
        f"{what}: checkpoint {was.get(k)!r}, now {now[k]!r}"
        for k, what in names.items()
        if was.get(k) != now[k]
    ]


def document_rows(args) -> str | None:
    """How rows hold documents when it is not the default packing: "masked" (--document_mask), "bos"
    (and --bos_aligned_rows); None otherwise, as checkpoints from before these flags record it."""
    if not getattr(args, "document_mask", False):
        return None
    return "bos" if args.bos_aligned_rows else "masked"


def check_data_identity(start, now: dict, allow_change: bool):
    """Refuse a resume whose tokenizer (always) or data (unless --allow_data_change) differs from the
    checkpoint's, naming what changed. Checkpoints from before the identity was recorded pass."""
    was = (start.state if start is not None else {}).get("data")
    if not was:
        return
    if was["tokenizer"] != now["tokenizer"]:
        raise CheckpointError(
            f"cannot resume from {start.path}: the tokenizer changed: its run used {was['tokenizer_path']} "
            f"(fingerprint {was['tokenizer'][:12]}), this one {now['tokenizer_path']} ({now['tokenizer'][:12]}); "
            "resume without --tokenizer (a resume reads its run's <output_dir>/tokenizer)"
        )
    diffs = data_changes(was, now)
    if diffs and not allow_change:
        raise CheckpointError(
            f"cannot resume from {start.path}: the data changed ({'; '.join(diffs)}); resume with the original "
            f"--data_path, or pass {CHANGE_FLAG} to continue at the same sample count on the new data "
            "(docs/reliability.md)"
        )
