"""The run-level services both trainers' main() share, built in one place and closed together:
the step logger (metrics.jsonl, the log line), the probe (time split and bytes moved), the stop
(signals, the launch front's stop file, --stop_after_steps), the non-finite guard, the compile clock,
the hang watchdog, the checkpoint writer (--async_save) and the profiler. A new run-level service
goes here, not into the trainers."""

import contextlib
import time

from llama_train.checkpoint.async_save import Saver
from llama_train.distributed.compile import CompileClock
from llama_train.distributed.dist import print0
from llama_train.ops.watchdog import Watchdog
from llama_train.steps import due, train_steps
from llama_train.telemetry.metrics import StepLogger
from llama_train.telemetry.profiling import torch_profiler
from llama_train.telemetry.timing import StepProbe
from llama_train.train.cadence import SaveCadence
from llama_train.train.checkpointing import checkpoint_settings
from llama_train.train.evaluation import evaluate, evaluate_sources
from llama_train.train.guards import NonFiniteGuard, Stopper
from llama_train.train.tasks import score_tasks, write_samples


class RunServices:
    """Built before the loop (`done`: the step a resume continues after), entered around it: `with`
    enters the logger, the watchdog, the checkpoint writer and the profiler, and leaves them in
    reverse order (the writer finishes a save in flight, also when leaving by an exception)."""

    def __init__(self, args, engine, record: dict, data, done: int, device, rank: int, world: int):
        self.args, self.engine, self.data, self.device, self.rank = args, engine, data, device, rank
        self.total = data.plan.total_steps
        self.log = StepLogger(args.output_dir, rank, record, self.total, done, args.log_interval)
        self.probe = StepProbe(
            engine, self.log, device, args.probe_interval
        )  # time split, bytes: one step in K
        self.stopper = Stopper(args.stop_after_steps, rank, args.output_dir)  # signals, launch's stop
        self.guard = NonFiniteGuard(args.max_nonfinite_steps, rank)
        self.clock = CompileClock(args.compile)  # compile time: reported once, not counted as training
        self.dog = Watchdog(args.watchdog_s, args.output_dir, rank, world)  # --watchdog_s: a hang exits 75
        self.saver = Saver.of(
            checkpoint_settings(args), rank, world
        )  # --async_save: written in the background
        self.cadence = SaveCadence(args.save_interval, args.save_max_minutes, device, self.log.writer, rank)
        self.prof, self.stop, self._stack = None, False, contextlib.ExitStack()
        self.save_t0 = 0.0  # when the save in progress began: its stall is measured for --save_interval auto
        if (args.init_from or data.tasks is not None) and done == 0:  # where the new run starts from
            self.evaluate(0)

    def __enter__(self):
        for service in (self.log, self.dog, self.saver):
            self._stack.enter_context(service)
        profile = torch_profiler(self.args.profile, self.args.output_dir, self.args.profile_interval)
        self.prof = self._stack.enter_context(profile)
        return self

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)

    def steps(self):
        """(step, micro-batches) of every step left, timed by the probe, each beating the watchdog."""
        return self.dog.steps(self.probe.steps(train_steps(self.data, self.args.batch_size)))

    def evaluate(self, step: int):
        """Held-out loss, perplexity and bpb; with a mixture, per source; with --eval_tasks, the tasks
        (timed apart: goodput's `eval_tasks`), their item scores written beside metrics.jsonl."""
        loss = evaluate(self.engine, self.data, self.device, self.args.eval_batches)
        extra = {"sources": evaluate_sources(self.engine, self.data, self.device, self.args.eval_batches)}
        if self.data.tasks is not None:
            t0 = time.perf_counter()
            replica, replicas = self.data.replica
            scores, samples = score_tasks(
                self.engine, self.data.tasks, self.device, replica, replicas, self.args.batch_size
            )
            write_samples(self.args.output_dir, step, samples, self.rank)
            extra |= {"tasks": scores, "tasks_seconds": time.perf_counter() - t0}
        self.log.eval(step, *loss, **{k: v for k, v in extra.items() if v})

    def stepped(self, step: int, loss, lr, grad_norm):
        """After the step's update: the sample ledger's record of it, compile time left out, the
        profiler's step, the log record, and the evaluation when one is due."""
        self.data.ledger.trained(step)  # the sample ledger: this step's samples are consumed
        self.record_left_out()
        self.clock.exclude_from(self.log, step)
        self.prof.step()
        self.log.step(step, loss, lr, grad_norm, self.device, skipped=self.engine.skipped_steps)
        if due(step, self.args.eval_interval, self.total):
            self.evaluate(step)

    def save_due(self, step: int) -> bool:
        """Collective: whether to checkpoint after `step` (a stop was asked, --save_interval: train/cadence.py,
        or the last step unless --no_final_checkpoint); the step's non-finite verdict is read first, so
        nothing non-finite is saved."""
        self.stop = self.stopper.should_stop(step, self.device)
        last = 0 if self.args.no_final_checkpoint else self.total  # 0: no step is the last to save
        periodic = self.cadence.due(step, last)  # collective under auto: called after every step
        if self.stop or periodic:
            self.save_t0 = time.perf_counter()
            self.guard.settle()
            self.record_left_out()  # in the ledger before the checkpoint records its length
            return True
        return False

    def record_left_out(self):
        """The sample ledger's note of each step whose update the engine left out (a non-finite gradient,
        an fp16 overflow, a spike), once the step's verdict is settled: its samples were read, not applied."""
        for step in self.guard.take_left_out():
            self.data.ledger.not_applied(step)

    def saved(self, step: int):
        self.log.saved(step)  # a `save` record: the seconds training stood still (--async_save: the copy)
        self.cadence.saved(step, time.perf_counter() - self.save_t0)

    def stopped(self, step: int) -> bool:
        """Whether the run ends early after `step` (its checkpoint complete, said so on rank 0)."""
        if not self.stop or step >= self.total:
            return False
        self.saver.wait()  # --async_save: the stop's checkpoint is complete before the line says so
        print0(f"stopped after step {step}; checkpoint saved, continue with --resume auto", rank=self.rank)
        return True
