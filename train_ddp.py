"""Pretrain LLaMA with PyTorch DistributedDataParallel: the baseline ZeRO is compared against.

    torchrun --nproc_per_node 8 train_ddp.py --preset 1b
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST:29500 train_ddp.py ...
    torchrun --nproc_per_node 2 train_ddp.py --preset debug --max_steps 50   # CPU: 2 gloo ranks

Accumulation with no_sync() on all but the last micro-batch, the loss scaled by 1/accumulation,
clipping of the unscaled gradient, autocast bf16 (or fp16 + GradScaler) on GPU, fp32 on CPU.
The twin of this file is train_deepspeed.py; a diff shows only wrap/backward/step/checkpoint.
"""

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from llama_train import checkpoint as ckpt
from llama_train import parallel
from llama_train.build import build_data, build_model, export_final, run_record, seed_everything
from llama_train.cli import run_main
from llama_train.config import build_parser, derive_accumulation, parse_args
from llama_train.ddp import DDPEngine, wrap_ddp
from llama_train.dist import all_gather_object, print0, setup_ddp, to_device
from llama_train.evaluation import evaluate
from llama_train.guards import NonFiniteGuard, Stopper
from llama_train.metrics import StepLogger
from llama_train.optim import build_adamw, build_lr_scheduler
from llama_train.profiling import torch_profiler
from llama_train.steps import MEMORY_STEP, due, train_steps


def parse():
    parser = build_parser(__doc__.split("\n")[0])
    return parse_args(parser)


def build_engine(args, model, device, dtype: str, total_steps: int) -> DDPEngine:
    """DDP wrapper, torch AdamW (the groups and kernel of the DeepSpeed configs), LR schedule."""
    model = wrap_ddp(model, device, args.find_unused_parameters)  # DDP once a process group is up
    optimizer = build_adamw(model, args)
    scheduler = build_lr_scheduler(optimizer, args, total_steps)
    return DDPEngine(model, optimizer, scheduler, device, dtype, args.grad_clip)


def full_state_dict(engine, rank: int) -> dict | None:
    """The full fp32 weights (autocast keeps them so) on rank 0, copied to CPU: every rank holds them all."""
    if rank == 0:
        return {k: v.detach().float().cpu() for k, v in engine.module.state_dict().items()}
    return None


def save(engine, args, step: int, meta: dict, rank: int):
    """Rank 0 writes model/optimizer/scheduler/scaler atomically; `latest` moves last."""
    root, tag = ckpt.checkpoint_root(args.output_dir), ckpt.tag_for(step)
    ckpt.save_ddp_checkpoint(
        root, tag, engine.state_dict(), {**meta, "step": step}, rank, args.hash_checkpoints
    )
    ckpt.publish(root, tag, args.keep_last, rank)


def resume(engine, args, rank: int, run_state: dict) -> int:
    path = ckpt.find_resume(args.resume, args.output_dir)
    if path is None:
        return 0
    # intact and the same data order, before loading; each file checked by one rank
    world, hashes = run_state["world_size"], args.hash_checkpoints
    state = ckpt.verify_checkpoint(path, expect=run_state, rank=rank, world=world, hashes=hashes)
    engine.load_state_dict(ckpt.load_ddp_objects(path, ["model", "optimizer", "scheduler", "scaler"]))
    ckpt.restore_rng(path, rank)
    print0(f"resumed from {path} at step {state['step']}", rank=rank)
    return state["step"]


def train_step(engine, micro_batches, guard, log, step, device):
    """forward -> backward (accumulating) -> clip + AdamW + LR step (DDPEngine.step), which skip a
    non-finite update on the device. Returns (mean loss, grad norm, LR), all without a host sync."""
    loss_sum = torch.zeros((), device=device)
    for i, batch in enumerate(micro_batches):
        # all-reduce gradients only on the last micro-batch; earlier ones accumulate locally
        last = i == len(micro_batches) - 1
        with (
            contextlib.nullcontext() if last or not isinstance(engine.model, DDP) else engine.model.no_sync()
        ):
            _, loss = engine(**to_device(batch, device))
            engine.backward(loss / len(micro_batches))  # the mean over micro-batches
        loss_sum += loss.detach()
    if step == MEMORY_STEP:
        log.memory(step, engine, device)
    grad_norm, lr = engine.step(guard, step)
    if log.due(step):
        guard.settle()  # the log line's skipped-step count is exact (logging syncs anyway)
    return loss_sum / len(micro_batches), grad_norm, lr


def main():
    args = parse()
    rank, world, device, dtype = setup_ddp(args)  # nccl on GPU, gloo on CPU
    layout = parallel.plan_layout(args, world)  # model-parallel ranks and data-parallel replicas
    derive_accumulation(args, layout.dp)
    seed_everything(args.seed)

    model, margs = build_model(args)
    data = build_data(args, margs, rank, world, device, layout)
    record = run_record(args, margs, model, "ddp", world, dtype, device, layout)
    engine = build_engine(args, model, device, dtype, data.plan.total_steps)
    run_state = ckpt.run_shape(args, world, layout)  # what a resume must not change
    done = resume(engine, args, rank, run_state)
    meta = {**run_state, "model": record["model"], "strategy": record["strategy"]}

    total = data.plan.total_steps
    log = StepLogger(args.output_dir, rank, record, total, done, args.log_interval)
    stopper, guard = Stopper(args.stop_after_steps, rank), NonFiniteGuard(args.max_nonfinite_steps)
    with torch_profiler(args.profile, args.output_dir, args.profile_interval) as prof:
        for step, micro_batches in train_steps(data, args.batch_size, done):
            loss, grad_norm, lr = train_step(engine, micro_batches, guard, log, step, device)
            prof.step()
            log.step(step, loss, lr, grad_norm, device, skipped=engine.skipped_steps)
            if due(step, args.eval_interval, total):
                log.eval(step, *evaluate(engine, data.eval_loader, device, args.eval_batches))
            stop = stopper.should_stop(step, device)
            if stop or due(step, args.save_interval, total):
                guard.settle()  # the last step's verdict first: nothing non-finite is saved
                save(engine, args, step, meta, rank)
                log.reset_timer(step)
            if stop and step < total:
                return print0(
                    f"stopped after step {step}; checkpoint saved, continue with --resume auto", rank=rank
                )
    log.close()

    if not args.no_export:
        path = export_final(full_state_dict(engine, rank), margs, data.tokenizer, args.output_dir, rank)
        print0(f"exported {path}", rank=rank)
    all_gather_object(None)  # keep ranks together until the export is written


if __name__ == "__main__":
    run_main(main)
