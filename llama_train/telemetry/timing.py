"""Where a step's time goes, per rank, with the same definitions in both trainers, and what it
communicates: `StepProbe` measures one step in `--probe_interval` and writes `timing` and `comm`
records for it.

The phases tile the step: every moment from asking the data loader for the step's batches to the
end of the step belongs to exactly one of them.

    data       waiting for the step's micro-batches from the loader
    forward    the model's forward (ZeRO-3: with the parameter all-gathers it does not overlap)
    backward   backward, up to the moment the last gradient is computed (post-accumulate-grad
               hooks), with whatever communication overlaps it (DDP's bucket all-reduces)
    comm_wait  waiting for communication: from the last gradient to the end of backward (the
               outstanding reductions), and inside any collective the step waits for (DeepSpeed's
               bucket reductions on gloo, ZeRO's all-gather after the step, ...)
    optimizer  clipping, the optimizer and LR step, less the collectives inside it
    other      the rest: batch copies, bookkeeping

A probed step must not become another step. On GPU its phase boundaries are CUDA events on the
step's stream, read once the step is over: the device is synchronised twice a probed step (before
it, so that earlier steps' queued work is not counted, and after it, to read the events), never at a
phase boundary or around a collective. The per-parameter gradient hooks, the forward hooks and the
wrappers of `engine.backward` / `engine.step` exist only while a step is probed; collectives of DDP
and DeepSpeed alike are counted (comm.py) on probed steps and left alone on the others. The step
logger leaves probed steps out of step time, tok/s and MFU (metrics.StepLogger).
"""

import contextlib
import os
import socket
import statistics
import time

import torch

from llama_train.distributed.dist import all_gather_object
from llama_train.plan.comm import CommCounter, expected_run_comm_bytes, install_counter
from llama_train.plan.memory import peak_memory_bytes
from llama_train.steps import due

PHASES = ("data", "forward", "backward", "comm_wait", "optimizer", "other")


def link_interface(backend: str) -> str | None:
    """The network interface the collectives were told to use: GLOO_SOCKET_IFNAME (gloo) or
    NCCL_SOCKET_IFNAME (its first name; not an exclusion list); None where none is named."""
    value = os.environ.get("NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME", "")
    name = value.split(",")[0].lstrip("=")
    return name if name and not name.startswith("^") else None


def link_tx_bytes(interface: str | None) -> int | None:
    """Bytes `interface` has sent, as the kernel counts them (everything this host sends on it: with
    several ranks a host, all of theirs); None where it cannot be read."""
    try:
        with open(f"/sys/class/net/{interface}/statistics/tx_bytes") as f:
            return int(f.read())
    except (OSError, ValueError, TypeError):
        return None


class StepTimer:
    """Seconds per phase of one step, on this rank. Phases nest (a collective inside backward is
    comm_wait, not backward); each moment counts once, for the innermost phase. A mark is a clock
    reading (a CUDA event on the step's stream, or perf_counter on CPU) from which time goes to the
    current phase; the seconds are worked out from the marks when the step is over."""

    def __init__(self, device: torch.device):
        self.device, self.events, self.active = device, device.type == "cuda", False
        self.stack, self.marks, self.grad_at, self.began, self.ended = [], [], None, 0.0, 0.0

    def _mark(self, wall: float | None = None):
        if self.events:
            now = torch.cuda.Event(enable_timing=True)
            now.record(self.stream)  # no sync: the event is read after the step
        else:
            now = time.perf_counter() if wall is None else wall
        self.marks.append([now, self.stack[-1]])

    def start(self, phase: str = "data"):
        """Measure from now. On GPU the device finishes the earlier steps' work first, which they
        are charged with (`began`, the wall clock, is read after it)."""
        if self.events:
            torch.cuda.synchronize(self.device)
            self.stream = torch.cuda.current_stream(self.device)
        self.active, self.stack, self.marks, self.grad_at = True, [phase], [], None
        self.began = time.perf_counter()
        self._mark(self.began)

    def enter(self, phase: str):
        if self.active:
            self.stack.append(phase)
            self._mark()

    def exit(self):
        if not self.active or len(self.stack) < 2:
            return
        left = self.stack.pop()
        self._mark()
        if left == "backward" and self.grad_at is not None:  # after the last gradient: waiting
            for mark in self.marks[self.grad_at : -1]:
                if mark[1] == "backward":
                    mark[1] = "comm_wait"
            self.grad_at = None

    def switch(self, phase: str):
        """The outermost phase becomes `phase` (e.g. data -> other once the batches are in)."""
        if self.active:
            self.stack[-1] = phase
            self._mark()

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
            self._mark()
            self.grad_at = len(self.marks) - 1

    def stop(self) -> dict[str, float] | None:
        """This step's seconds by phase (`{phase}_s`) and their sum, `step_time_s`; None if idle.
        `ended`: the wall clock then (on GPU once the step's last event has passed)."""
        if not self.active:
            return None
        if self.events:
            self._mark()
            self.marks[-1][0].synchronize()
            self.ended = time.perf_counter()
        else:
            self.ended = time.perf_counter()
            self._mark(self.ended)
        self.active = False
        totals = dict.fromkeys(PHASES, 0.0)
        for (t0, phase), (t1, _) in zip(self.marks, self.marks[1:]):
            totals[phase] += t0.elapsed_time(t1) / 1000 if self.events else t1 - t0
        out = {f"{k}_s": v for k, v in totals.items()}
        out["step_time_s"] = sum(totals.values())
        return out


def _timed(timer: StepTimer, phase: str, method):
    def timed(*args, **kwargs):
        with timer.phase(phase):
            return method(*args, **kwargs)

    return timed


class StepProbe:
    """Times and counts the communication of one step in `interval` (and of the last), in either trainer:

        probe = StepProbe(engine, log, device, args.probe_interval)
        for step, micro_batches in probe.steps(train_steps(...)):

    For a probed step it hooks the model's forward and every parameter's gradient, wraps
    `engine.backward` / `engine.step` (any Engine: llama_train/train/engines/) and turns the collective
    counter (comm.install_counter) on; the step logger calls `finish` at the step's end, which takes
    all of it off again. `interval` 0: no step is probed."""

    def __init__(self, engine, log, device: torch.device, interval: int):
        self.timer, self.log, self.step, self.interval = StepTimer(device), log, log.last_step, interval
        self.engine, self.measuring, self.hooks, self.t0_at_start = engine, None, [], 0.0
        self.comm: CommCounter = install_counter(engine)
        self.comm.timer = self.timer
        self.link, self.link_sent = link_interface(self.comm.backend), None
        self.stage = engine.strategy.stage
        flags = log.record["args"]
        self.alarm = StragglerAlarm(flags.get("straggler_factor", 0.0), flags.get("straggler_patience", 3))
        log.probe = self

    def probes(self, step: int) -> bool:
        """Whether step `step` is probed: every `interval` steps and the last (0: none)."""
        return self.interval > 0 and due(step, self.interval, self.log.total)

    def steps(self, iterable):
        """`iterable`'s (step, micro-batches); a probed step is measured from the request for its data."""
        it = iter(iterable)
        while True:
            if self.probes(self.step + 1):
                self._attach(self.step + 1)
            try:
                item = next(it)
            except StopIteration:
                self._detach()
                return
            self.timer.switch("other")
            self.step = item[0]
            yield item

    def _attach(self, step: int):
        """Hooks for this step only, then the clock starts."""
        module, timer = self.engine.module, self.timer
        self.hooks = [
            module.register_forward_pre_hook(lambda *_: timer.enter("forward"), prepend=True),
            module.register_forward_hook(lambda *_: timer.exit(), always_call=True),
            *(
                p.register_post_accumulate_grad_hook(timer.grad_ready)
                for p in module.parameters()
                if p.requires_grad
            ),
        ]
        self.wrapped = {name: self.engine.__dict__.get(name) for name in ("backward", "step")}
        self.engine.backward = _timed(timer, "backward", self.engine.backward)
        self.engine.step = _timed(timer, "optimizer", self.engine.step)
        self.measuring, self.comm.active, self.t0_at_start = step, True, self.log.t0
        self.link_sent = link_tx_bytes(self.link)
        timer.start("data")

    def _detach(self) -> dict[str, float] | None:
        """The step's split (None if none was measured); every hook and wrapper off again."""
        parts = self.timer.stop()
        sent = link_tx_bytes(self.link)
        self.link_sent = None if sent is None or self.link_sent is None else sent - self.link_sent
        for handle in self.hooks:
            handle.remove()
        for name, own in getattr(self, "wrapped", {}).items():  # the engine's method, or what it had
            if own is None:
                delattr(self.engine, name)
            else:
                setattr(self.engine, name, own)
        self.hooks, self.wrapped, self.measuring, self.comm.active = [], {}, None, False
        return parts

    def finish(self, step: int, writer) -> tuple[float, str | None]:
        """Collective, at the end of a probed step: every rank's time split and bytes in `timing` and
        `comm` records, and a `straggler` record when StragglerAlarm names a rank. The timing record has
        the step's wall time on this rank's clock (`wall_s`, what the phases tile) and the probe's own
        record-keeping after it (`probe_s`). Returns (both together, less any compile time the logger
        already left out: the seconds it leaves out of its figures; a note for the log line, or None)."""
        parts = self._detach()
        sent, wire, calls = self.comm.take()
        memory = peak_memory_bytes(self.timer.device)
        here = (parts, sent, calls, memory, socket.gethostname(), wire, self.link_sent)
        ranks = all_gather_object(here)
        wall, kept = self.timer.ended - self.timer.began, time.perf_counter() - self.timer.ended
        fields = timing_fields([r[0] for r in ranks])
        writer.write(
            "timing", step=step, **fields, wall_s=wall, probe_s=kept, peak_mem_bytes=[r[3] for r in ranks]
        )
        self._write_comm(step, writer, ranks)
        work = [sum(fields[f"{k}_s"][r] for k in WORK) for r in range(len(ranks))]
        compiling = self.log.t0 - self.t0_at_start  # metrics' CompileClock moved the logger's start
        return wall + kept - compiling, self.alarm.check(step, work, [r[4] for r in ranks], writer)

    def _write_comm(self, step: int, writer, ranks: list):
        record = self.log.record
        expected = expected_run_comm_bytes(self.stage, record)  # the data-parallel group's, for its shard
        writer.write(
            "comm",
            step=step,
            bytes_by_op=[r[1] for r in ranks],  # the payload, as the ZeRO paper counts it
            calls_by_op=[r[2] for r in ranks],
            bytes_total=[sum(r[1].values()) for r in ranks],
            wire_bytes_by_op=[r[5] for r in ranks],  # what each rank sends (comm.wire_factor)
            wire_bytes_total=[sum(r[5].values()) for r in ranks],
            link_interface=self.link,
            link_tx_bytes=[r[6] for r in ranks],  # the kernel's count of it, this step (None: unread)
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
    `patience` of the last 2 x `patience` probed steps. Said once per rank: a `straggler` record in
    metrics.jsonl and a note on that step's log line, with its host. `factor` 0: off."""

    def __init__(self, factor: float, patience: int):
        self.factor, self.patience = factor, patience
        self.recent, self.named = [], set()  # the slow rank (or None) of the last probed steps

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
            probed_steps=self.patience,
        )
        return (
            f"straggler: rank {slow} ({hosts[slow]}) {ratio:.1f}x the median rank's work "
            f"on {self.patience} of the last {len(self.recent)} probed steps"
        )
