"""`--profile`: a torch.profiler trace of a few steps, for TensorBoard or Perfetto."""

import contextlib
import os

import torch


def torch_profiler(enabled: bool, output_dir: str, at_step: int):
    """A torch.profiler that records optimizer step `at_step`; call `.step()` once per optimizer
    step. The trace goes to <output_dir>/profile/ gzipped, one file per rank (TensorBoard and
    Perfetto read .json.gz). One step, compressed: a GPU step of the reference launch (32
    accumulated micro-batches of a 32-layer model) is ~250k events, ~100 MB of JSON a rank before
    compression; 3 steps uncompressed made GBs on an 8-GPU node."""
    if not enabled:
        return contextlib.nullcontext(_NoProfiler())
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    return _saying_where(
        os.path.join(output_dir, "profile"),
        at_step,
        profile(
            activities=activities,
            schedule=schedule(wait=max(at_step - 2, 0), warmup=1, active=1, repeat=1),
            on_trace_ready=tensorboard_trace_handler(os.path.join(output_dir, "profile"), use_gzip=True),
            record_shapes=True,
            with_flops=True,
        ),
    )


@contextlib.contextmanager
def _saying_where(trace_dir: str, at_step: int, prof):
    """The profiler, and afterwards one line on rank 0 naming where its trace went (--profile said
    nothing before)."""
    with prof:
        yield prof
    if os.environ.get("RANK", "0") == "0":
        traces = (
            sorted(f for f in os.listdir(trace_dir) if f.endswith(".json.gz"))
            if os.path.isdir(trace_dir)
            else []
        )
        where = (
            f"{trace_dir}/ ({len(traces)} trace(s), one per rank)"
            if traces
            else f"nowhere: step {at_step} was not reached"
        )
        print(
            f"profile of step {at_step}: {where}; open in TensorBoard's profiler or ui.perfetto.dev",
            flush=True,
        )


class _NoProfiler:
    def step(self):
        pass
