"""Training-loop pieces both trainers share: data order, step plan, evaluation, logging.

Everything here is strategy-agnostic: the trainers differ only in how the model is wrapped
and how backward/step/checkpoint happen. The data position is a pure function of the
optimizer step, which is what makes resume exact.
"""

import contextlib
import math
import os
import signal
import time
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import default_data_collator

from llama_train.dist import all_gather_object, all_reduce_mean
from llama_train.metrics import (
    MetricsWriter,
    expected_model_state_bytes,
    format_step,
    held_tensor_bytes,
    peak_memory_bytes,
)

MEMORY_STEP = 1  # measure model state at the 2nd step: optimizer state exists, grads not yet freed


def param_groups(model: torch.nn.Module, weight_decay: float, decay_all: bool = False) -> list[dict]:
    """AdamW groups: decay matrices; not norms, biases or embeddings (unless `decay_all`)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        skip = p.ndim < 2 or "tok_embeddings" in name or name.endswith("norm.weight")
        (no_decay if skip and not decay_all else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


@dataclass
class StepPlan:
    """How optimizer steps map onto epochs. Leftover micro-batches at an epoch's end are dropped
    so every optimizer step sees exactly `accumulation` micro-batches."""

    batches_per_epoch: int  # micro-batches per rank per epoch
    accumulation: int
    total_steps: int

    @property
    def steps_per_epoch(self) -> int:
        return self.batches_per_epoch // self.accumulation

    @classmethod
    def make(cls, batches_per_epoch: int, accumulation: int, epochs: int, max_steps: int) -> "StepPlan":
        per_epoch = batches_per_epoch // accumulation
        if per_epoch == 0:
            raise ValueError(
                f"the train split gives {batches_per_epoch} micro-batches per rank, fewer than "
                f"--accumulation_steps={accumulation}: use more data, a smaller --batch_size or fewer ranks"
            )
        total = per_epoch * epochs if max_steps < 0 else max_steps
        return cls(batches_per_epoch, accumulation, total)


def train_steps(data, batch_size: int, start_step: int = 0):
    """`data` is a build.Data. Yield (step, epoch, [micro-batches]) from `start_step` on, continuing into further epochs
    (with a new `set_epoch` shuffle each) until `plan.total_steps`."""
    dataset, sampler, plan = data.train_dataset, data.train_sampler, data.plan
    step = start_step
    while step < plan.total_steps:
        epoch, offset = divmod(step, plan.steps_per_epoch)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        indices = list(sampler)[: plan.steps_per_epoch * plan.accumulation * batch_size]
        loader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=indices[offset * plan.accumulation * batch_size :],
            collate_fn=default_data_collator,
            drop_last=True,
        )
        micro = []
        for batch in loader:
            micro.append(batch)
            if len(micro) == plan.accumulation:
                yield step, epoch, micro
                micro, step = [], step + 1
                if step >= plan.total_steps or step % plan.steps_per_epoch == 0:
                    break


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


@torch.no_grad()
def evaluate(model, loader, device: torch.device, max_batches: int) -> tuple[float, float]:
    """Token-weighted mean eval loss over ranks, and its perplexity. `model` may be a DeepSpeed
    engine or a (DDP) module: anything called as model(input_ids=..., labels=...)."""
    model.eval()
    total, count = 0.0, 0
    for i, batch in enumerate(loader):
        if 0 <= max_batches <= i:
            break
        batch = to_device(batch, device)
        _, loss = model(**batch)
        n = int((batch["labels"] != -100).sum())
        total, count = total + loss.item() * n, count + n
    model.train()
    total, count = all_reduce_mean([total, count], device)
    loss = total / max(count, 1)
    return loss, math.exp(min(loss, 50.0))


def due(done: int, interval: int, total: int) -> bool:
    """True every `interval` steps (0: never) and at the last step."""
    return done == total or (interval > 0 and done % interval == 0)


class StepLogger:
    """tqdm bar, one log line per `log_interval` steps, and metrics.jsonl records (rank 0).

    Step time is averaged over the steps since the last log, so only log steps synchronise.
    `record` is the run's `config` record (build.run_record): world size, FLOPs, peak."""

    def __init__(
        self, output_dir: str, rank: int, record: dict, total_steps: int, start_step: int, log_interval: int
    ):
        self.rank, self.record, self.total, self.log_interval = rank, record, total_steps, log_interval
        self.world = record["world_size"]
        self.writer = MetricsWriter(output_dir, rank)
        if start_step == 0:
            self.writer.write("config", **record)
        self.bar = tqdm(
            total=total_steps, initial=start_step, disable=rank != 0, desc="train", dynamic_ncols=True
        )
        self.reset_timer(start_step)

    def reset_timer(self, step: int):
        """Exclude evaluation/checkpoint time from the next throughput figure."""
        self.t0, self.last_step = time.perf_counter(), step

    def step(
        self, step: int, loss: torch.Tensor, lr: float, grad_norm, device, skipped: int = 0
    ) -> dict | None:
        """Record optimizer step `step` (0-based); logs every `log_interval` steps and the last.
        `grad_norm` may be a callable, called only when logging."""
        self.bar.update(1)
        if not due(step + 1, self.log_interval, self.total):
            return None
        grad_norm = grad_norm() if callable(grad_norm) else grad_norm
        (loss_val,) = all_reduce_mean([loss.item()], device)  # mean over ranks; syncs the device
        dt = (time.perf_counter() - self.t0) / max(1, step + 1 - self.last_step)
        tok_s = self.record["tokens_per_step"] / dt
        rec = {
            "step": step + 1,
            "loss": loss_val,
            "lr": lr,
            "grad_norm": None if grad_norm is None else float(grad_norm),
            "tokens_per_s": tok_s,
            "mfu": tok_s * self.record["flops_per_token"] / (self.record["peak_flops"] * self.world),
            "step_time_s": dt,
            "peak_mem_bytes": peak_memory_bytes(device),
            "skipped_steps": skipped,
        }
        self.writer.write("train", **rec)
        if self.rank == 0:
            self.bar.write(format_step(rec, self.total))
        self.reset_timer(step + 1)
        return rec

    def eval(self, step: int, loss: float, ppl: float):
        self.writer.write("eval", step=step, eval_loss=loss, eval_ppl=ppl)
        if self.rank == 0:
            self.bar.write(f"eval   {step:>6}/{self.total} | loss {loss:.4f} | ppl {ppl:.2f}")
        self.reset_timer(step)

    def memory(self, step: int, params, optimizer, stage: int, device):
        """Collective: every rank's model-state bytes, measured from the tensors it holds (params
        and grads, optimizer state, other engine buffers), and its peak memory, next to the ZeRO
        paper's expectation; one `memory` record. Call between backward and the optimizer step."""
        inner = getattr(optimizer, "optimizer", optimizer)  # the torch optimizer inside a ZeRO wrapper
        roots = {
            "params_and_grads": list(params),
            "optimizer_state": [inner.state],
            "engine_buffers": [optimizer],
        }
        held = all_gather_object((held_tensor_bytes(roots), peak_memory_bytes(device)))
        num_params, dtype = self.record["num_params"], self.record["dtype"]
        self.writer.write(
            "memory", step=step + 1, zero_stage=stage, num_params=num_params, dtype=dtype,
            model_state_bytes=[sum(h.values()) for h, _ in held], breakdown=[h for h, _ in held],
            peak_mem_bytes=[p for _, p in held],
            expected_model_state_bytes=expected_model_state_bytes(stage, num_params, self.world, dtype),
        )  # fmt: skip

    def close(self):
        self.bar.close()


def torch_profiler(enabled: bool, output_dir: str, at_step: int):
    """A torch.profiler that records 3 steps from `at_step`; a trace for TensorBoard/Perfetto.
    Call `.step()` once per optimizer step."""
    if not enabled:
        return contextlib.nullcontext(_NoProfiler())
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    return profile(
        activities=activities,
        schedule=schedule(wait=max(at_step - 1, 0), warmup=1, active=3, repeat=1),
        on_trace_ready=tensorboard_trace_handler(os.path.join(output_dir, "profile")),
        record_shapes=True,
        with_flops=True,
    )


class _NoProfiler:
    def step(self):
        pass


class Stopper:
    """Ends a run early but cleanly: on SIGTERM/SIGINT (preemption, Ctrl-C) or after
    `--stop_after_steps`, the current step finishes, a checkpoint is saved and the run exits 0.
    A second signal exits at once (the default handler is restored after the first)."""

    def __init__(self, stop_after_steps: int, rank: int):
        self.stop_after, self.rank, self.signalled = stop_after_steps, rank, False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame):
        self.signalled = True
        signal.signal(signum, signal.SIG_DFL)
        print(f"[rank {self.rank}] {signal.Signals(signum).name}: finishing this step and saving a checkpoint "
              "(send it again to exit now)", flush=True)  # fmt: skip

    def should_stop(self, done: int, device) -> bool:
        """Collective: every rank stops at the same step if any rank was signalled."""
        (any_signal,) = all_reduce_mean([float(self.signalled)], device)
        return any_signal > 0 or done == self.stop_after


class NonFiniteGuard:
    """Counts optimizer steps whose global gradient norm was inf/NaN (skipped by the caller) and
    stops the run after `limit` in a row: the last checkpoint stays the last good state."""

    def __init__(self, limit: int):
        self.limit, self.in_a_row, self.total = limit, 0, 0

    def check(self, grad_norm: torch.Tensor, step: int) -> bool:
        """True if this step's update must be skipped (the norm is the same on every rank)."""
        if torch.isfinite(grad_norm):
            self.in_a_row = 0
            return False
        self.in_a_row, self.total = self.in_a_row + 1, self.total + 1
        if self.in_a_row >= self.limit:
            raise FloatingPointError(
                f"{self.in_a_row} optimizer steps in a row had non-finite gradients (the last at step {step + 1}); "
                "stopping. The last checkpoint is intact: lower --learning_rate or --grad_clip and resume from it"
            )
        return True
