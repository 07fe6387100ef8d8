"""Held-out loss, perplexity and bits per byte, the same for every strategy, in training and offline.

Bits per byte (bpb) = the scored tokens' loss summed in nats / ln 2 / the UTF-8 bytes of the text
those tokens stand for (utils.data.TextBytes: special tokens such as EOS are 0 bytes but their loss
counts; SentencePiece's dummy prefix before each document is no byte of the text). Unlike loss and perplexity per token it does not depend on how finely the
tokenizer cuts the text, so runs with different tokenizers or vocab sizes compare on it."""

import json
import math
import os
from dataclasses import replace

import torch

from llama_train.distributed.dist import all_reduce_mean, to_device
from llama_train.errors import ConfigError
from llama_train.telemetry.metrics import config_record
from utils.data import create_pretrain_dataset, document_datasets, document_positions


def bits_per_byte(nats: float, num_bytes: float) -> float:
    """A loss summed in nats, in bits per byte of the text it was scored on (NaN for no bytes)."""
    return nats / math.log(2) / num_bytes if num_bytes > 0 else float("nan")


@torch.no_grad()
def evaluate(engine, data, device: torch.device, max_batches: int) -> tuple[float, float, float]:
    """Token-weighted mean eval loss over ranks, its perplexity and bits per byte, on `data.eval_loader`
    (a build.Data; `data.text_bytes`: a utils.data.TextBytes on `device`), from any Engine
    (engines/engine.py: eval_loss, train, eval)."""
    engine.eval()
    total, count, num_bytes = 0.0, 0, 0
    for i, batch in enumerate(data.eval_loader):
        if 0 <= max_batches <= i:
            break
        batch = to_device(batch, device)
        loss = engine.eval_loss(batch)
        scored = int((batch["labels"] != -100).sum())
        total, count = total + loss.item() * scored, count + scored
        num_bytes += data.text_bytes.count(batch["input_ids"], batch["labels"])
    engine.train()
    total, count, num_bytes = all_reduce_mean([total, count, num_bytes], device)
    loss = total / max(count, 1)
    return loss, math.exp(min(loss, 50.0)), bits_per_byte(total, num_bytes)


def evaluate_sources(engine, data, device: torch.device, max_batches: int) -> dict[str, dict]:
    """A mixture's eval loss and bits per byte per source (`data.source_loaders`: each source's own eval
    split, read whole as `evaluate` reads the blend, so the same under every strategy); {} otherwise."""
    out = {}
    for name, loader in (data.source_loaders or {}).items():
        loss, _, bpb = evaluate(engine, replace(data, eval_loader=loader), device, max_batches)
        out[name] = {"eval_loss": loss, "eval_bpb": bpb}
    return out


# --- scoring an export or a checkpoint offline (scripts/eval_ppl.py) on the run's own split ---

RUN_FILE = "llama_train_run.json"  # in an export: the run's `config` record, so its eval split is known


def read_run_record(run_dir: str) -> dict | None:
    """The `config` record of the run whose --output_dir is `run_dir` (telemetry.metrics.config_record)."""
    return config_record(os.path.join(run_dir, "metrics.jsonl"))


def record_run(export_dir: str, run_dir: str):
    """Copy the run's `config` record into an export, so the export alone names its eval split."""
    record = read_run_record(run_dir)
    if record is not None:
        with open(os.path.join(export_dir, RUN_FILE), "w") as f:
            json.dump(record, f, indent=2)


def find_run_record(model_path: str) -> dict | None:
    """The config record for an export (its RUN_FILE, else its parent run's), a run's output_dir, or a
    checkpoint inside one (<run>/checkpoints/step_N); None for a model from elsewhere."""
    path = os.path.abspath(model_path)
    if os.path.isfile(os.path.join(path, RUN_FILE)):
        with open(os.path.join(path, RUN_FILE)) as f:
            return json.load(f)
    for run_dir in (path, os.path.dirname(path), os.path.dirname(os.path.dirname(path))):
        if (record := read_run_record(run_dir)) is not None:
            return record
    return None


def data_parallel_size(record: dict) -> int:
    """The ranks that read different eval blocks in the run of `record`: its data-parallel size (ranks
    holding one model replica, tensor or pipeline parallel, read the same blocks); the world size for
    records from before the layout was recorded."""
    return (record.get("layout") or {}).get("dp", record["world_size"])


def trainer_eval_indices(n_blocks: int, world: int, batch_size: int, eval_batches: int) -> list[int]:
    """The eval blocks the trainer's evaluation reads: each of `world` data-parallel ranks' DistributedSampler
    share (padded as it pads), at most `eval_batches` batches of `batch_size` from each (-1: all)."""
    from torch.utils.data import DistributedSampler

    per_rank = None if eval_batches < 0 else eval_batches * batch_size
    indices = []
    for rank in range(world):
        sampler = DistributedSampler(range(n_blocks), num_replicas=world, rank=rank, shuffle=False)
        indices += list(sampler)[:per_rank]
    return indices


@torch.no_grad()
def score_blocks(
    model, dataset, indices: list[int], batch_size: int, device, text_bytes=None
) -> tuple[float, int, float]:
    """(token-weighted mean loss, tokens, bits per byte) of a transformers causal LM on `dataset[i]` for
    `indices` (items {"input_ids", "labels"[, "position_ids"]} with pre-shifted labels, as the trainers
    read them: given position_ids and no KV cache, transformers keeps attention within each document as
    our model does).
    `text_bytes`: a utils.data.TextBytes (on the CPU); None: bpb is NaN."""
    from tqdm.auto import tqdm

    total, count, num_bytes = 0.0, 0, 0
    for start in tqdm(range(0, len(indices), batch_size), desc="eval", unit="batch", disable=None):
        items = [dataset[i] for i in indices[start : start + batch_size]]
        batch = {k: torch.stack([it[k] for it in items]).to(device) for k in items[0]}
        y = batch.pop("labels")
        logits = model(**batch, use_cache=False).logits  # no cache: transformers reads packed position_ids
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        n = y.numel()
        total, count = total + loss.item() * n, count + n
        num_bytes += text_bytes.count(batch["input_ids"].cpu(), y.cpu()) if text_bytes is not None else 0
    return total / max(count, 1), count, bits_per_byte(total, num_bytes)


def with_documents(items: list[dict], eos_id: int) -> list[dict]:
    """stream_blocks' items with the document positions --document_mask training gives them."""
    return [{**it, "position_ids": document_positions(it["input_ids"], eos_id)} for it in items]


def _sources(data_path) -> str:
    return " ".join(map(str, data_path)) if isinstance(data_path, list | tuple) else str(data_path)


def run_split_blocks(record: dict, split: str, tokenizer, opts) -> tuple[object, list[int], str]:
    """(dataset, block indices, description) of the run's own `split` ("eval": held out, "train"),
    rebuilt from its config record: the same sources, split, seed and sequence length, so the blocks
    are the trainer's (its data cache is reused when it is still there). `opts`: data_path,
    data_output_path, max_seq_len, batch_size, max_batches (None: the run's / the trainer's)."""
    a = record["args"]
    if opts.data_path is not None and list(opts.data_path) != list(a["data_path"]):
        raise ConfigError(
            f"--data_path {_sources(opts.data_path)} is not this run's data ({_sources(a['data_path'])}): its "
            f"{split} split is undefined there; pass --split all to score every block of that source"
        )
    seq, cache = opts.max_seq_len or a["max_seq_len"], opts.data_output_path or a["data_output_path"]
    datasets = create_pretrain_dataset(-1, a["data_path"], a["data_split"], cache, a["seed"], tokenizer, seq)
    if a.get("document_mask"):  # the rows and document boundaries the trainer read
        datasets = document_datasets(datasets, tokenizer, a.get("bos_aligned_rows"), cache, -1, a["seed"])
    train, held_out = datasets
    dataset = held_out if split == "eval" else train
    if opts.max_batches is None and split == "eval" and seq == a["max_seq_len"]:
        dp, batches = data_parallel_size(record), a["eval_batches"]
        indices = trainer_eval_indices(len(dataset), dp, a["batch_size"], batches)
        how = f"the trainer's final evaluation: {dp} data-parallel rank(s) x {batches} batches of {a['batch_size']}"
    else:
        limit = 50 if opts.max_batches is None else opts.max_batches
        indices = list(range(len(dataset) if limit < 0 else min(len(dataset), limit * opts.batch_size)))
        how = f"the first {len(indices)} of {len(dataset)} blocks"
    what = (
        f"{split} split of {_sources(a['data_path'])} (data_split {a['data_split']}, seed {a['seed']}; {how})"
    )
    return dataset, indices, what
