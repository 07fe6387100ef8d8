"""One run's history per --output_dir: a run that does not continue the run already in its --output_dir
(its metrics.jsonl, ledger.jsonl or checkpoints/) is refused, or, with --start_over, that run is moved
aside first, so metrics.jsonl, the ledger and the summary never hold two runs (both files are appended to,
which is what lets a resumed run continue them)."""

import os
import time

from llama_train.checkpoint.settings import CheckpointSettings
from llama_train.distributed.dist import barrier
from llama_train.errors import ConfigError

RUN_RECORDS = ("metrics.jsonl", "ledger.jsonl", "checkpoints")  # what marks a directory as a run's


def earlier_run(output_dir: str) -> list[str]:
    """The records of a run in `output_dir` (an empty checkpoints/ is none)."""
    found = []
    for name in RUN_RECORDS:
        path = os.path.join(output_dir, name)
        if os.path.isfile(path) or (os.path.isdir(path) and os.listdir(path)):
            found.append(name)
    return found


def aside_path(output_dir: str, now: float) -> str:
    """Where --start_over moves an earlier run: `<output_dir>.old-<UTC time>`, a sibling."""
    return f"{os.path.normpath(output_dir)}.old-{time.strftime('%Y%m%d-%H%M%S', time.gmtime(now))}"


def within(path: str, directory: str) -> bool:
    path, directory = os.path.realpath(path), os.path.realpath(directory)
    return os.path.commonpath([path, directory]) == directory


def claim_output_dir(settings: CheckpointSettings, resume_from: str | None, rank: int):
    """Collective. Before a run writes anything to --output_dir: nothing to do when it holds no run, or
    when this run continues it (`resume_from` inside it). Otherwise `--start_over`, or `--resume auto`
    finding no checkpoint (the earlier run left nothing to continue), moves that run aside (rank 0;
    the others wait); any other start is refused with the two ways out."""
    out = settings.output_dir
    found = earlier_run(out)
    if not found or (resume_from is not None and within(resume_from, out)):
        return
    if not (settings.start_over or (settings.resume == "auto" and resume_from is None)):
        raise ConfigError(
            f"--output_dir {out} holds an earlier run ({', '.join(found)}): continue it with --resume auto, "
            f"or start a new one there with --start_over (moves the earlier run to {out}.old-<UTC time>; "
            "nothing is deleted), or pick another --output_dir"
        )
    if rank == 0:
        aside = aside_path(out, time.time())
        os.rename(out, aside)
        os.makedirs(out, exist_ok=True)
        why = "--start_over" if settings.start_over else "--resume auto found no checkpoint"
        print(f"{why}: the earlier run in {out} ({', '.join(found)}) moved to {aside}", flush=True)
    barrier()
