"""`--profile`: a torch.profiler trace of a few steps, for TensorBoard or Perfetto."""

import contextlib
import os

import torch


def torch_profiler(enabled: bool, output_dir: str, at_step: int):
    """A torch.profiler that records 3 steps from step `at_step` on; call `.step()` once per
    optimizer step. The trace goes to <output_dir>/profile/."""
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
