"""Pretrain LLaMA on the raw DeepSpeed engine (ZeRO-0/1/2/3, CPU offload, bf16/fp16/fp32).

    deepspeed --num_gpus 8 train_deepspeed.py --deepspeed_config ds_configs/zero2.json --preset 1b
    deepspeed --hostfile hostfile train_deepspeed.py --deepspeed_config ds_configs/zero3.json ...
    deepspeed --num_gpus 2 train_deepspeed.py --preset debug --max_steps 50   # CPU: 2 gloo ranks

The engine owns gradient accumulation, clipping, mixed precision and the optimizer (AdamW from
the config; DeepSpeedCPUAdam when the optimizer is offloaded). `ds_configs/*.json` say "auto"
for everything the command line decides. The twin of this file is train_ddp.py.
"""

import os

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.utils import clip_grad_norm_

from llama_train import checkpoint as ckpt
from llama_train.build import build_data, build_model, export_final, run_main, run_record, seed_everything
from llama_train.config import build_parser, derive_accumulation, parse_args
from llama_train.dist import (
    all_gather_object,
    ensure_launcher_env,
    print0,
    release_deepspeed_shm,
    resolve_dtype,
    set_cpu_threads,
    warn_stale_build_locks,
)
from llama_train.ds_config import cli_values, fill_ds_config, load_ds_config, zero_stage
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
    g = parser.add_argument_group("deepspeed")
    g.add_argument(
        "--deepspeed_config",
        default="ds_configs/zero2.json",
        help="engine knobs; 'auto' values come from flags",
    )
    return parse_args(parser)


def build_ds_config(args, world: int, dtype: str) -> dict:
    """ds_configs/*.json with every "auto" filled from the flags (and contradictions refused)."""
    values = cli_values(
        micro_batch=args.batch_size, accumulation=args.accumulation_steps, world_size=world,
        grad_clip=args.grad_clip, dtype=dtype, lr=args.learning_rate, betas=(args.beta1, args.beta2),
        eps=args.adam_eps, weight_decay=args.weight_decay,
    )  # fmt: skip
    config = fill_ds_config(load_ds_config(args.deepspeed_config), values, source=args.deepspeed_config)
    if args.profile:  # DeepSpeed's flops profiler: per-module FLOPs and latency at one step
        config["flops_profiler"] = {
            "enabled": True, "profile_step": args.profile_interval, "module_depth": -1, "top_modules": 3,
            "detailed": True, "output_file": os.path.join(args.output_dir, "flops_profile.txt"),
        }  # fmt: skip
    return config


def build_engine(args, model, config: dict, total_steps: int):
    """deepspeed.initialize with the filled config, our param groups and LR schedule."""
    engine, _, _, scheduler = deepspeed.initialize(
        model=model,
        model_parameters=param_groups(model, args.weight_decay, args.decay_all_params),
        lr_scheduler=lambda opt: build_scheduler(
            opt, args.learning_rate, args.min_lr, args.warmup_steps, total_steps
        ),
        config=config,
    )
    if not (engine.fp16_enabled() or engine.bfloat16_enabled() or engine.zero_optimization()):
        # plain fp32 without ZeRO: DeepSpeed clips but drops the norm; keep it for the log line
        def clip_and_record():
            norm = clip_grad_norm_(engine.module.parameters(), engine.gradient_clipping())
            engine._global_grad_norm = float(norm)

        engine.clip_fp32_gradients = clip_and_record
    if (
        torch.distributed.get_world_size() == 1
        and not engine.zero_optimization()
        and not engine.bfloat16_enabled()
    ):
        # one process, no ZeRO: the all-reduce is an identity that still flattens and copies back
        # every gradient (~8% of a 25m step on CPU); ZeRO optimizers need the call for their own work
        engine.enable_backward_allreduce = False
    return engine, scheduler


def gathered_state_dict(engine, rank: int) -> dict | None:
    """Full fp32-cast weights on rank 0, gathering ZeRO-3 partitions on every rank first."""
    params = list(engine.module.parameters()) if engine.zero_optimization_stage() == 3 else []
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=bool(params)):
        if rank == 0:
            return {k: v.detach().float().cpu().clone() for k, v in engine.module.state_dict().items()}
    return None


def save(engine, args, step: int, meta: dict, rank: int):
    """Every rank writes its ZeRO shards; `latest` moves only after all have finished."""
    root, tag = ckpt.checkpoint_root(args.output_dir), ckpt.tag_for(step)
    engine.save_checkpoint(root, tag=tag, save_latest=False)  # DeepSpeed's `latest` has no barrier
    ckpt.save_train_state(os.path.join(root, tag), {**meta, "step": step}, rank)
    ckpt.publish(root, tag, args.keep_last, rank)


def resume(engine, args, rank: int, run_state: dict) -> int:
    path = ckpt.find_resume(args.resume, args.output_dir)
    if path is None:
        return 0
    state = ckpt.verify_checkpoint(path, expect=run_state)  # intact and same data order, before loading
    root, tag = os.path.split(path)
    engine.load_checkpoint(root, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True)
    ckpt.restore_rng(path, rank)
    print0(f"resumed from {path} at step {state['step']}", rank=rank)
    return state["step"]


def train_step(engine, micro_batches, guard, log, step, stage, device):
    """forward -> backward -> step per micro-batch; the engine scales the loss by 1/accumulation,
    reduces gradients, clips and steps AdamW + LR at the accumulation boundary."""
    loss_sum = torch.zeros((), device=device)
    for i, batch in enumerate(micro_batches):
        _, loss = engine(**to_device(batch, device))
        engine.backward(loss)
        if step == MEMORY_STEP and i == len(micro_batches) - 1:
            log.memory(step, engine.module.parameters(), engine.optimizer, stage, device)
        engine.step()
        loss_sum += loss.detach()
    grad_norm = engine.get_global_grad_norm()
    # fp16: DeepSpeed's loss scaler skips overflowing steps itself. fp32/bf16: the engine has no
    # way to skip an update, so a non-finite one stops the run before it is saved.
    if not engine.fp16_enabled() and grad_norm is not None and guard.check(torch.tensor(grad_norm), step):
        raise FloatingPointError(
            f"step {step + 1}: non-finite gradient norm; DeepSpeed cannot skip an update outside fp16's "
            "loss scaler. The last checkpoint is intact: lower --learning_rate or --grad_clip and resume"
        )
    return loss_sum / len(micro_batches), grad_norm


def main():
    args = parse()
    ensure_launcher_env()  # plain `python train_deepspeed.py` works as a 1-process run
    if os.environ["LOCAL_RANK"] == "0":
        warn_stale_build_locks()
    deepspeed.init_distributed()  # nccl on GPU, gloo on CPU: DeepSpeed's accelerator decides
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    release_deepspeed_shm(rank, world)
    derive_accumulation(args, world)
    local_rank = int(os.environ["LOCAL_RANK"])
    set_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    device = torch.device(get_accelerator().device_name(local_rank))
    dtype = resolve_dtype(args.dtype, device)
    seed_everything(args.seed)
    config = build_ds_config(args, world, dtype)  # before any work: config errors come first

    model, margs = build_model(args)
    data = build_data(args, margs, rank, world)
    record = run_record(args, margs, model, f"deepspeed-zero{zero_stage(config)}", world, dtype, device)
    engine, scheduler = build_engine(args, model, config, data.plan.total_steps)
    run_state = ckpt.run_shape(args, world)  # what a resume must not change
    start = resume(engine, args, rank, run_state)
    meta = {**run_state, "model": record["model"], "strategy": record["strategy"]}

    log = StepLogger(args.output_dir, rank, record, data.plan.total_steps, start, args.log_interval)
    stopper, guard = Stopper(args.stop_after_steps, rank), NonFiniteGuard(args.max_nonfinite_steps)
    with torch_profiler(args.profile, args.output_dir, args.profile_interval) as prof:
        for step, _epoch, micro_batches in train_steps(data, args.batch_size, start):
            lr = scheduler.get_last_lr()[0]  # the LR this step uses
            loss, grad_norm = train_step(engine, micro_batches, guard, log, step, zero_stage(config), device)
            prof.step()
            done = step + 1
            log.step(step, loss, lr, grad_norm, device, skipped=engine.skipped_steps)
            if due(done, args.eval_interval, data.plan.total_steps):
                log.eval(done, *evaluate(engine, data.eval_loader, device, args.eval_batches))
            stop = stopper.should_stop(done, device)
            if stop or due(done, args.save_interval, data.plan.total_steps):
                save(engine, args, done, meta, rank)
                log.reset_timer(done)
            if stop and done < data.plan.total_steps:
                return print0(
                    f"stopped after step {done}; checkpoint saved, continue with --resume auto", rank=rank
                )
    log.close()

    if not args.no_export:
        path = export_final(gathered_state_dict(engine, rank), margs, data.tokenizer, args.output_dir, rank)
        print0(f"exported {path}", rank=rank)
    all_gather_object(None)  # keep ranks together until the export is written


if __name__ == "__main__":
    run_main(main)
