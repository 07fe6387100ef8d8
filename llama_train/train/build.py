"""Start-up steps both trainers run in the same order: seed, model, data, run record; and the
final export. Each is a small function so `train_ddp.py` and `train_deepspeed.py` read line for
line alike. What they build from was decided before them, in main: the model's arguments (derived
once from the flags), the layout, the resume (resuming.resume_point) and --init_from's weights and
tokenizer (weights.init_from)."""

import os
import random
import time
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader
from transformers import default_data_collator

from llama_train.checkpoint.identity import check_data_identity, data_identity
from llama_train.checkpoint.resuming import check_data_size
from llama_train.checkpoint.store import checkpoint_root
from llama_train.distributed.compile import compile_model
from llama_train.distributed.dist import collective_timeout_s
from llama_train.distributed.strategies import Strategy
from llama_train.errors import ConfigError
from llama_train.hf import export_hf
from llama_train.model import ModelArgs, Transformer
from llama_train.steps import StepPlan
from llama_train.telemetry.ledger import LEDGER_FILE, Ledger
from llama_train.telemetry.metrics import device_peak_flops
from llama_train.train.evaluation import record_run
from llama_train.train.tasks import TaskSet, describe, prepare_tasks
from utils.data import (
    MixtureDataset,
    TextBytes,
    check_bos,
    check_vocab,
    create_pretrain_dataset,
    document_datasets,
    left_out_share,
    make_sampler,
    mixture_report,
    prepare_tokenizer,
    save_tokenizer,
    source_datasets,
)


def seed_everything(seed: int):
    random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class Data:
    tokenizer: object
    train_dataset: object
    eval_dataset: object
    train_sampler: object
    eval_loader: DataLoader
    plan: StepPlan
    pin_memory: bool  # page-locked batches, so non_blocking copies to a GPU do not sync the host
    identity: dict  # what it trains on (identity.data_identity): recorded in every checkpoint
    text_bytes: TextBytes | None = None  # the text's UTF-8 bytes scored tokens stand for (bits per byte)
    ledger: Ledger | None = None  # which samples each step reads (steps.train_steps writes it)
    tasks: TaskSet | None = None  # --eval_tasks, encoded (llama_train/train/tasks.py)
    source_loaders: dict | None = None  # a mixture: each source's own eval split, by name
    replica: tuple[int, int] = (0, 1)  # (this rank's data-parallel replica, replicas): who scores what

    def state_at(self, step: int) -> dict:
        """What a checkpoint after `step` records of the data: its position (StepPlan.state_at) and
        how much of the sample ledger had been written (Ledger.mark)."""
        return {**self.plan.state_at(step), "ledger": self.ledger.mark()}


def build_data(
    args, margs: ModelArgs, tokenizer_path: str | None, layout, rank: int, device: torch.device, start=None
) -> Data:
    """Tokenizer (`tokenizer_path`, else trained or reused under --data_output_path), cached datasets,
    samplers and the step plan (from `start`, a resuming.Resume, when resuming); batches for a GPU
    come in pinned memory. The samplers take the rank's data-parallel rank and size in `layout`
    (parallel.Layout): the ranks that hold one model replica read the same data."""
    data_rank, data_world = layout.data_rank(rank), layout.dp
    tokenizer = prepare_tokenizer(
        tokenizer_path, args.data_path, margs.vocab_size, args.data_output_path, args.local_rank
    )
    check_vocab(tokenizer, margs.vocab_size)
    identity = data_identity(args, tokenizer, tokenizer_path)
    check_data_identity(start, identity, args.allow_data_change)  # before any data is built
    saved = os.path.join(args.output_dir, "tokenizer")  # the one export/eval/generate pair with checkpoints
    if rank == 0 and (start is None or not os.path.isdir(saved)):  # a resume reads it: never overwritten
        save_tokenizer(tokenizer, saved)
    train_ds, eval_ds = datasets(args, tokenizer, rank)
    train_sampler = make_sampler(
        train_ds, args.local_rank, train=True, seed=args.seed, rank=data_rank, world_size=data_world
    )
    pin = device.type == "cuda"
    eval_loader = eval_loader_of(eval_ds, args, data_rank, data_world, pin)
    plan = make_plan(args, len(train_ds), data_world, start)
    mixture = getattr(train_ds, "dataset", train_ds)  # under --document_mask: the rows it wraps
    if rank == 0 and isinstance(mixture, MixtureDataset):  # shares as built, and what gets upsampled
        planned = plan.total_steps * args.batch_size * args.accumulation_steps * data_world
        print("\n".join(mixture_report(mixture, planned)), flush=True)
    text_bytes = TextBytes(tokenizer, device)
    run, parent = ledger_lineage(args.output_dir, start)  # a branch is a run of its own
    header = ledger_header(args, plan, identity, layout, start, train_ds)
    ledger = Ledger(args.output_dir, rank, run, header | ({"parent": parent} if parent else {}))
    tasks = eval_tasks(args, tokenizer, rank)
    sources = {n: eval_loader_of(d, args, data_rank, data_world, pin) for n, d in source_datasets(eval_ds)}
    return Data(
        tokenizer, train_ds, eval_ds, train_sampler, eval_loader, plan, pin, identity, text_bytes, ledger,
        tasks, sources or None, (data_rank, data_world),
    )  # fmt: skip


def eval_loader_of(dataset, args, data_rank: int, data_world: int, pin: bool) -> DataLoader:
    """An eval split's loader: in order, each data-parallel replica its DistributedSampler share."""
    sampler = make_sampler(
        dataset, args.local_rank, train=False, seed=args.seed, rank=data_rank, world_size=data_world
    )
    return DataLoader(
        dataset, args.batch_size, sampler=sampler, collate_fn=default_data_collator, pin_memory=pin
    )


def eval_tasks(args, tokenizer, rank: int) -> TaskSet | None:
    """--eval_tasks read and encoded (tasks.prepare_tasks), said on rank 0; None without it."""
    tasks = prepare_tasks(args, tokenizer, args.local_rank)
    if tasks is not None and rank == 0:
        print(describe(tasks), flush=True)
    return tasks


def datasets(args, tokenizer, rank: int) -> tuple:
    """(train, eval): the cached blocks (create_pretrain_dataset); under --document_mask items carry
    their documents' positions, and with --bos_aligned_rows the rows start at documents."""
    if args.bos_aligned_rows:
        check_bos(tokenizer)  # before any data is built
    train_ds, eval_ds = create_pretrain_dataset(
        local_rank=args.local_rank,
        data_path=args.data_path,
        data_split=args.data_split,
        data_output_path=args.data_output_path,
        seed=args.seed,
        tokenizer=tokenizer,
        max_seq_len=args.max_seq_len,
    )
    if not args.document_mask:
        return train_ds, eval_ds
    pair = (train_ds, eval_ds)
    train_ds, eval_ds = document_datasets(
        pair, tokenizer, args.bos_aligned_rows, args.data_output_path, args.local_rank, args.seed
    )
    if rank == 0 and (left := left_out_share(train_ds)) is not None:
        print(
            f"BOS-aligned rows: {len(train_ds):,} train rows of BOS + {args.max_seq_len} tokens; {left:.1%} of the "
            "train split's tokens are left out (the rest of each document cut at a row's end)",
            flush=True,
        )
    return train_ds, eval_ds


def ledger_lineage(output_dir: str, start) -> tuple[str | None, dict | None]:
    """(run id, parent) for the sample ledger. A resume of this output_dir's own checkpoint carries its
    run's id on; a branch (a process resuming another output_dir's checkpoint, as the WSD branch of
    docs/optimizers.md) is a run of its own (None: a new id), whose `parent` names the run it continues
    (from `resumed_from`, at step `done`) and that run's ledger beside the checkpoint, where the
    ledger's reader finds the steps before the branch."""
    if start is None:
        return None, None
    saved = (start.state.get("ledger") or {}).get("run")
    here = os.path.realpath(checkpoint_root(output_dir))
    if os.path.realpath(os.path.dirname(start.path)) == here:
        return saved, None
    source = os.path.dirname(os.path.dirname(os.path.abspath(start.path)))  # <output_dir>/checkpoints/step_N
    return None, {"run": saved, "ledger": os.path.join(source, LEDGER_FILE)}


def ledger_header(args, plan: StepPlan, identity: dict, layout, start, train_ds) -> dict:
    """The sample ledger's `start` record for this process (llama_train/telemetry/ledger.py)."""
    config = getattr(args, "deepspeed_config", None)
    fsdp = " --fsdp" if getattr(args, "fsdp", False) else ""
    trainer = f"train_deepspeed.py {config}" if config else f"train_ddp.py{fsdp}"
    return {
        "done": plan.done,
        "position": plan.start.to_dict(),
        "num_samples": plan.num_samples,
        "global_batch": plan.global_batch,
        "seed": args.seed,
        "data": identity,
        "world_size": layout.world,
        "trainer": trainer,
        "resumed_from": start.path if start else None,
        "sources": ledger_sources(args, train_ds),
        "time": time.time(),
    }


def ledger_sources(args, train_ds) -> dict:
    """The train set's sources, their configured shares and, for a mixture, its index folder (the source of
    every sample: summarize_run.py --mixture counts what each step read)."""
    mixture = getattr(train_ds, "dataset", train_ds)  # under --document_mask: the rows it wraps
    if isinstance(mixture, MixtureDataset):
        return {
            "names": list(mixture.names),
            "shares": list(mixture.shares),
            "index": str(mixture.index_dir.resolve()),
        }
    return {"names": [" ".join(map(str, args.data_path))], "shares": [1.0], "index": None}


def make_plan(args, num_samples: int, world: int, start=None) -> StepPlan:
    """The step plan, continuing `start`'s data position (its step and consumed samples) when
    resuming; a checkpoint of other data is refused (resuming.check_data_size) unless
    --allow_data_change asks for it: then the run goes on at the same step and sample count, in the
    new data's order."""
    done, position = 0, None
    if start is not None:
        if not args.allow_data_change:
            check_data_size(start, num_samples)
        done, position = start.step, start.position(num_samples)
    try:
        return StepPlan.make(
            num_samples,
            args.batch_size,
            args.accumulation_steps,
            world,
            args.epochs,
            args.max_steps,
            done,
            position,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None


def build_model(args, margs: ModelArgs, weights: dict | None = None) -> Transformer:
    """The same initial weights on every rank (same seed, or `weights`: --init_from's), in fp32: the
    engines keep fp32 master weights themselves. `--compile` compiles it in place (llama_train.distributed.compile)."""
    torch.manual_seed(args.seed)
    model = Transformer(margs)
    if weights is not None:
        model.load_state_dict(weights)
    if args.compile:  # before DDP / deepspeed.initialize wrap it
        compile_model(model, "cuda" if torch.cuda.is_available() else "cpu")
    return model


def run_record(
    args, margs: ModelArgs, model: Transformer, strategy: Strategy, dtype: str, device, layout, tokenizer_path
) -> dict:
    """The `config` record of metrics.jsonl: everything needed to compare two runs, the flags with the
    tokenizer the run used (`tokenizer_path`: --tokenizer or --init_from's). A step's tokens are those
    of its data-parallel replicas (model-parallel ranks share theirs)."""
    peak, source = device_peak_flops(device, dtype)
    flags = {k: v for k, v in vars(args).items() if k != "local_rank"}
    return {
        "strategy": strategy.run_name,
        "world_size": layout.world,
        "dtype": dtype,
        "device": str(device),
        "args": {**flags, "tokenizer": tokenizer_path},
        "model": margs.to_dict(),
        "num_params": model.num_params(),
        "flops_per_token": model.flops_per_token(args.max_seq_len),
        "peak_flops": peak,
        "peak_source": source,
        "tokens_per_step": args.batch_size * args.accumulation_steps * layout.dp * args.max_seq_len,
        "layout": {"tp": layout.tp, "sp": layout.sp, "pp": layout.pp, "dp": layout.dp},
        "collective_timeout_s": collective_timeout_s(device),  # then its engine's: gradient_group_timeout_s
    }


def gradient_group_timeout_s(engine, device) -> float | None:
    """The collective timeout of the group that carries the engine's gradient collectives, read back
    (--dist_timeout_minutes at work): DeepSpeed's own data-parallel group (ZeRO's), else the default
    group (DDP's; FSDP2's mesh over every rank is the default group)."""
    return collective_timeout_s(device, engine.gradient_group())


def export_final(state_dict: dict, margs: ModelArgs, tokenizer, output_dir: str, rank: int) -> str | None:
    """Rank 0 writes <output_dir>/hf: loads with AutoModelForCausalLM / AutoTokenizer."""
    if rank != 0:
        return None
    path = os.path.join(output_dir, "hf")
    export_hf({k: v.float() for k, v in state_dict.items()}, margs, path, tokenizer=tokenizer)
    record_run(path, output_dir)  # the export names its run: scripts/eval_ppl.py finds the eval split
    return path
