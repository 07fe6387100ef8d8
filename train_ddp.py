"""Pretrain LLaMA with PyTorch DistributedDataParallel (or FSDP2: --fsdp): the baseline ZeRO is compared against.

    torchrun --nproc_per_node 8 train_ddp.py --preset 1b [--fsdp]   # --fsdp: FSDP2, sharded like ZeRO-3
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST:29500 train_ddp.py ...
    torchrun --nproc_per_node 2 train_ddp.py --preset debug --max_steps 50   # CPU: 2 gloo ranks

Accumulation with no_sync() on all but the last micro-batch, the loss scaled by 1/accumulation,
clipping of the unscaled gradient, autocast bf16 (or fp16 + GradScaler) on GPU, fp32 on CPU.
The twin of this file is train_deepspeed.py; a diff shows only wrap/backward/step/checkpoint.
"""

import torch

from llama_train.checkpoint import portable
from llama_train.checkpoint import store as ckpt
from llama_train.checkpoint.async_save import Saver
from llama_train.checkpoint.weights import init_from
from llama_train.cli import run_main
from llama_train.config import build_parser, derive_accumulation, model_args, parse_args
from llama_train.distributed import parallel
from llama_train.distributed.compile import CompileClock
from llama_train.distributed.dist import all_gather_object, print0, setup_ddp, to_device
from llama_train.ops.watchdog import Watchdog
from llama_train.optim.optimizers import build_lr_scheduler, build_optimizer
from llama_train.steps import MEMORY_STEP, due, train_steps
from llama_train.telemetry.goodput import phase
from llama_train.telemetry.metrics import StepLogger
from llama_train.telemetry.profiling import torch_profiler
from llama_train.telemetry.timing import StepProbe
from llama_train.train.build import build_data, build_model, export_final, run_record, seed_everything
from llama_train.train.ddp import DDPEngine, engine_for, strategy, wrap_model
from llama_train.train.evaluation import evaluate
from llama_train.train.guards import NonFiniteGuard, SpikeGuard, Stopper, injected_spike


def parse():
    parser = build_parser(__doc__.split("\n")[0])
    return parse_args(parser)


def build_engine(args, model, device, dtype: str, total_steps: int, spike: SpikeGuard) -> DDPEngine:
    """DDP (FSDP2 with --fsdp) wrapper, --optimizer (the groups and kernels of the DeepSpeed configs), LR schedule."""
    model = wrap_model(
        model, device, dtype, args
    )  # once a process group is up (llama_train/distributed/fsdp.py)
    optimizer = build_optimizer(model, args)
    scheduler = build_lr_scheduler(optimizer, args, total_steps)
    return engine_for(args)(model, optimizer, scheduler, device, dtype, args.grad_clip, spike)


def full_state_dict(engine, rank: int) -> dict | None:
    """Collective: the full fp32 weights on rank 0, on the CPU (autocast and FSDP2 keep them in fp32)."""
    return engine.full_state_dict(rank)


def save(engine, args, step: int, meta: dict, rank: int, saver: Saver):
    """Rank 0 writes model/optimizer/scheduler/scaler (FSDP2: gathered) atomically; `latest` moves last."""
    portable.dump_state(engine, f"saved_{step}", rank)  # $LLAMA_TRAIN_DUMP_STATE: to compare runs
    root, tag = ckpt.checkpoint_root(args.output_dir), ckpt.tag_for(step)
    state = {**meta, "step": step, "skipped_steps": engine.skipped_steps}  # goes on after any resume
    saver.save(root, tag, ckpt.ddp_files(engine.state_dict(), rank), state)  # `latest` moves last


def resume(engine, args, rank: int, start, meta: dict, plan) -> int:
    """Continue `start` (a verified checkpoint; None: a fresh start, step 0): with the engine's own
    loader where it fits (start.native, decided in checkpoint.resume_point), else through the neutral
    form (portable.py)."""
    if start is None:
        return 0
    if start.native:
        engine.load_state_dict(ckpt.load_ddp_objects(start.path))
    else:
        portable.load_neutral(engine, start)
    return portable.resumed(engine, args, start, meta, plan, rank)


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
    meta = ckpt.run_meta(args, margs, layout, strategy(args), dtype)  # what checkpoints record

    start = ckpt.resume_point(args, meta, rank, world)  # verified, every refusal; None: a fresh start
    init = init_from(args, margs, start, rank, world)  # --init_from: a new run's weights and tokenizer
    model = build_model(args, margs, init.weights)
    with phase("data_build"):  # timed for goodput (llama_train/telemetry/goodput.py), as the load below
        data = build_data(args, margs, init.tokenizer, layout, rank, device, start)
    meta["data"] = data.identity  # its tokenizer and data, recorded beside every checkpoint, held on resume
    record = run_record(args, margs, model, meta["strategy"], dtype, device, layout, init.tokenizer)
    spike = SpikeGuard.from_args(args, rank)  # --skip_loss_zscore / --skip_grad_zscore
    engine = build_engine(args, model, device, dtype, data.plan.total_steps, spike)
    meta["optimizer_groups"] = portable.optimizer_groups(engine)  # recorded beside every checkpoint
    with phase("checkpoint_load"):
        done = resume(engine, args, rank, start, meta, data.plan)
    spike.restore_state(start.state if start else {})  # its windows, saved in `meta`:
    meta["spike_guard"] = spike.state

    total = data.plan.total_steps
    log = StepLogger(args.output_dir, rank, record, total, done, args.log_interval)
    probe = StepProbe(engine, log, device, args.probe_interval)  # time split and bytes, one step in K
    stopper = Stopper(args.stop_after_steps, rank, args.output_dir)  # signals, llama_train.launch's stop
    guard = NonFiniteGuard(args.max_nonfinite_steps, rank)
    clock = CompileClock(args.compile)  # compile time: reported once, not counted as training
    if args.init_from and done == 0:  # where the new run starts from
        log.eval(0, *evaluate(engine, data.eval_loader, device, args.eval_batches))
    dog = Watchdog(args.watchdog_s, args.output_dir, rank, world)  # --watchdog_s: a hang exits 75
    saver = Saver.from_args(args, rank, world)  # --async_save: checkpoints written in the background
    with log, dog, saver, torch_profiler(args.profile, args.output_dir, args.profile_interval) as prof:
        for step, micro_batches in dog.steps(probe.steps(train_steps(data, args.batch_size))):
            loss, grad_norm, lr = train_step(engine, micro_batches, guard, spike, log, step, device)
            clock.exclude_from(log, step)
            prof.step()
            log.step(step, loss, lr, grad_norm, device, skipped=engine.skipped_steps)
            if due(step, args.eval_interval, total):
                log.eval(step, *evaluate(engine, data.eval_loader, device, args.eval_batches))
            stop = stopper.should_stop(step, device)
            if stop or due(step, args.save_interval, total):
                guard.settle()  # the last step's verdict first: nothing non-finite is saved
                save(engine, args, step, {**meta, **data.plan.state_at(step)}, rank, saver)
                log.saved(step)  # a `save` record: the seconds training stood still (--async_save: the copy)
            if stop and step < total:
                saver.wait()  # --async_save: the stop's checkpoint is complete before the line says so
                return print0(
                    f"stopped after step {step}; checkpoint saved, continue with --resume auto", rank=rank
                )

    if not args.no_export:
        path = export_final(full_state_dict(engine, rank), margs, data.tokenizer, args.output_dir, rank)
        print0(f"exported {path}", rank=rank)
    all_gather_object(None)  # keep ranks together until the export is written


if __name__ == "__main__":
    run_main(main)
