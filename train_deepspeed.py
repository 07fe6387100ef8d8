"""Pretrain LLaMA on the raw DeepSpeed engine (ZeRO-0/1/2/3, CPU offload, bf16/fp16/fp32).

    deepspeed --num_gpus 8 train_deepspeed.py --deepspeed_config ds_configs/zero2.json --preset 1b
    deepspeed --hostfile hostfile train_deepspeed.py --deepspeed_config ds_configs/zero3.json ...
    deepspeed --num_gpus 2 train_deepspeed.py --preset debug --max_steps 50   # CPU: 2 gloo ranks

The engine owns gradient accumulation, clipping, mixed precision and the optimizer (AdamW or Muon from
the config; DeepSpeedCPUAdam when the optimizer is offloaded). `ds_configs/*.json` say "auto"
for everything the command line decides. The twin of this file is train_ddp.py.
"""

import torch

from llama_train.checkpoint import resuming
from llama_train.checkpoint import store as ckpt
from llama_train.checkpoint.weights import init_from
from llama_train.cli import run_main
from llama_train.config import build_parser, derive_accumulation, model_args, parse_args
from llama_train.distributed import ds_compat as dsc
from llama_train.distributed import parallel
from llama_train.distributed.dist import all_gather_object, print0, setup_deepspeed, to_device
from llama_train.distributed.ds_config import build_ds_config, load_ds_config
from llama_train.distributed.strategies import run_strategy
from llama_train.optim.adamw import param_groups
from llama_train.optim.optimizers import build_lr_scheduler
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
from llama_train.train.engines.ds_engine import DeepSpeedEngine
from llama_train.train.guards import SpikeGuard, injected_spike
from llama_train.train.services import RunServices


def parse():
    parser = build_parser(__doc__.split("\n")[0], deepspeed=True)
    return parse_args(parser)


def build_engine(args, model, config: dict, layout, strategy, total_steps: int, spike) -> DeepSpeedEngine:
    """deepspeed.initialize with the filled config, our param groups and LR schedule, on this rank's part."""
    import deepspeed  # here, not at the top: after llama_train chose DeepSpeed's accelerator (its __init__)

    model = parallel.parallelize(model, layout, args.gradient_checkpointing)
    dsc.keep_our_split()  # ds_compat: DeepSpeed's own tags would override the optimizer record's split
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=param_groups(model, args.weight_decay, args.decay_all_params),
        lr_scheduler=lambda optimizer: build_lr_scheduler(optimizer, args, total_steps),
        config=config,
        mpu=parallel.mpu(layout),
    )
    return DeepSpeedEngine(engine, strategy, layout, config, spike)  # patched (ds_compat), groups checked


def train_step(engine, micro_batches, guard, spike, log, step, device):
    """forward -> backward -> step per micro-batch; the engine scales the loss by 1/accumulation, reduces
    gradients, clips and steps AdamW + LR at the accumulation boundary. Returns (mean loss, grad norm, LR)."""
    if engine.pipelined:  # train_batch: every micro-batch through the stages, then the step
        lr, skipped = engine.lr_scheduler.get_last_lr()[0], engine.skipped_steps
        measure = (lambda: log.memory(step, engine, device)) if step == MEMORY_STEP else None
        loss = parallel.train_batch(engine.ds, micro_batches, device, measure)
        return loss, settle(engine, guard, log, step, skipped, loss), lr
    loss_sum = torch.zeros((), device=device)
    for i, batch in enumerate(micro_batches):
        _, loss = engine(**to_device(batch, device))
        loss = injected_spike(loss, step)  # tests only: LLAMA_TRAIN_TEST_SPIKE
        engine.backward(loss)
        loss_sum += loss.detach()
        if i == len(micro_batches) - 1:
            spike.observe(step, loss_sum / len(micro_batches), device)  # the step's loss, before its update
            if step == MEMORY_STEP:
                log.memory(step, engine, device)
            guard.settle()  # the previous step's verdict: bf16 ZeRO-1/2 skip on the device, then hold its LR
            lr = engine.lr_scheduler.get_last_lr()[0]  # the LR this step uses
            skipped = engine.skipped_steps  # did engine.step() drop this update (guards.deepspeed_verdict)?
        engine.step()
    return loss_sum / len(micro_batches), settle(engine, guard, log, step, skipped, loss_sum), lr


def settle(engine, guard, log, step, skipped_before, loss):
    """The step's grad norm, watched: fp16's scaler skips overflows itself (a non-finite loss counts);
    a non-finite fp32/bf16 step that the engine dropped counts towards --max_nonfinite_steps, one it
    applied stops the run (DeepSpeedEngine.verdict)."""
    grad_norm = engine.verdict(guard, step, skipped_before, loss)
    if log.due(step):
        guard.settle()  # the log line's skipped-step count is exact (logging syncs anyway)
    return grad_norm


def main():
    args = parse()
    margs = model_args(args)  # the model the flags describe, derived once
    rank, world, device, dtype = setup_deepspeed(args)  # DeepSpeed's accelerator picks nccl or gloo
    ds_config = load_ds_config(args.deepspeed_config)  # read once, finished by build_ds_config
    layout = parallel.plan_layout(args, margs, world, ds_config)  # model-parallel ranks, dp replicas
    args = derive_accumulation(args, layout.dp)  # --global_batch_size: the one change to the flags
    seed_everything(args.seed)
    config = build_ds_config(ds_config, args, margs, layout, dtype)  # the dict deepspeed.initialize gets
    strategy = run_strategy(config, layout.name)  # resolved once: ZeRO stage, offloads, layout
    meta, saving = ckpt.run_meta(args, margs, layout, strategy, dtype), checkpoint_settings(args)

    start = resuming.resume_point(saving, meta, rank, world)  # verified, every refusal; None: a fresh start
    init = init_from(args, margs, start, rank, world)  # --init_from: a new run's weights and tokenizer
    model = build_model(args, margs, init.weights)
    with phase("data_build"):  # timed for goodput (llama_train/telemetry/goodput.py), as the load below
        data = build_data(args, margs, init.tokenizer, layout, rank, device, start)
    meta["data"] = data.identity  # its tokenizer and data, recorded beside every checkpoint, held on resume
    record = run_record(args, margs, model, strategy, dtype, device, layout, init.tokenizer)
    spike = SpikeGuard.from_args(args, rank)  # --skip_loss_zscore / --skip_grad_zscore
    engine = build_engine(args, model, config, layout, strategy, data.plan.total_steps, spike)
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
