"""Preemption-safe launching: put this in front of `deepspeed` or `torchrun`.

    python -m llama_train.launch deepspeed --num_gpus 8 train_deepspeed.py --resume auto ...
    python -m llama_train.launch torchrun --nproc_per_node 8 train_ddp.py --resume auto ...

(scripts/run_deepspeed.sh, scripts/run_ddp.sh and scripts/slurm_example.sbatch launch through it.)

Schedulers (SLURM, Kubernetes, `docker stop`) and Ctrl-C signal the process they started, i.e. the
launcher, and neither launcher turns that into a clean stop (DeepSpeed 0.19.8, torch 2.13): SIGTERM
kills `deepspeed` at once (exit 143) while `deepspeed.launcher.launch` and the ranks train on as
orphans; `launcher.launch` and `torchrun` pass the signal on, but kill ranks still saving after 30 s
and exit 1 (torchrun with a SignalException traceback). This entry point:

- runs the launcher in a session of its own, so a terminal's Ctrl-C (SIGINT to the foreground
  process group) reaches only this process, never the launcher or the ranks directly;
- on the first SIGTERM or SIGINT, asks the ranks to stop through a file under the run's
  `--output_dir` (<output_dir>/llama_train.stop, which every rank looks at after each step, at most once a
  second; the ranks agree by an all-reduce, guards.Stopper): every rank finishes its step, one
  checkpoint is saved, the ranks exit 0, and so does the launcher. A path under --output_dir reaches
  ranks on other hosts (`deepspeed --hostfile` starts them over pdsh, which exports none of this
  process's environment); one rank that sees it is enough, since the all-reduce tells the others;
- waits for every process below it (on Linux it is their subreaper, so orphans come back to it) and
  exits with the launcher's code: 0 after a clean stop; 128 + N if the launcher died of signal N;
- on a second signal kills everything below it at once (SIGKILL): the last complete checkpoint stays.

With a front per host (`torchrun --nnodes N`, each host's torchrun behind its own front) on a shared
--output_dir, one signal to any front stops every host's ranks; each front removes the stop file at
start and at the end, and another host's front having removed it first is no error.

In front of `deepspeed` it also keeps the launcher's own chatter out of the log, since the trainers'
lines say what matters: it adds `--log_level=error` (no "cmd = ...", "WORLD INFO DICT", "process N
spawned/exits" lines) unless the command sets `--log_level`/`--quiet` itself or passes the trainer
`--verbose`; and where no accelerator can be found (no `nvidia-smi`, no Intel/Habana/Ascend torch
extension: what DeepSpeed would probe) it sets DS_ACCELERATOR=cpu, so no process warns that it fell
back to the CPU. A DS_ACCELERATOR already set is kept.

In front of `deepspeed --hostfile FILE` (the pdsh launcher, without --no_ssh/--no_ssh_check): a hostfile
whose hosts are this machine alone (`localhost slots=N`, the shipped one) starts its ranks here without
ssh (it adds `--no_ssh_check --master_addr 127.0.0.1`; DeepSpeed ssh-checks even one host and asks it
over ssh for its address); for any other, ssh to every host is tried first (`ssh -o BatchMode=yes HOST
hostname`) and each host that fails is one `error: FILE:LINE: cannot ssh to 'HOST' ...` line, exit 2,
before DeepSpeed's traceback could appear (llama_train/ops/hostfile.py).

Ranks also watch their launchers (guards.LauncherWatch): a launcher that disappears (a plain
`deepspeed` killed by SIGTERM) makes them save and exit instead of training on as orphans.
"""

import contextlib
import ctypes
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil

from llama_train.gpu import LAUNCHER_MODULES, launcher
from llama_train.ops.hostfile import deepspeed_hostfile_words
from llama_train.ops.stopfile import stop_path

DEFAULT_OUTPUT_DIR = "outputs/run"  # the trainers' --output_dir default (llama_train/config.py)


def output_dir_of(argv: list[str]) -> str:
    """The trainer's --output_dir in a launcher's command line (the last one given), or its default."""
    found = DEFAULT_OUTPUT_DIR
    for i, word in enumerate(argv):
        if word == "--output_dir" and i + 1 < len(argv):
            found = argv[i + 1]
        elif word.startswith("--output_dir="):
            found = word.split("=", 1)[1]
    return found


OTHER_ACCELERATORS = (
    "intel_extension_for_pytorch",
    "habana_frameworks",
    "torch_npu",
)  # DeepSpeed probes them


def deepspeed_words(argv: list[str]) -> int:
    """How many leading words of `argv` name the deepspeed launcher: `deepspeed` or `PYTHON -m
    deepspeed.launcher.runner`, after any `env VAR=VALUE ...` (python -m llama_train.gpu deepspeed's
    words); 0 for another command."""
    env = 0
    if argv and os.path.basename(argv[0]) == "env":
        env = 1 + next((i for i, w in enumerate(argv[1:]) if "=" not in w), len(argv) - 1)
    rest = argv[env:]
    if rest and os.path.basename(rest[0]) == "deepspeed":
        return env + 1
    return env + 3 if rest[1:3] == ["-m", LAUNCHER_MODULES["deepspeed"]] else 0


def quiet_deepspeed(argv: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """(`deepspeed` command, environment) without the launcher's INFO lines and the CPU-fallback
    warning, unless asked for (see the module's docstring); other launchers unchanged."""
    n = deepspeed_words(argv)
    if not n:
        return argv, env
    if not any(w in ("--verbose", "--quiet", "-q") or w.startswith("--log_level") for w in argv):
        argv = [*argv[:n], "--log_level=error", *argv[n:]]
    no_accelerator = shutil.which("nvidia-smi") is None and not any(
        importlib.util.find_spec(m) for m in OTHER_ACCELERATORS
    )
    if no_accelerator and "DS_ACCELERATOR" not in env:
        env = {**env, "DS_ACCELERATOR": "cpu"}
    return argv, env


def with_hostfile_checked(argv: list[str]) -> tuple[list[str], list[str]]:
    """(`deepspeed --hostfile` command, problems that stop it): a hostfile of this machine alone
    launches without ssh, and a host ssh cannot reach is one line naming it before DeepSpeed's
    traceback (ops.hostfile.deepspeed_hostfile_words). Other commands unchanged."""
    n = deepspeed_words(argv)
    if not n:
        return argv, []
    script = next((i for i in range(n, len(argv)) if argv[i].endswith(".py")), len(argv))
    added, problems = deepspeed_hostfile_words(argv[n:script])
    return [*argv[:n], *added, *argv[n:]], problems


PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def become_subreaper() -> bool:
    """Orphaned descendants (ranks whose launcher died) are re-parented to this process, which can
    then wait for them. Linux only; elsewhere they go to init and are not waited for."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def resolve(command: list[str]) -> list[str]:
    """`deepspeed` / `torchrun` as modules of this Python (llama_train.gpu.launcher): found where it
    finds its packages, with or without an activated venv or a bin/ script (a venv that reaches a GPU
    image's torch through a .pth has no bin/torchrun). Other commands, and paths, as given."""
    if command[0] in LAUNCHER_MODULES:
        return [*launcher(command[0]), *command[1:]]
    return command


def kill_tree():
    """SIGKILL to every process below this one."""
    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass


def wait_all(launcher_pid: int, inherited: set[int] = frozenset()) -> int:
    """Reap every child until none is left (the launcher, and orphans re-parented to us); the
    launcher's exit code, 128 + N if a signal N ended it. `inherited`: children this process had
    before it started the launcher (a shell that exec'd it leaves its own, e.g. the `sed` of a
    `> >(sed ...)` reading our output, which ends only after we do): not waited for."""
    code = None
    while True:
        if code is not None and {c.pid for c in psutil.Process().children()} <= inherited:
            return code
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return 1 if code is None else code
        if pid == launcher_pid:
            code = os.waitstatus_to_exitcode(status)
            code = 128 - code if code < 0 else code


class StopOnSignal:
    """First SIGTERM/SIGINT: write the stop file the ranks watch. Second: kill everything now."""

    def __init__(self, stop_file: str):
        self.stop_file, self.count = stop_file, 0
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.handle)

    def handle(self, signum, _frame):
        self.count += 1
        name = signal.Signals(signum).name
        if self.count == 1:
            with open(self.stop_file, "w") as f:
                f.write(name)
            say(
                f"{name}: every rank finishes its step and saves a checkpoint (a second signal kills the run now)"
            )
        else:
            say(f"{name} again: killing the run now; the last complete checkpoint stays")
            kill_tree()


def hang_exit(code: int, output_dir: str, since: float) -> int:
    """`code`, or EXIT_HANG (75) when the launcher failed after the watchdog ended its ranks: a
    hang/summary.txt written since `since` (rank 0 writes it, llama_train/ops/watchdog.py). torchrun exits 1
    whatever its ranks' status; the deepspeed launcher passes 75 on itself. A scheduler requeues on 75."""
    from llama_train.ops.watchdog import EXIT_HANG

    summary = os.path.join(output_dir, "hang", "summary.txt")
    if code not in (0, EXIT_HANG) and os.path.exists(summary) and os.path.getmtime(summary) >= since:
        say(f"the watchdog ended the run (see {summary}): exiting {EXIT_HANG} instead of {code}")
        return EXIT_HANG
    return code


def remove_shared(path: str):
    """Remove a file every host's front may remove (the stop file on a shared --output_dir, with a front
    per host: torchrun --nnodes N): another host's having done it first is no error."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def say(message: str):
    print(f"[llama_train.launch] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    argv, problems = with_hostfile_checked(argv)
    for problem in problems:
        say(f"error: {problem}")
    if problems:
        return 2
    become_subreaper()
    stop_file = os.path.abspath(stop_path(output_dir_of(argv)))
    try:  # the ranks read it there: a directory this process cannot write cannot carry a stop
        os.makedirs(os.path.dirname(stop_file), exist_ok=True)
        remove_shared(stop_file)  # an earlier run's, killed before it could clean up
    except OSError as e:
        say(
            f"error: --output_dir {os.path.dirname(stop_file)}: cannot write the stop file there ({e}); fix it"
        )
        return 2
    StopOnSignal(stop_file)
    inherited, since = {c.pid for c in psutil.Process().children()}, time.time()
    try:
        command, env = quiet_deepspeed(resolve(argv), dict(os.environ))
        launcher = subprocess.Popen(command, env=env, start_new_session=True)
    except OSError as e:
        say(f"error: cannot start {argv[0]!r}: {e}")
        return 2
    try:
        return hang_exit(wait_all(launcher.pid, inherited), output_dir_of(argv), since)
    finally:
        launcher.returncode = 0  # reaped above: Popen must not wait for it again
        remove_shared(stop_file)


if __name__ == "__main__":
    sys.exit(main())
