"""Pretrain LLaMA with PyTorch DistributedDataParallel (or FSDP2: --fsdp): the baseline ZeRO is compared against.

    torchrun --nproc_per_node 8 train_ddp.py --preset 1b [--fsdp]   # --fsdp: FSDP2, sharded like ZeRO-3
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST:29500 train_ddp.py ...
    torchrun --nproc_per_node 2 train_ddp.py --preset debug --max_steps 50   # CPU: 2 gloo ranks

Accumulation with no_sync() on all but the last micro-batch, the loss scaled by 1/accumulation,
clipping of the unscaled gradient, autocast bf16 (or fp16 + GradScaler) on GPU, fp32 on CPU.
The twin of this file is train_deepspeed.py; a diff shows only wrap/backward/step/checkpoint.
"""

import torch
from torch.nn.parallel import DistributedDataParallel

from llama_train.checkpoint import resuming
from llama_train.checkpoint import store as ckpt
from llama_train.checkpoint.weights import init_from
from llama_train.cli import run_main
from llama_train.config import build_parser, derive_accumulation, model_args, parse_args
from llama_train.distributed import fsdp, parallel
from llama_train.distributed.dist import DDP_IGNORED, all_gather_object, print0, setup_ddp, to_device
from llama_train.distributed.strategies import run_strategy
from llama_train.optim.optimizers import build_lr_scheduler, build_optimizer
from llama_train.steps import MEMORY_STEP
from llama_train.telemetry.goodput import phase
from llama_train.train.build import (
    build_data,
    build_model,
    export_final,
    gradient_group_timeout_s,
    run_record,
    seed_everything,
)
from llama_train.train.checkpointing import checkpoint_settings, resume, save
from llama_train.train.engines.torch_engine import DDPEngine, engine_for
from llama_train.train.guards import SpikeGuard, injected_spike
from llama_train.train.services import RunServices


def parse():
    parser = build_parser(__doc__.split("\n")[0])
    return parse_args(parser)


def build_engine(args, model, device, dtype: str, strategy, total_steps: int, spike) -> DDPEngine:
    """DDP (FSDP2 with --fsdp) wrapper, --optimizer (the groups and kernels of the DeepSpeed configs), LR schedule."""
    model = model.to(device)
    if args.fsdp:  # fully_shard per block, then the root (distributed/fsdp.py)
        model = fsdp.wrap_fsdp(model, device, dtype, args.fsdp_offload)
    elif torch.distributed.is_initialized():  # a plain `python train_ddp.py` trains the bare model
        model._ddp_params_and_buffers_to_ignore = DDP_IGNORED  # the complex rotary table: NCCL cannot send it
        # gradient_as_bucket_view: the gradients live in DDP's buckets (25 MB), not beside them
        model = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            find_unused_parameters=args.find_unused_parameters,
            gradient_as_bucket_view=True,
        )
    optimizer = build_optimizer(model, args)
    scheduler = build_lr_scheduler(optimizer, args, total_steps)
    return engine_for(strategy)(model, optimizer, scheduler, device, dtype, args.grad_clip, spike, strategy)


def train_step(engine, micro_batches, guard, spike, log, step, device):
    """forward -> backward (accumulating) -> clip + AdamW + LR step (DDPEngine.step), which skip a
    non-finite update on the device. Returns (mean loss, grad norm, LR), all without a host sync."""
    loss_sum = torch.zeros((), device=device)
    for i, batch in enumerate(micro_batches):
        with engine.no_sync_unless(last=i == len(micro_batches) - 1):
            _, loss = engine(**to_device(batch, device))
            loss = injected_spike(loss, step)  # tests only: LLAMA_TRAIN_TEST_SPIKE
            engine.backward(loss / len(micro_batches))  # the mean over micro-batches
        loss_sum += loss.detach()
    if step == MEMORY_STEP:
        log.memory(step, engine, device)
    spike.observe(step, loss_sum / len(micro_batches), device)  # the step's loss, before its update
    grad_norm, lr = engine.step(guard, step)
    if log.due(step):
        guard.settle()  # the log line's skipped-step count is exact (logging syncs anyway)
    return loss_sum / len(micro_batches), grad_norm, lr


def main():
    args = parse()
    margs = model_args(args)  # the model the flags describe, derived once
    rank, world, device, dtype = setup_ddp(args)  # nccl on GPU, gloo on CPU
    layout = parallel.plan_layout(args, margs, world)  # model-parallel ranks and data-parallel replicas
    args = derive_accumulation(args, layout.dp)  # --global_batch_size: the one change to the flags
    seed_everything(args.seed)
    strategy = run_strategy(None, fsdp=args.fsdp, fsdp_offload=args.fsdp_offload)  # resolved once
    meta, saving = ckpt.run_meta(args, margs, layout, strategy, dtype), checkpoint_settings(args)

    start = resuming.resume_point(saving, meta, rank, world)  # verified, every refusal; None: a fresh start
    init = init_from(args, margs, start, rank, world)  # --init_from: a new run's weights and tokenizer
    model = build_model(args, margs, init.weights)
    with phase("data_build"):  # timed for goodput (llama_train/telemetry/goodput.py), as the load below
        data = build_data(args, margs, init.tokenizer, layout, rank, device, start)
    meta["data"] = data.identity  # its tokenizer and data, recorded beside every checkpoint, held on resume
    record = run_record(args, margs, model, strategy, dtype, device, layout, init.tokenizer)
    spike = SpikeGuard.from_args(args, rank)  # --skip_loss_zscore / --skip_grad_zscore
    engine = build_engine(args, model, device, dtype, strategy, data.plan.total_steps, spike)
    meta["optimizer_groups"] = engine.optimizer_groups()  # recorded beside every checkpoint
    record["collective_timeout_s"] = gradient_group_timeout_s(engine, device)  # --dist_timeout_minutes
    with phase("checkpoint_load"):
        done = resume(engine, start, saving, meta, data.plan, rank)
    spike.restore_state(start.state if start else {})  # its windows, saved in `meta`:
    meta["spike_guard"] = spike.state

    with RunServices(args, engine, record, data, done, device, rank, world) as run:  # logger .. profiler
        for step, micro_batches in run.steps():
            loss, grad_norm, lr = train_step(engine, micro_batches, run.guard, spike, run.log, step, device)
            run.stepped(step, loss, lr, grad_norm)  # the log record, the evaluation when due
            if run.save_due(step):  # a stop was asked (signals, the launch front), or --save_interval
                save(engine, saving, step, {**meta, **data.state_at(step)}, rank, run.saver)
                run.saved(step)
            if run.stopped(step):  # after the stop's checkpoint: continue with --resume auto
                return

    if not args.no_export:
        path = export_final(engine.full_state_dict(rank), margs, data.tokenizer, args.output_dir, rank)
        print0(f"exported {path}", rank=rank)
    all_gather_object(None)  # keep ranks together until the export is written


if __name__ == "__main__":
    run_main(main)
