"""Goodput: the share of a run's wall-clock that went into training steps that count, across every
restart, and where the rest went (the badput).

Each process of a run appends to the same metrics.jsonl; what this module reads there:

    start    one per process (StepLogger): its process start time, the steps done before it, and
             the start-up phases timed with `phase` (data build, checkpoint load); a resumed
             process writes its `resume` record before it
    train    step_time_s: the mean over the steps since the last log line, evaluation, checkpoint
             and compile time left out (so steps x step_time_s is training time)
    eval     seconds: the evaluation; tasks_seconds: its downstream tasks' part (--eval_tasks), counted
             apart as `eval_tasks`
    save     seconds: writing a checkpoint (StepLogger.saved)
    compile  compile_s (llama_train/distributed/compile.py)
    hang     seconds without a completed step before the watchdog ended the process (watchdog.py)

Steps trained after the checkpoint the next process resumed from are trained twice: their first
time is lost work (`lost_steps` of them). The gap between one process's last record and the next
process's start is time between runs (a requeue). What no record explains is `other`.
"""

import contextlib
import time

import psutil

SPENT: dict[str, float] = {}  # start-up phase -> seconds in this process, for the `start` record
BADPUT = (
    "startup",
    "data_build",
    "checkpoint_load",
    "compile",
    "checkpoint_save",
    "evaluation",
    "eval_tasks",
    "hang",
    "lost_work",
    "between_runs",
    "other",
)


@contextlib.contextmanager
def phase(name: str):
    """Time a start-up phase of this process (`data_build`, `checkpoint_load`)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        SPENT[name] = SPENT.get(name, 0.0) + time.perf_counter() - t0


def start_record(done: int) -> dict:
    """The fields of this process's `start` record."""
    return {
        "done": done,
        "process_start": psutil.Process().create_time(),
        **{f"{k}_s": v for k, v in SPENT.items()},
    }


def segments(records: list[dict]) -> list[list[dict]]:
    """The records of each process: a new one begins at its `resume` record (written while it loads
    the checkpoint) or its `start` record, whichever comes first (a run from before `start` records
    existed is one segment)."""
    out = [[]]
    for r in records:
        if r["event"] in ("start", "resume") and any(x["event"] == "start" for x in out[-1]):
            out.append([])
        out[-1].append(r)
    return out


def segment_split(seg: list[dict], cut: float) -> dict:
    """Seconds by kind for one process; training steps after `cut` (the next process's resume point)
    are lost work."""
    start = next((r for r in seg if r["event"] == "start"), None)
    begin = start["process_start"] if start else seg[0]["time"]
    out = dict.fromkeys(("productive", *BADPUT), 0.0)
    out["lost_steps"], out["begin"], out["end"] = 0, begin, max(r["time"] for r in seg)
    if start:
        out["data_build"] = start.get("data_build_s", 0.0)
        out["checkpoint_load"] = start.get("checkpoint_load_s", 0.0)
        out["startup"] = start["time"] - begin - out["data_build"] - out["checkpoint_load"]
    last = start["done"] if start else 0
    for r in seg:
        kind = r["event"]
        if kind == "train":
            lost = max(0, r["step"] - max(last, cut))
            out["lost_work"] += lost * r["step_time_s"]
            out["productive"] += (r["step"] - last - lost) * r["step_time_s"]
            out["lost_steps"] += lost
            last = r["step"]
        elif kind in ("eval", "save", "hang"):
            name = {"eval": "evaluation", "save": "checkpoint_save", "hang": "hang"}[kind]
            out[name] += r.get("seconds", 0.0) - r.get("tasks_seconds", 0.0)
            out["eval_tasks"] += r.get("tasks_seconds", 0.0)
        elif kind == "compile":
            out["compile"] += r["compile_s"]
    return out


def goodput(records: list[dict]) -> dict:
    """wall_s, productive_s, goodput, badput_s (by BADPUT kind), lost_steps, restarts of a run's
    metrics.jsonl records."""
    segs = segments(records)
    cuts = [next((r["done"] for r in s if r["event"] == "start"), 0) for s in segs[1:]] + [float("inf")]
    parts = [segment_split(s, cut) for s, cut in zip(segs, cuts)]
    for a, b in zip(parts, parts[1:]):
        a["between_runs"] = max(0.0, b["begin"] - a["end"])
    wall = parts[-1]["end"] - parts[0]["begin"]
    badput = {k: sum(p[k] for p in parts) for k in BADPUT}
    productive = sum(p["productive"] for p in parts)
    badput["other"] = wall - productive - sum(badput.values())
    return {
        "wall_s": wall,
        "productive_s": productive,
        "goodput": productive / wall if wall > 0 else float("nan"),
        "badput_s": badput,
        "lost_steps": sum(p["lost_steps"] for p in parts),
        "restarts": len(parts) - 1,
    }
