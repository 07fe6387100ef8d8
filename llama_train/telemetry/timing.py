"""Where a step's time goes, per rank, with the same definitions in both trainers, and what it
communicates: `StepProbe` measures the log steps and writes `timing` and `comm` records.

The phases tile the step: every moment from asking the data loader for the step's batches to the
step's log line belongs to exactly one of them.

    data       waiting for the step's micro-batches from the loader
    forward    the model's forward (ZeRO-3: with the parameter all-gathers it does not overlap)
    backward   backward, up to the moment the last gradient is computed (post-accumulate-grad
               hooks), with whatever communication overlaps it (DDP's bucket all-reduces)
    comm_wait  the host blocked on communication: from the last gradient to the end of backward
               (waiting for the outstanding reductions), and inside any collective that blocks
               (DeepSpeed's bucket reductions on gloo, ZeRO's all-gather after the step, ...)
    optimizer  clipping, the optimizer and LR step, less the collectives inside it
    other      the rest: batch copies, bookkeeping, the log line's loss all-reduce

Only measured steps (the log steps) are timed; there every phase boundary synchronises the device's
current stream (on GPU a phase is otherwise only the time to queue its kernels), and the other steps
run without any host sync. On CPU the synchronisation is a no-op.
"""

import contextlib
import socket
import statistics
import time

import torch

from llama_train.distributed.dist import all_gather_object
from llama_train.plan.comm import CommCounter, expected_run_comm_bytes, install_counter
from llama_train.plan.memory import peak_memory_bytes

PHASES = ("data", "forward", "backward", "comm_wait", "optimizer", "other")


class StepTimer:
    """Seconds per phase of one step, on this rank. Phases nest (a collective inside backward is
    comm_wait, not backward); each moment counts once, for the innermost phase."""

    def __init__(self, device: torch.device):
        self.sync = device.type == "cuda"
        self.device, self.active = device, False
        self.stack, self.totals, self.mark, self.grad_mark = [], {}, 0.0, None

    def _tick(self) -> float:
        """Credit the time since the last mark to the current phase; returns now."""
        if self.sync:
            torch.cuda.current_stream(self.device).synchronize()
        now = time.perf_counter()
        self.totals[self.stack[-1]] += now - self.mark
        self.mark = now
        return now

    def start(self, phase: str = "data", since: float | None = None):
        """Measure from now, or from `since` (a perf_counter time: the step logger's timer start)."""
        if self.sync:
            torch.cuda.synchronize(self.device)  # the previous step's work is not this step's
        self.active, self.stack, self.grad_mark = True, [phase], None
        self.totals, self.mark = dict.fromkeys(PHASES, 0.0), since or time.perf_counter()

    def enter(self, phase: str):
        if self.active:
            self._tick()
            self.stack.append(phase)

    def exit(self):
        if not self.active or len(self.stack) < 2:
            return
        self._tick()
        if self.stack.pop() == "backward" and self.grad_mark is not None:
            tail = self.totals["backward"] - self.grad_mark  # after the last gradient: waiting
            self.totals["backward"] -= tail
            self.totals["comm_wait"] += tail
            self.grad_mark = None

    def switch(self, phase: str):
        """The outermost phase becomes `phase` (e.g. data -> other once the batches are in)."""
        if self.active:
            self._tick()
            self.stack[-1] = phase

    @contextlib.contextmanager
    def phase(self, name: str):
        self.enter(name)
        try:
            yield
        finally:
            self.exit()

    def grad_ready(self, _param):
        """A post-accumulate-grad hook: a gradient is computed (the last call marks backward's end)."""
        if self.active and self.stack[-1] == "backward":
            self._tick()
            self.grad_mark = self.totals["backward"]

    def stop(self) -> dict[str, float] | None:
        """This step's seconds by phase (`{phase}_s`) and their sum, `step_time_s`; None if idle."""
        if not self.active:
            return None
        self._tick()
        self.active = False
        out = {f"{k}_s": v for k, v in self.totals.items()}
        out["step_time_s"] = sum(self.totals.values())
        return out


def _timed(timer: StepTimer, phase: str, method):
    def timed(*args, **kwargs):
        with timer.phase(phase):
            return method(*args, **kwargs)

    return timed


class StepProbe:
    """Times and counts the communication of every step the logger logs, in either trainer:

        probe = StepProbe(engine, log, device)
        for step, micro_batches in probe.steps(train_steps(...)):

    It hooks the model's forward, wraps `engine.backward` / `engine.step` (DeepSpeed's engine or
    ddp.DDPEngine) and counts collectives (comm.install_counter); the logger calls `write`."""

    def __init__(self, engine, log, device: torch.device):
        self.timer, self.log, self.step = StepTimer(device), log, log.last_step
        self.reset_at = (log.last_step, log.t0)  # (step, time) the logger last started its step timer
        self.comm: CommCounter = install_counter(engine)
        self.comm.timer = self.timer
        self.stage = engine.zero_optimization_stage()
        flags = log.record["args"]
        self.alarm = StragglerAlarm(flags.get("straggler_factor", 0.0), flags.get("straggler_patience", 3))
        module = engine.module
        module.register_forward_pre_hook(lambda *_: self.timer.enter("forward"), prepend=True)
        module.register_forward_hook(lambda *_: self.timer.exit(), always_call=True)
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self.timer.grad_ready)
        engine.backward = _timed(self.timer, "backward", engine.backward)
        engine.step = _timed(self.timer, "optimizer", engine.step)
        log.probe = self

    def restart(self, step: int):
        """The logger restarts its step timer after step `step` (StepLogger.reset_timer): a measured
        step that follows is timed from here, as the logger times it (the rest is "other")."""
        self.reset_at = (step, time.perf_counter())

    def steps(self, iterable):
        """`iterable`'s (step, micro-batches); a step the logger logs is measured from the logger's
        timer start (its eval, checkpoint and stop check left out, as the logger leaves them out), or
        else from the request for its data."""
        it = iter(iterable)
        while True:
            if self.log.due(self.step + 1):
                step, since = self.reset_at
                self.timer.start("other", since if step == self.step else None)
                self.timer.switch("data")
                self.comm.active = True
            try:
                item = next(it)
            except StopIteration:
                self.timer.active = self.comm.active = False
                return
            self.timer.switch("other")
            self.step = item[0]
            yield item

    def write(self, step: int, writer) -> str | None:
        """Collective, on log steps: every rank's time split and bytes; `timing` and `comm` records, and
        a `straggler` record when StragglerAlarm names a rank (returned: a note for the log line)."""
        parts = self.timer.stop()
        self.comm.active = False
        sent, calls = self.comm.take()
        here = (parts, sent, calls, peak_memory_bytes(self.timer.device), socket.gethostname())
        ranks = all_gather_object(here)
        if parts is None:  # a log step that was not measured
            return None
        fields = timing_fields([r[0] for r in ranks])
        writer.write("timing", step=step, **fields, peak_mem_bytes=[r[3] for r in ranks])
        self._write_comm(step, writer, ranks)
        work = [sum(fields[f"{k}_s"][r] for k in WORK) for r in range(len(ranks))]
        return self.alarm.check(step, work, [r[4] for r in ranks], writer)

    def _write_comm(self, step: int, writer, ranks: list):
        record = self.log.record
        expected = expected_run_comm_bytes(self.stage, record)  # the data-parallel group's, for its shard
        writer.write(
            "comm",
            step=step,
            bytes_by_op=[r[1] for r in ranks],
            calls_by_op=[r[2] for r in ranks],
            bytes_total=[sum(r[1].values()) for r in ranks],
            expected_by_op=expected,
            expected_bytes=sum(expected.values()),
            zero_stage=self.stage,
            backend=self.comm.backend,
            accumulation_steps=record["args"].get("accumulation_steps", 1),
            optimizer=record["args"].get("optimizer", "adamw"),  # its record's comm_extras come on top
        )


def timing_fields(per_rank: list[dict]) -> dict:
    """Per-rank lists of each part, and the slowest rank: the one that worked longest (step time less
    its communication wait); the others waited for it in their collectives."""
    out = {key: [p[key] for p in per_rank] for key in per_rank[0]}
    busy = [p["step_time_s"] - p["comm_wait_s"] for p in per_rank]
    out["slowest_rank"] = max(range(len(busy)), key=busy.__getitem__)
    return out


WORK = ("data", "forward", "backward", "optimizer")  # a rank's own work: never waiting for the others


class StragglerAlarm:
    """Names a rank that is consistently slow: its own work (data + forward + backward + optimizer:
    the phases that never wait for another rank; a rank that waits does so in comm_wait, or in the
    trainers' small collectives counted as other) at least `factor` times the median rank's, on
    `patience` of the last 2 x `patience` log steps. Said once per rank: a `straggler` record in
    metrics.jsonl and a note on that step's log line, with its host. `factor` 0: off."""

    def __init__(self, factor: float, patience: int):
        self.factor, self.patience = factor, patience
        self.recent, self.named = [], set()  # the slow rank (or None) of the last log steps

    def check(self, step: int, busy: list[float], hosts: list[str], writer) -> str | None:
        if self.factor <= 0 or len(busy) < 2:
            return None
        median = statistics.median(busy)
        slow = max(range(len(busy)), key=busy.__getitem__)
        flagged = median > 0 and busy[slow] >= self.factor * median
        self.recent = [*self.recent, slow if flagged else None][-2 * self.patience :]
        if not flagged or self.recent.count(slow) < self.patience or slow in self.named:
            return None
        self.named.add(slow)
        ratio = busy[slow] / median
        writer.write(
            "straggler",
            step=step,
            rank=slow,
            host=hosts[slow],
            work_s=busy[slow],
            median_work_s=median,
            ratio=ratio,
            factor=self.factor,
            log_steps=self.patience,
        )
        return (
            f"straggler: rank {slow} ({hosts[slow]}) {ratio:.1f}x the median rank's work "
            f"on {self.patience} of the last {len(self.recent)} log steps"
        )
