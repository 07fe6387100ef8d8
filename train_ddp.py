"""Pretrain LLaMA with PyTorch DistributedDataParallel: the baseline ZeRO is compared against.

    torchrun --nproc_per_node 8 train_ddp.py --preset 1b
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST:29500 train_ddp.py ...
    torchrun --nproc_per_node 2 train_ddp.py --preset debug --max_steps 50   # CPU: 2 gloo ranks

Accumulation with no_sync() on all but the last micro-batch, the loss scaled by 1/accumulation,
clipping of the unscaled gradient, autocast bf16 (or fp16 + GradScaler) on GPU, fp32 on CPU.
The twin of this file is train_deepspeed.py; a diff shows only wrap/backward/step/checkpoint.
"""

import contextlib
import math
import os

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from llama_train import checkpoint as ckpt
from llama_train.build import build_data, build_model, export_final, run_main, run_record, seed_everything
from llama_train.config import build_parser, derive_accumulation, parse_args
from llama_train.dist import (
    DTYPE_OF,
    all_gather_object,
    device_for,
    init_distributed,
    print0,
    resolve_dtype,
    set_cpu_threads,
)
from llama_train.loop import (
    MEMORY_STEP,
    NonFiniteGuard,
    StepLogger,
    Stopper,
    due,
    evaluate,
    param_groups,
    to_device,
    torch_profiler,
    train_steps,
)
from llama_train.schedule import build_scheduler


def parse():
    parser = build_parser(__doc__.split("\n")[0])
    return parse_args(parser)


def build_ddp(args, model, device, dtype: str, total_steps: int):
    """DDP wrapper, torch AdamW (same groups as the DeepSpeed run), LR schedule, GradScaler."""
    model = model.to(device)
    if torch.distributed.is_initialized():
        # complex64 rotary table: NCCL cannot broadcast complex tensors and it is not trained anyway
        model._ddp_params_and_buffers_to_ignore = {"pos_cis"}
        model = DDP(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            find_unused_parameters=args.find_unused_parameters,
        )
    optimizer = torch.optim.AdamW(
        param_groups(model, args.weight_decay, args.decay_all_params),
        lr=args.learning_rate,
        betas=(args.beta1, args.beta2),
        eps=args.adam_eps,
        fused=True,  # one kernel for all parameters (CPU and CUDA); 6x faster than the loop on CPU
    )
    scheduler = build_scheduler(optimizer, args.learning_rate, args.min_lr, args.warmup_steps, total_steps)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == "float16")
    return model, optimizer, scheduler, scaler


def save(model, optimizer, scheduler, scaler, args, step: int, meta: dict, rank: int):
    """Rank 0 writes model/optimizer/scheduler/scaler atomically; `latest` moves last."""
    root, tag = ckpt.checkpoint_root(args.output_dir), ckpt.tag_for(step)
    objects = {"model": unwrap(model).state_dict(), "optimizer": optimizer.state_dict(),
               "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict()}  # fmt: skip
    ckpt.save_ddp_checkpoint(root, tag, objects, {**meta, "step": step}, rank)
    ckpt.publish(root, tag, args.keep_last, rank)


def resume(model, optimizer, scheduler, scaler, args, rank: int, run_state: dict) -> int:
    path = ckpt.find_resume(args.resume, args.output_dir)
    if path is None:
        return 0
    state = ckpt.verify_checkpoint(path, expect=run_state)  # intact and same data order, before loading
    objs = ckpt.load_ddp_objects(path, ["model", "optimizer", "scheduler", "scaler"])
    unwrap(model).load_state_dict(objs["model"])
    optimizer.load_state_dict(objs["optimizer"])
    scheduler.load_state_dict(objs["scheduler"])
    scaler.load_state_dict(objs["scaler"])
    ckpt.restore_rng(path, rank)
    print0(f"resumed from {path} at step {state['step']}", rank=rank)
    return state["step"]


def unwrap(model):
    return model.module if isinstance(model, DDP) else model


def train_step(model, optimizer, scheduler, scaler, micro_batches, autocast, guard, log, step, args, device):
    """forward -> backward (accumulating) -> clip -> AdamW step. Returns (mean loss, grad norm)."""
    loss_sum = torch.zeros((), device=device)
    for i, batch in enumerate(micro_batches):
        # all-reduce gradients only on the last micro-batch; earlier ones accumulate locally
        last = i == len(micro_batches) - 1
        with contextlib.nullcontext() if last or not isinstance(model, DDP) else model.no_sync():
            with autocast:
                _, loss = model(**to_device(batch, device))
            scaler.scale(loss / len(micro_batches)).backward()  # the mean over micro-batches
        loss_sum += loss.detach()
    if step == MEMORY_STEP:
        log.memory(step, model.parameters(), optimizer, 0, device)
    scaler.unscale_(optimizer)  # clip the true gradient, not the fp16-scaled one
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip or math.inf)
    # the norm is of all-reduced gradients, so every rank skips (or not) together
    if scaler.is_enabled() or not guard.check(grad_norm, step):  # GradScaler skips inf steps itself
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum / len(micro_batches), grad_norm


def main():
    args = parse()
    rank, world = init_distributed(args.local_rank)  # nccl on GPU, gloo on CPU
    derive_accumulation(args, world)
    set_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    device = device_for(args.local_rank)
    dtype = resolve_dtype(args.dtype, device)
    seed_everything(args.seed)
    autocast = torch.autocast(device.type, dtype=DTYPE_OF[dtype], enabled=dtype != "float32")

    model, margs = build_model(args)
    data = build_data(args, margs, rank, world)
    record = run_record(args, margs, model, "ddp", world, dtype, device)
    model, optimizer, scheduler, scaler = build_ddp(args, model, device, dtype, data.plan.total_steps)
    run_state = ckpt.run_shape(args, world)  # what a resume must not change
    start = resume(model, optimizer, scheduler, scaler, args, rank, run_state)
    meta = {**run_state, "model": record["model"], "strategy": record["strategy"]}

    log = StepLogger(args.output_dir, rank, record, data.plan.total_steps, start, args.log_interval)
    stopper, guard = Stopper(args.stop_after_steps, rank), NonFiniteGuard(args.max_nonfinite_steps)
    with torch_profiler(args.profile, args.output_dir, args.profile_interval) as prof:
        for step, _epoch, micro_batches in train_steps(data, args.batch_size, start):
            lr = scheduler.get_last_lr()[0]  # the LR this step uses
            loss, grad_norm = train_step(
                model, optimizer, scheduler, scaler, micro_batches, autocast, guard, log, step, args, device
            )
            prof.step()
            done = step + 1
            log.step(step, loss, lr, grad_norm, device, skipped=guard.total)
            if due(done, args.eval_interval, data.plan.total_steps):
                with autocast:
                    log.eval(done, *evaluate(model, data.eval_loader, device, args.eval_batches))
            stop = stopper.should_stop(done, device)
            if stop or due(done, args.save_interval, data.plan.total_steps):
                save(model, optimizer, scheduler, scaler, args, done, meta, rank)
                log.reset_timer(done)
            if stop and done < data.plan.total_steps:
                return print0(
                    f"stopped after step {done}; checkpoint saved, continue with --resume auto", rank=rank
                )
    log.close()

    if not args.no_export:
        path = export_final(unwrap(model).state_dict(), margs, data.tokenizer, args.output_dir, rank)
        print0(f"exported {path}", rank=rank)
    all_gather_object(None)  # keep ranks together until the export is written


if __name__ == "__main__":
    run_main(main)
