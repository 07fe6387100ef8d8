"""The sample ledger: which train samples every optimizer step consumed, across a run's whole history.

Rank 0 of each process appends to `<output_dir>/ledger.jsonl`, one JSON object a line, each line
one write() of an O_APPEND file (a killed process leaves whole lines):

    start   the process: the run's id (kept in every checkpoint, so a resumed process carries it
            on), the steps done before it and where its data position was, the train set (sample
            count, seed, the data's identity), its global batch, world size and trainer
    epoch   the first time a process reads epoch e: the order's sample count and a sha256 of the order
    step    optimizer step s, once trained, read positions [start, end) of epoch e's order
    not_applied  step s's update was left out (a non-finite gradient, an fp16 overflow, a spike:
            the step's log line says which): its samples were read, never applied. Written once the
            step's verdict is settled (a step later, or before the next checkpoint), after its `step`

A step's samples are a range of the epoch's order (utils.data.epoch_order: one seeded permutation of
the train set's indices, the same for every world size), so a record's size does not grow with the
run (73 bytes at 10^8 samples: scripts/bench_ledger.py); to name samples by their index in the train
set the reader recomputes the order and checks it against its sha256. Each checkpoint records the
ledger's length when it was saved (`Ledger.mark`, after an fsync), which tells a truncated ledger
from a complete one.

`read_ledger` + `ledger_report` (scripts/summarize_run.py --ledger) read it back: the chain of steps
that made the latest model (each process continues the checkpoint it resumed: a step trained after
the checkpoint the next process resumed from was recomputed, its first reading lost; the steps of a
process that resumed an older checkpoint and that no later process continued are not kept), every
sample of every epoch seen exactly once, twice (which, when) or skipped (which), the epoch
boundaries, and where a --allow_data_change draw begins.
"""

import hashlib
import json
import os
import uuid

import numpy as np

from llama_train.errors import LedgerError
from utils.data import epoch_order

LEDGER_FILE = "ledger.jsonl"
FORMAT = 2  # 2: `not_applied` records (format 1 ledgers do not say which updates were skipped)


def order_digest(order: np.ndarray) -> str:
    """sha256 of an epoch's order as utils.data.epoch_order gives it (its dtype named), hashed in place:
    about a tenth of the time drawing the order takes (scripts/bench_ledger.py)."""
    h = hashlib.sha256(f"{order.dtype.str}:{len(order)}:".encode())
    h.update(np.ascontiguousarray(order))
    return h.hexdigest()


class Ledger:
    """The writer; a no-op on ranks other than 0. `header`: the start record's fields (build.build_data)."""

    def __init__(self, output_dir: str, rank: int, run: str | None, header: dict):
        self.path = os.path.join(output_dir, LEDGER_FILE)
        self.run = run or uuid.uuid4().hex[:16]  # a fresh run's id; a resumed one keeps its checkpoint's
        self.fd, self.epochs, self.handed_out = None, set(), {}
        if rank == 0:
            os.makedirs(output_dir, exist_ok=True)
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._write({"event": "start", "format": FORMAT, "run": self.run, **header})

    def _write(self, record: dict):
        os.write(self.fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())

    def epoch(self, epoch: int, order: np.ndarray):
        """This process starts reading epoch `epoch`, whose order is `order`."""
        if self.fd is not None and epoch not in self.epochs:
            self.epochs.add(epoch)
            self._write(
                {"event": "epoch", "epoch": epoch, "samples": len(order), "order": order_digest(order)}
            )

    def handed(self, step: int, epoch: int, start: int, end: int):
        """Optimizer step `step` reads positions [start, end) of epoch `epoch`'s order (steps.train_steps)."""
        for old in [s for s in self.handed_out if s <= step - 8]:  # a loop that never calls trained()
            del self.handed_out[old]
        self.handed_out[step] = (epoch, start, end)

    def trained(self, step: int):
        """Step `step` has trained (forward, backward and its optimizer step ran): its record is written.
        Written after the step, not when its data is handed out, so a process that dies inside a step is
        not said to have trained it. An update the engine left out is said so later (not_applied)."""
        epoch, start, end = self.handed_out.pop(step)
        if self.fd is not None:
            self._write({"event": "step", "step": step, "epoch": epoch, "start": start, "end": end})

    def not_applied(self, step: int):
        """Step `step`'s update was left out (its verdict settled): its samples were read, not applied."""
        if self.fd is not None:
            self._write({"event": "not_applied", "step": step})

    def mark(self) -> dict:
        """What a checkpoint records of the ledger: the run's id and the bytes written so far (made
        durable first, so a checkpoint never outlives the ledger lines of its steps)."""
        if self.fd is None:
            return {"run": self.run}
        os.fsync(self.fd)
        return {"run": self.run, "bytes": os.fstat(self.fd).st_size}


# --- reading it back ---


def read_ledger(path: str) -> list[dict]:
    """Every record of a ledger file; a line cut short or unreadable is a LedgerError naming it."""
    if not os.path.isfile(path):
        raise LedgerError(f"{path}: no such ledger (runs write <output_dir>/{LEDGER_FILE})")
    with open(path, "rb") as f:
        data = f.read()
    lines = data.split(b"\n")
    if lines[-1]:
        raise LedgerError(
            f"{path}:{len(lines)}: the last line is cut short ({len(lines[-1])} bytes without an end): the "
            "file is truncated; restore it from a copy (a copy cut after its last whole line reads up to there)"
        )
    records = []
    for n, line in enumerate(lines[:-1], 1):
        try:
            records.append(json.loads(line))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise LedgerError(f"{path}:{n}: not a ledger record (damaged file): {line[:80]!r}") from None
    if not records or records[0].get("event") != "start":
        raise LedgerError(f"{path}: does not begin with a `start` record: not a sample ledger")
    return records


def check_against_checkpoints(path: str, records: list[dict], checkpoints: dict[str, dict]) -> str:
    """The run the ledger must be of: that of the output_dir's checkpoints (tag -> trainer state),
    else its last process's. A ledger without that run, or shorter than a checkpoint says it was when
    that checkpoint was saved, is a LedgerError."""
    runs = [r["run"] for r in records if r["event"] == "start"]
    marks = {tag: s["ledger"] for tag, s in checkpoints.items() if "run" in s.get("ledger", {})}
    if not marks:
        return runs[-1]
    latest = max(marks)
    run = marks[latest]["run"]
    if run not in runs:
        raise LedgerError(
            f"{path} is the ledger of run {', '.join(dict.fromkeys(runs))}, not of this output_dir's run {run} "
            f"(checkpoint {latest}): give the ledger this run wrote (<output_dir>/{LEDGER_FILE})"
        )
    size = os.path.getsize(path)
    for tag, mark in sorted(marks.items()):
        if mark["run"] == run and mark.get("bytes", 0) > size:
            raise LedgerError(
                f"{path} is truncated: it has {size} bytes, checkpoint {tag} was saved when it had {mark['bytes']}; "
                "the steps after the cut are unknown: restore the file from a copy"
            )
    return run


def draw_of(start: dict) -> str:
    """What decides which sample an index is: the train set (its data identity, without where the
    tokenizer was read from), its size and the seed. A change of it is a new draw (--allow_data_change)."""
    data = {k: v for k, v in (start.get("data") or {}).items() if k != "tokenizer_path"}
    return json.dumps({"data": data, "samples": start["num_samples"], "seed": start["seed"]}, sort_keys=True)


def processes_of(records: list[dict], run: str) -> list[dict]:
    """The run's processes in order: {"start": record, "steps": {step: record}, "epochs": {epoch: record}};
    a step whose update was left out (a `not_applied` record) has "applied": False in its record."""
    out = []
    for r in records:
        if r["event"] == "start":
            out.append({"start": r, "steps": {}, "epochs": {}} if r["run"] == run else None)
        elif out and out[-1] is not None and r["event"] in ("step", "epoch"):
            out[-1]["steps" if r["event"] == "step" else "epochs"][r[r["event"]]] = r
        elif out and out[-1] is not None and r["event"] == "not_applied" and r["step"] in out[-1]["steps"]:
            out[-1]["steps"][r["step"]] = {**out[-1]["steps"][r["step"]], "applied": False}
    return [p for p in out if p is not None]


def parent_history(procs: list[dict], seen: tuple = ()) -> tuple[list[dict], dict | None]:
    """A branch's history before it: the processes of the run its first process resumed (that run's own
    parent's first, recursively), each cut at the branch point (its steps up to it; the processes that
    began at or after it left out), read from the parent's ledger beside the checkpoint it resumed; and
    the branch point {"run", "step", "checkpoint", "ledger", "found"}. ([], None) for a run no branch."""
    start = procs[0]["start"] if procs else {}
    if not start.get("parent"):
        return [], None
    parent = start["parent"]
    point = {**parent, "step": start["done"], "checkpoint": start.get("resumed_from"), "found": False}
    if parent["run"] is None or parent["run"] in seen or not os.path.isfile(parent["ledger"]):
        return [], point
    theirs = processes_of(read_ledger(parent["ledger"]), parent["run"])
    before, _ = parent_history(theirs, (*seen, parent["run"]))
    cut = [
        {**p, "steps": {s: r for s, r in p["steps"].items() if s <= point["step"]}}
        for p in before + theirs
        if p["start"]["done"] < point["step"]
    ]
    return cut, {**point, "found": True}


def step_chain(procs: list[dict]) -> tuple[dict, list, list]:
    """The steps that made the latest model (the last process's), step -> (process index, record); the
    steps trained but not in it, (step, trained by, the chain's process for that step or None); and
    the steps no record covers. Each process continues the model of the latest earlier process that
    trained the step it resumed at (whose checkpoint that was), so a process that resumed an older
    checkpoint and ended before its first save cuts no later process's chain."""
    chains = []
    for i, proc in enumerate(procs):
        done = proc["start"]["done"]
        origin = next((chains[j] for j in reversed(range(i)) if done in procs[j]["steps"]), {})
        chain = {s: v for s, v in origin.items() if s <= done}
        chain.update((s, (i, rec)) for s, rec in proc["steps"].items())
        chains.append(chain)
    chain = chains[-1] if chains else {}
    last = max([*chain, procs[-1]["start"]["done"]]) if procs else 0
    others = [
        (s, i) for i, p in enumerate(procs) for s in sorted(p["steps"]) if chain.get(s, (None,))[0] != i
    ]
    missing = [s for s in range(1, last + 1) if s not in chain]
    return chain, [(s, i, chain[s][0] if s in chain else None) for s, i in others], missing


def spans(steps: list[int]) -> str:
    """[4, 5, 7, 8, 9] -> '4-5, 7-9'."""
    out, run = [], []
    for s in sorted(steps):
        if run and s != run[-1] + 1:
            out.append(run)
            run = []
        run.append(s)
    out += [run] if run else []
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in out)


def draws_of(procs: list[dict]) -> list[dict]:
    """Each draw of the train set (a new one where --allow_data_change changed the data): the first
    process and step reading it, where in its order that process began, and its processes. Each
    process's own draw is its `draw` (an index into the list)."""
    out = []
    for i, proc in enumerate(procs):
        key = draw_of(proc["start"])
        if not out or out[-1]["key"] != key:
            pos = proc["start"]["position"]
            out.append({"key": key, "process": i, "step": proc["start"]["done"] + 1, **pos})
        proc["draw"] = len(out) - 1
    return out


def read_epochs(procs: list[dict], chain: dict, draws: list[dict]) -> list[dict]:
    """Per (draw, epoch) the chain read, in step order: the positions of its order read ([first, read)),
    those read twice (with the steps that read them) and those skipped; `tail`: positions never read
    at the end of an epoch the run went past (by design when shorter than a global batch)."""
    groups: dict[tuple, list] = {}
    for step, (i, rec) in sorted(chain.items()):
        groups.setdefault((procs[i]["draw"], rec["epoch"]), []).append((rec["start"], rec["end"], step, i))
    out = []
    for (d, e), items in groups.items():
        start = procs[items[0][3]]["start"]
        first = draws[d]["consumed"] if draws[d]["epoch"] == e else 0
        twice, skipped, read = [], [], first
        for a, b, step, _ in sorted(items):
            if a > read:
                skipped.append([read, a])
            if a < read:
                earlier = [s for x, y, s, _ in items if s != step and x < min(b, read) and y > a]
                twice.append({"positions": [a, min(b, read)], "steps": sorted([*earlier, step])})
            read = max(read, b)
        steps = [s for _, _, s, _ in items]
        batch = max(b - a for a, b, _, _ in items)
        once = (
            read
            - first
            - sum(y - x for x, y in skipped)
            - sum(t["positions"][1] - t["positions"][0] for t in twice)
        )
        out.append({"draw": d, "epoch": e, "samples": start["num_samples"], "seed": start["seed"], "first": first,
                    "read": read, "steps": [min(steps), max(steps)], "batch": batch, "once": once, "twice": twice,
                    "skipped": skipped, "tail": None})  # fmt: skip
    for ep in out:
        if any(o["draw"] == ep["draw"] and o["epoch"] > ep["epoch"] for o in out):
            ep["tail"] = ep["samples"] - ep["read"]
            if ep["tail"] >= ep["batch"]:  # a whole global batch more fitted: steps left it out
                ep["skipped"].append([ep["read"], ep["samples"]])
    return out


def order_problems(procs: list[dict]) -> list[str]:
    """Processes of one draw that recorded different orders for the same epoch (another torch, a
    changed file behind an unchanged key): their steps' samples are not the ones counted."""
    seen, problems = {}, []
    for i, proc in enumerate(procs):
        for e, rec in proc["epochs"].items():
            was = seen.setdefault((proc["draw"], e), (i, rec["order"]))
            if was[1] != rec["order"]:
                problems.append(f"epoch {e}: process {was[0] + 1} and process {i + 1} read different orders")
    return problems


def ledger_report(records: list[dict], run: str) -> dict:
    """What the run's ledger says (see the module docstring); `ok`: every sample up to the last step
    seen exactly once within its draw and epoch, no step missing, the orders consistent. A branch's
    steps before it are its parent's, read from the parent's ledger (parent_history); where that
    ledger is not there they are named `unchecked`, and the verdict is about the branch's own steps."""
    own = processes_of(records, run)
    before, branch = parent_history(own)
    procs = before + own
    chain, others, missing = step_chain(procs)
    unchecked = list(range(1, branch["step"] + 1)) if branch and not branch["found"] else []
    missing = [s for s in missing if s not in unchecked]
    draws = draws_of(procs)
    epochs = read_epochs(procs, chain, draws)
    problems = order_problems(procs)
    ok = not missing and not problems and not any(ep["twice"] or ep["skipped"] for ep in epochs)
    not_applied = [(s, i, rec) for s, (i, rec) in sorted(chain.items()) if rec.get("applied") is False]
    return {
        "run": run,
        "processes": procs,
        "branch": branch,
        "unchecked": unchecked,
        "last_step": max(chain, default=0),
        "recomputed": [(s, by, again) for s, by, again in others if again is not None and again > by],
        "rolled_back": [(s, by, kept) for s, by, kept in others if kept is not None and kept < by],
        "lost": [(s, by, again) for s, by, again in others if again is None],
        "missing": missing,
        "draws": draws,
        "epochs": epochs,
        "once": sum(ep["once"] for ep in epochs),
        "not_applied": not_applied,  # (step, process, record) of the chain's steps whose update was left out
        "outcomes_known": all(procs[i]["start"].get("format", 1) >= 2 for i, _ in chain.values()),
        "problems": problems,
        "ok": ok,
    }


def sample_indices(ep: dict, procs: list[dict], lo: int, hi: int, limit: int = 10) -> str:
    """Positions [lo, hi) of an epoch's order as the train set's sample indices (at most `limit`), the
    order recomputed and checked against the digest the run recorded; positions if it differs."""
    digests = [p["epochs"][ep["epoch"]]["order"] for p in procs if ep["epoch"] in p["epochs"]]
    order = epoch_order(ep["samples"], ep["seed"], ep["epoch"])
    shown = f"{hi - lo} sample(s)"
    if digests and order_digest(order) != digests[0]:
        return f"{shown} at positions {lo}-{hi - 1} of the order (recomputed here it differs from the run's)"
    more = ", ..." if hi - lo > limit else ""
    return f"{shown}: " + ", ".join(str(i) for i in order[lo : min(hi, lo + limit)].tolist()) + more


def report_lines(report: dict) -> list[str]:
    """The report as summarize_run prints it."""
    procs, chain_last = report["processes"], report["last_step"]
    lines = [f"ledger          run {report['run']}: steps 1-{chain_last} in {len(procs)} process(es)"]
    if branch := report["branch"]:
        steps = f"steps 1-{branch['step']}" if branch["step"] > 1 else "step 1"
        whose = (
            f"{steps} from its ledger {branch['ledger']}"
            if branch["found"]
            else (f"its ledger {branch['ledger']} is not there: {steps} are not checked")
        )
        lines.append(
            f"  branch of     run {branch['run']} at its step {branch['step']} ({branch['checkpoint']}); {whose}"
        )
    for i, p in enumerate(procs):
        s, steps = p["start"], sorted(p["steps"])
        read = steps_named(steps) if steps else "no step"
        came = f"resumed at step {s['done']}" if s["done"] else "fresh start"
        of = f" (run {s['run']})" if s["run"] != report["run"] else ""
        lines.append(f"  process {i + 1:<6}{s['trainer']} x{s['world_size']}, {came}, {read}{of}")
    for d in report["draws"][1:]:
        lines.append(
            f"  new draw      from step {d['step']} (the data changed, --allow_data_change): the new order is read "
            f"from sample {d['consumed']} of epoch {d['epoch']}; its samples before that are not drawn"
        )
    for ep in report["epochs"]:
        tail = f"; {ep['tail']} left in its tail (shorter than a global batch)" if ep["tail"] else ""
        where = f"draw {ep['draw'] + 1} " if len(report["draws"]) > 1 else ""
        label = f"{where}epoch {ep['epoch']}"
        lines.append(
            f"  {label:<14}{steps_named(list(range(ep['steps'][0], ep['steps'][1] + 1)))}: positions {ep['first']}-{ep['read'] - 1} "
            f"of its order of {ep['samples']} samples{tail}"
        )
        for t in ep["twice"]:
            lines.append(
                f"  seen twice    {sample_indices(ep, procs, *t['positions'])} (steps {spans(t['steps'])})"
            )
        for lo, hi in ep["skipped"]:
            lines.append(f"  skipped       epoch {ep['epoch']}: {sample_indices(ep, procs, lo, hi)}")
    lines += not_applied_lines(report)
    if report["recomputed"]:
        redo = report["recomputed"]
        lines.append(f"  recomputed    {steps_named([s for s, _, _ in redo])}: {lost_how(redo)}")
    if report["rolled_back"]:
        back = report["rolled_back"]
        lines.append(f"  not kept      {steps_named([s for s, _, _ in back])}: {rolled_back_how(back)}")
    if report["missing"]:
        lines.append(f"  missing       {steps_named(report['missing'])}: no record in this ledger")
    lines += [f"  inconsistent  {p}" for p in report["problems"]]
    return lines + [verdict(report)]


def not_applied_lines(report: dict) -> list[str]:
    """One line per run of consecutive steps whose updates were left out: their samples, by index."""
    runs: list[list] = []
    for step, i, rec in report["not_applied"]:
        last = runs[-1][-1] if runs else None
        if last and last[0] == step - 1 and last[1] == i and last[2]["end"] == rec["start"]:
            runs[-1].append((step, i, rec))
        else:
            runs.append([(step, i, rec)])
    lines, procs = [], report["processes"]
    for group in runs:
        (_, i, rec), last = group[0], group[-1][2]
        ep = next(e for e in report["epochs"] if e["draw"] == procs[i]["draw"] and e["epoch"] == rec["epoch"])
        samples = sample_indices(ep, procs, rec["start"], last["end"])
        lines.append(
            f"  not applied   {steps_named([s for s, _, _ in group])}: {samples} (read; the update was skipped)"
        )
    return lines


def steps_named(steps: list[int]) -> str:
    """'step 7', 'steps 4-5, 7-8'."""
    return f"step{'s' if len(steps) > 1 else ''} {spans(steps)}"


def lost_how(lost: list) -> str:
    """'trained by process 1 and lost with it, again by process 2' (processes counted from 1); with
    several kills each preceded by its steps."""
    pairs = {}
    for s, by, again in lost:
        pairs.setdefault((by, again), []).append(s)
    how = {k: f"trained by process {k[0] + 1} and lost with it, again by process {k[1] + 1}" for k in pairs}
    if len(pairs) == 1:
        return next(iter(how.values()))
    return "; ".join(f"{spans(steps)} {how[k]}" for k, steps in pairs.items())


def rolled_back_how(back: list) -> str:
    """'trained by process 2 after it resumed an older checkpoint; no later process continued it (the model
    has process 1's)'."""
    pairs = {}
    for s, by, kept in back:
        pairs.setdefault((by, kept), []).append(s)
    how = [
        f"{spans(steps) + ' ' if len(pairs) > 1 else ''}trained by process {by + 1} after it resumed an older "
        f"checkpoint; no later process continued it (the model has process {kept + 1}'s)"
        for (by, kept), steps in pairs.items()
    ]
    return "; ".join(how)


def verdict(report: dict) -> str:
    last, unchecked = report["last_step"], report["unchecked"]
    which = f"of steps {len(unchecked) + 1}-{last}" if unchecked else f"up to step {last}"
    if not report["ok"]:
        return f"verdict         NOT every sample {which} was seen exactly once (above)"
    redo = [s for s, _, _ in report["recomputed"]]
    notes = [f"recomputed {steps_named(redo)} counted once"] if redo else []
    notes += [f"{steps_named(unchecked)}: run {report['branch']['run']}'s, not checked"] if unchecked else []
    notes += [] if report["outcomes_known"] else ["a format-1 ledger: skipped updates are not recorded"]
    note, once = f" ({'; '.join(notes)})" if notes else "", report["once"]
    dropped = [s for s, _, _ in report["not_applied"]]
    if not report["outcomes_known"]:
        return f"verdict         every sample {which} seen exactly once{note}: {once} samples"
    if not dropped:
        return f"verdict         every sample {which} seen and applied exactly once{note}: {once} samples"
    n = sum(rec["end"] - rec["start"] for _, _, rec in report["not_applied"])
    return (
        f"verdict         every sample {which} seen exactly once, applied exactly once but the {n} of "
        f"{steps_named(dropped)} (updates skipped, above){note}: {once - n} of {once} samples applied"
    )
