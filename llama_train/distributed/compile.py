"""`--compile`: torch.compile applied from outside the model, and the compile time kept out of the
throughput figures.

What is compiled: each TransformerBlock on its own (torchtitan's per-block compile; the blocks share
one graph, so the compile cost is one block's) and the loss head's per-chunk softmax / cross-entropy
(`model.softmax_xent`). The matmuls stay where they are (extern BLAS/cuBLAS calls either way); what
compiling buys is fusing the element-wise work around them: RMSNorm, rotary, SwiGLU, the residual
adds and the vocabulary-wide softmax. `nn.Module.compile()` compiles in place, so parameter names,
state dicts, checkpoints, DDP and DeepSpeed see the same module as without it.

Compilation happens lazily, in the first forward and backward (and again for eval mode, in the first
evaluation). `CompileClock` times every compilation (torch._dynamo's compile callbacks) and shifts
the step logger's timer by it, so tokens/s and MFU count training only; the time is reported once,
after the first step, with the inductor cache's hits and misses (TORCHINDUCTOR_CACHE_DIR, default
/tmp/torchinductor_<user>, shared by the ranks of a node and by later runs: a warm cache turns
compiling into loading).
"""

import os
import shutil
import time
import warnings

import torch

from llama_train.errors import ConfigError
from llama_train.model import Transformer, softmax_xent


def compiler_problem(device_type: str) -> str | None:
    """Why torch.compile cannot work here, or None. On CPU inductor writes C++ and needs a compiler."""
    if device_type != "cpu":
        return None
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) or (cxx == "g++" and shutil.which("clang++")):
        return None
    return (
        f"--compile on CPU needs a C++ compiler (torch inductor generates C++): {cxx!r} is not on PATH. "
        "Install one (e.g. apt-get install g++), set CXX, or drop --compile"
    )


def refuse_zero3(compile_enabled: bool, stage: int):
    """--compile with ZeRO-3 is refused before any work (details: docs/performance.md)."""
    if compile_enabled and stage == 3:
        raise ConfigError(
            "--compile does not work with ZeRO stage 3: ZeRO-3 gathers and releases parameters in hooks on "
            "every submodule, which DeepSpeed 0.19.8 keeps out of compilation (torch.compiler.disable), so "
            "each Linear breaks the graph (66 graphs for the 2-layer debug model, then torch's recompile "
            "limit and eager); DeepSpeed's own ZeRO-3 compiler (DeepCompile) is a CUDA op. Use ZeRO-0/1/2 "
            "(offload too) with --compile, or ZeRO-3 without it"
        )


def compile_model(model: Transformer, device_type: str) -> Transformer:
    """Compile `model`'s blocks and its loss-head kernel in place; returns the same module."""
    if problem := compiler_problem(device_type):
        raise ConfigError(problem)
    # inductor's one complex op here is view_as_real of the rotary table (a view, no compute; the
    # rotation itself runs in real arithmetic when compiled, model._apply_rotary_emb_real)
    warnings.filterwarnings("ignore", "Torchinductor does not support code generation for complex")
    for block in model.layers:
        block.compile()
    model.output.kernel = torch.compile(softmax_xent)
    return model


class CompileClock:
    """Wall time spent compiling (every dynamo compilation, the lazily compiled backward included),
    kept out of the step logger's figures. Does nothing when `enabled` is False."""

    def __init__(self, enabled: bool):
        self.enabled, self.spans, self.reported = enabled, [], False
        self._counted = 0  # spans already weighed by exclude_from: each is subtracted once
        self._start = None
        if enabled:
            from torch._dynamo.callback import callback_handler

            callback_handler.register_start_callback(self._on_start)
            callback_handler.register_end_callback(self._on_end)

    def _on_start(self, _args):
        self._start = time.perf_counter()

    def _on_end(self, _args):
        self.spans.append((self._start, time.perf_counter()))

    def exclude_from(self, log, step: int):
        """After a training step: move the logger's timer forward by the compile time of the spans not
        yet counted that started after its last reset (compiles during evaluation are before that reset;
        a span that started after the point t0 moves to is still counted only once); the
        first time, one log line and a `compile` record."""
        if not self.enabled:
            return
        new, self._counted = self.spans[self._counted :], len(self.spans)
        spent = sum(end - start for start, end in new if start >= log.t0)  # before t0: an eval's, reset
        log.t0 += spent
        if not self.reported and spent:
            self.reported = True
            self.report(log, step, spent)

    def report(self, log, step: int, spent: float):
        from torch._dynamo.utils import counters

        hits, misses = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
        cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or "/tmp/torchinductor_<user>"
        log.writer.write(
            "compile", step=step, compile_s=spent, compilations=len(self.spans), cache_hits=hits,
            cache_misses=misses, cache_dir=cache,
        )  # fmt: skip
        if log.rank == 0:
            warm = "warm" if not misses else "cold" if not hits else "partly warm"
            log.bar.write(
                f"compile: {spent:.1f} s in step {step}, left out of tok/s and MFU ({len(self.spans)} "
                f"compilations; inductor cache {warm}: {hits} hits, {misses} misses, {cache})"
            )
