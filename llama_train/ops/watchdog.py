"""Hangs become a restart: a watchdog thread on every rank (`--watchdog_s`).

When no optimizer step (with its evaluation and checkpoint) has completed for `--watchdog_s`
seconds, every rank writes its Python stacks (faulthandler, all threads) and its progress (the
step it started, the last collective it entered and how many it entered) to
<output_dir>/hang/rank_NNNNN.{txt,json}; rank 0 reads the reports, names the stalled rank(s) in one
line (and hang/summary.txt), and every rank exits with EXIT_HANG (75, EX_TEMPFAIL) so the scheduler
requeues the job and `--resume auto` continues from the last checkpoint. A rank whose collective
breaks when the stalled rank leaves (before its own watchdog fires) leaves with 75 too.

Which rank stalled: one without a report first (stopped by a signal, or stuck in C code holding the
GIL, where this thread cannot run: faulthandler's own C-level timer, dump_traceback_later,
`--watchdog_s` + GRACE_S, still dumps its stacks to its stderr, and ExitTimer, a C timer too, ends it
with EXIT_HANG), named with its host
(gathered when the watchdog starts); else the one behind. A rank that stopped between steps (or in its
data loader) has not started the step the others started; one that stopped inside a step entered
fewer collectives than the ranks now waiting for it. The others are named as waiting, with the
collective they wait in. Ranks whose progress is equal all wait in the same collective: then the
network (or NCCL) is named instead.

What the deadline covers: from the end of the first step (its compilation under --compile, and the
ranks waiting for each other's, are start-up) to the end of each next one, its evaluation and
checkpoint included (a sync save's whole write; --async_save: the copy to host memory, and waiting for
the previous save if it is still being written). Later compilations (the first evaluation's, a
recompile) move the deadline on by their length. At the stop and at the end of training the run
waits for the async save in flight, which counts too. Before it exits the watchdog gives a save in
flight up to SAVE_WAIT_S to finish (async_save.finish_in_flight).

The collective entered is seen by wrapping torch.distributed's collectives (DeepSpeed's torch
backend and DDP's gradient hook call them through the module), only while the watchdog is on.
"""

import ctypes
import faulthandler
import functools
import json
import os
import signal
import socket
import sys
import threading
import time

import torch.distributed as dist

from llama_train.checkpoint.async_save import finish_in_flight
from llama_train.checkpoint.store import checkpoint_root, read_latest
from llama_train.distributed.dist import all_gather_object
from llama_train.telemetry.metrics import MetricsWriter

EXIT_HANG = 75  # EX_TEMPFAIL: a temporary failure, try again (schedulers requeue on it)
GRACE_S = 60.0  # faulthandler's backstop fires this long after the watchdog should have
BACKSTOP_EXIT_S = 5.0  # and ExitTimer ends the process this long after its stack dump
REPORT_WAIT_S = 20.0  # rank 0 waits this long for the other ranks' reports
SAVE_WAIT_S = 30.0  # then this long for a checkpoint in flight (both within GRACE_S)
STALL_ENV = "LLAMA_TRAIN_TEST_STALL"  # tests only: STEP:RANK stalls RANK after step STEP
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
)


class Progress:
    """What a rank last did: the step it started, the collectives it entered (count, last one)."""

    def __init__(self):
        self.started, self.completed, self.collectives, self.last = 0, 0, 0, None

    def entered(self, name: str):
        self.collectives += 1
        self.last = {"op": name, "n": self.collectives, "step": self.started, "time": time.time()}


def watch_collectives(progress: Progress) -> dict:
    """Wrap torch.distributed's collectives to record each entry in `progress`; returns the originals."""
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
    for name, fn in originals.items():

        @functools.wraps(fn)
        def entered(*args, _fn=fn, _name=name, **kwargs):
            progress.entered(f"torch.distributed.{_name}")
            return _fn(*args, **kwargs)

        setattr(dist, name, entered)
    return originals


def stalled_ranks(reports: dict[int, dict], world: int) -> tuple[list[int], list[int], str]:
    """(stalled ranks, ranks waiting for them, why) from the ranks' progress reports: the ranks without
    a report first (stopped, or stuck holding the GIL), then those behind the other reporting ranks."""
    missing = [r for r in range(world) if r not in reports]
    key = {r: (p["started"], p["collectives"]) for r, p in reports.items()}
    if not key:
        return missing, [], "no rank reported"
    low = min(key.values())
    behind = sorted(r for r, k in key.items() if k == low and len(set(key.values())) > 1)
    waiting = sorted(r for r in key if r not in behind)
    if missing:
        return missing + behind, waiting, "it sent no report"
    if not behind and len(key) > 1:
        last = reports[waiting[0]]["last"] or {}
        return [], waiting, f"every rank waits in the same collective ({last.get('op')}): network?"
    return (behind, waiting, "behind the others") if behind else (waiting, [], "the only rank")


def newer_than(path: str, t: float) -> bool:
    return os.path.exists(path) and os.path.getmtime(path) >= t


def injected_stall(step: int, rank: int):
    """Tests only: LLAMA_TRAIN_TEST_STALL=STEP:RANK stops RANK for good after step STEP (SIGTERM, from a
    launcher tearing the job down, ends it, as it ends a hung process that runs no Python)."""
    spec = os.environ.get(STALL_ENV)
    if spec and [int(x) for x in spec.split(":")] == [step, rank]:
        print(f"[rank {rank}] {STALL_ENV}: stalling after step {step}", flush=True)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        while True:
            time.sleep(3600)


class _Sigevent(ctypes.Structure):  # glibc's struct sigevent (64 bytes), SIGEV_THREAD's members
    _fields_ = [("value", ctypes.c_void_p), ("signo", ctypes.c_int), ("notify", ctypes.c_int),
                ("function", ctypes.c_void_p), ("attribute", ctypes.c_void_p), ("pad", ctypes.c_int * 8)]  # fmt: skip


class _Timespec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]


class ExitTimer:
    """A C timer that ends this process with `code` when it fires, whether or not a thread holds the GIL:
    glibc runs SIGEV_THREAD timers' function (here `_exit`, given the code as its argument) in a thread of
    its own, with no Python involved. faulthandler's own `exit=True` can only exit with status 1, which a
    scheduler takes for a failure, not a hang to requeue. Linux (glibc) only: elsewhere `armed` stays
    False and faulthandler's exit is the backstop."""

    CLOCK_MONOTONIC, SIGEV_THREAD = 1, 2

    def __init__(self, code: int):
        self._timer, self._keep = None, None
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            create, self._settime, exit_ = libc.timer_create, libc.timer_settime, libc._exit
        except (OSError, AttributeError):  # not glibc
            return
        self._keep = _Sigevent(
            value=code, notify=self.SIGEV_THREAD, function=ctypes.cast(exit_, ctypes.c_void_p)
        )
        timer = ctypes.c_void_p()
        if create(self.CLOCK_MONOTONIC, ctypes.byref(self._keep), ctypes.byref(timer)) == 0:
            self._timer = timer

    @property
    def available(self) -> bool:
        return self._timer is not None

    def arm(self, seconds: float):
        """Fire in `seconds` (0: disarm); re-arming moves the deadline."""
        if self._timer is None:
            return
        whole = int(seconds)
        nsec = 0 if seconds <= 0 else max(1, int((seconds - whole) * 1e9))  # 0, 0 would disarm
        spec = (_Timespec * 2)(_Timespec(0, 0), _Timespec(max(0, whole), nsec))  # interval, first expiry
        self._settime(self._timer, 0, spec, None)


class Watchdog:
    """Beats at every step boundary (`steps` wraps the trainer's step iterator); fires after `limit_s`
    seconds without one. Off (no thread, nothing wrapped) when `limit_s` is 0. Use in a `with`."""

    def __init__(self, limit_s: float, output_dir: str, rank: int, world: int):
        self.limit, self.rank, self.world = limit_s, rank, world
        self.dir = os.path.join(output_dir, "hang")
        self.progress, self._last_beat, self._done = Progress(), None, threading.Event()
        self._originals, self._thread, self._armed_until = {}, None, None
        self.hosts = None  # every rank's host, by rank (gathered on entry): a rank without a report's
        self._compiling_since = None  # a compilation under way (torch._dynamo's callbacks) holds the clock
        self._following = False  # whether those callbacks are registered (once torch._dynamo is loaded)
        self._last_beat_wall, self._fired = None, threading.Event()  # a hang's verdict: this rank's
        self._exit = None  # ExitTimer: the backstop's exit with EXIT_HANG (made when first armed)

    def __enter__(self):
        if self.limit > 0:
            self.hosts = all_gather_object(socket.gethostname())  # collective: every rank enters here
            self._follow_compilations()
            self._originals = watch_collectives(self.progress)
            self._thread = threading.Thread(target=self._run, name="llama-train-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is not None and self._hang_declared():
            self._leave_as_hang()
        self._done.set()
        if self.limit > 0:
            self._disarm()
        for name, fn in self._originals.items():
            setattr(dist, name, fn)

    def steps(self, iterable):
        """`iterable`'s items; asking for the next one means the last step (eval, save) completed. The
        clock starts when this process's first step completes: start-up, the first step's compilation
        (--compile) and the ranks waiting for each other's are not timed."""
        first = True
        for item in iterable:
            if first:
                self.progress.completed, first = item[0] - 1, False
            else:
                self.beat(item[0] - 1)
            self.progress.started = item[0]
            yield item

    def beat(self, completed: int):
        self.progress.completed, self._last_beat_wall = completed, time.time()
        if self.limit > 0:
            self._last_beat = time.monotonic()
            if not self._following:  # the compiler may have been loaded by a step: FlexAttention's first call
                self._follow_compilations()
            if self._armed_until is None:
                self._arm()
        injected_stall(completed, self.rank)

    def _follow_compilations(self):
        """Compilations after the first step (the first evaluation's, a recompile) move the deadline on
        by their length: torch._dynamo's start/end callbacks, registered once torch._dynamo is loaded
        (by --compile before the watchdog starts, or by a step: FlexAttention's first call under
        --document_mask on a GPU). Not imported here: a run that never compiles does not pay for it."""
        if self._following or "torch._dynamo" not in sys.modules:
            return
        from torch._dynamo.callback import callback_handler

        callback_handler.register_start_callback(self._compile_started)
        callback_handler.register_end_callback(self._compile_ended)
        self._following = True

    def _compile_started(self, *_):
        if self._compiling_since is None:
            self._compiling_since = time.monotonic()
            if self._armed_until is not None:  # the backstop too: re-armed at the next beat
                self._disarm()

    def _compile_ended(self, *_):
        if self._compiling_since is not None and self._last_beat is not None:
            self._last_beat += time.monotonic() - self._compiling_since
        self._compiling_since = None

    def _arm(self):
        """faulthandler's C timer (each call starts a thread of its own, so not at every step): it
        fires `limit` + GRACE_S after the last beat at the latest, and not before `limit` + GRACE_S / 2,
        dumping the stacks; ExitTimer ends the process with EXIT_HANG a few seconds later (without it,
        faulthandler's own exit, status 1)."""
        deadline = self._last_beat + self.limit + GRACE_S
        if self._exit is None:
            self._exit = ExitTimer(EXIT_HANG)
        left = deadline - time.monotonic()
        faulthandler.dump_traceback_later(left, exit=not self._exit.available)  # to stderr: the job's log
        self._exit.arm(left + BACKSTOP_EXIT_S)
        self._armed_until = deadline

    def _disarm(self):
        faulthandler.cancel_dump_traceback_later()
        if self._exit is not None:
            self._exit.arm(0)
        self._armed_until = None

    def _run(self):
        while not self._done.wait(min(1.0, self.limit / 10)):
            if self._last_beat is None or self._compiling_since is not None:
                continue
            if time.monotonic() - self._last_beat > self.limit:
                return self._fire()
            if (
                self._armed_until is not None
                and self._last_beat + self.limit + GRACE_S > self._armed_until + GRACE_S / 2
            ):
                self._arm()  # the steps moved the deadline on: re-arm, about every GRACE_S / 2 seconds

    def _hang_declared(self) -> bool:
        """Whether the run is leaving by a hang: this rank's watchdog fired, or rank 0's verdict
        (hang/summary.txt) is newer than this rank's last step. The stalled rank's exit breaks the
        collective the others wait in, and that error can reach a rank before its own watchdog ends it."""
        summary = os.path.join(self.dir, "summary.txt")
        return self._fired.is_set() or (
            self._last_beat_wall is not None and newer_than(summary, self._last_beat_wall)
        )

    def _leave_as_hang(self):
        """Leave with EXIT_HANG, not the error: the watchdog's own exit once its verdict is out (it
        waits for rank 0's), at once where it has not fired here."""
        if self._fired.is_set() and self._thread is not None:
            self._thread.join(REPORT_WAIT_S + SAVE_WAIT_S + 10)
        print(
            f"rank {self.rank}: leaving with the hang's exit status {EXIT_HANG}", file=sys.stderr, flush=True
        )
        sys.stdout.flush()
        os._exit(EXIT_HANG)

    def _fire(self):
        self._fired.set()
        report = self._report()
        if self.rank == 0:
            MetricsWriter(os.path.dirname(self.dir), 0).write(
                "hang", step=report["completed"], seconds=time.monotonic() - self._last_beat
            )  # goodput: hang time
            finish_in_flight(SAVE_WAIT_S)  # first: the line names the checkpoint a requeue resumes from
            summary = self._summarize(report)
            print(summary, file=sys.stderr, flush=True)
            with open(os.path.join(self.dir, "summary.txt"), "w") as f:
                f.write(summary + "\n")
        else:  # give rank 0 time to read every report before the launcher tears the job down
            finish_in_flight(SAVE_WAIT_S)  # a save in flight: this rank's files, for rank 0 to publish
            deadline, summary = (
                time.monotonic() + REPORT_WAIT_S + SAVE_WAIT_S + 5,
                os.path.join(self.dir, "summary.txt"),
            )
            while time.monotonic() < deadline and not newer_than(summary, report["time"] - self.limit):
                time.sleep(0.2)
        os._exit(EXIT_HANG)

    def _report(self) -> dict:
        """This rank's stacks and progress, written to hang/rank_NNNNN.{txt,json}."""
        os.makedirs(self.dir, exist_ok=True)
        base = os.path.join(self.dir, f"rank_{self.rank:05d}")
        p = self.progress
        report = {
            "rank": self.rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "time": time.time(),
            "started": p.started,
            "completed": p.completed,
            "collectives": p.collectives,
            "last": p.last,
        }
        with open(base + ".txt", "w") as f:
            f.write(f"rank {self.rank} on {report['host']}: no step completed for {self.limit:g} s\n")
            f.write(f"progress: {json.dumps(report)}\n\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        with open(base + ".json.tmp", "w") as f:
            json.dump(report, f)
        os.replace(base + ".json.tmp", base + ".json")
        return report

    def _summarize(self, mine: dict) -> str:
        """Rank 0: one line naming the stalled rank(s), from every report that arrives in time."""
        reports, deadline = {0: mine}, time.monotonic() + REPORT_WAIT_S
        while len(reports) < self.world and time.monotonic() < deadline:
            time.sleep(0.2)
            for r in range(1, self.world):
                path = os.path.join(self.dir, f"rank_{r:05d}.json")
                if r not in reports and os.path.exists(path):
                    with open(path) as f:
                        rep = json.load(f)
                    if rep["time"] >= mine["time"] - self.limit:  # this hang's, not an earlier one's
                        reports[r] = rep
        stalled, waiting, why = stalled_ranks(reports, self.world)
        named = [self._describe(r, reports.get(r)) for r in stalled]
        waits = [self._describe(r, reports[r], waiting=True) for r in waiting]
        saved = read_latest(checkpoint_root(os.path.dirname(self.dir))) or "none yet: a fresh start"
        return (
            f"watchdog: no step completed for {self.limit:g} s after step {mine['completed']}; stalled: "
            f"{', '.join(named) or 'none named'} ({why}); waiting: {', '.join(waits) or 'none'}; stacks in "
            f"{self.dir}; exiting {EXIT_HANG} so the job is requeued: --resume auto continues from the "
            f"last checkpoint ({saved})"
        )

    def _describe(self, rank: int, report: dict | None, waiting: bool = False) -> str:
        """'rank 1 (node-b, step 12)', '... in torch.distributed.all_reduce)' for a waiting one, and for
        one without a report its host as gathered at the start."""
        if report is None:
            host = self.hosts[rank] if self.hosts else "host unknown"
            return (
                f"rank {rank} ({host}, no report: stopped, stuck holding the GIL, or hang/ on another disk)"
            )
        op = (report["last"] or {}).get("op") if waiting else None
        return f"rank {rank} ({report['host']}, step {report['started']}{f', in {op}' if op else ''})"
