"""The mixture audit (scripts/summarize_run.py --mixture): each source's share of the train tokens, as
configured against as delivered, read from the sample ledger (llama_train/telemetry/ledger.py) across
resumes, moves and --allow_data_change re-mixes.

Each process's `start` record names its sources, their configured shares and the folder of its mixture
index (utils/data/mixture.py: the source of every train sample). The steps that made the latest model
(ledger.step_chain: a step recomputed after a kill counts once, as it was last trained) each read a
range of their epoch's order; the index says which source each of those samples came from. Samples are
equal blocks of max_seq_len tokens, so a share of the samples is a share of the tokens."""

import os

import numpy as np

from llama_train.telemetry.ledger import draws_of, processes_of, spans, step_chain
from utils.data import epoch_order


def _components(index: str | None, num_samples: int, cache: dict) -> np.ndarray | None:
    """Which source each train sample came from (all 0 for one source); None when the index is gone."""
    if index is None:
        return np.zeros(num_samples, dtype=np.int64)
    if index not in cache:
        path = os.path.join(index, "train_component.npy")
        cache[index] = np.load(path, mmap_mode="r") if os.path.isfile(path) else None
    return cache[index]


def mixture_audit(records: list[dict], run: str) -> list[dict]:
    """Per draw of the train set (a new one where --allow_data_change changed it): its sources, their
    configured shares, the samples each source delivered to the chain's steps, the steps; `index`:
    None when the draw's mixture index is no longer on disk (delivered unknown)."""
    procs = processes_of(records, run)
    chain, _, _ = step_chain(procs)
    draws = [{"steps": [], "delivered": None, "missing": None} for _ in draws_of(procs)]
    cache: dict = {}
    for step, (i, rec) in sorted(chain.items()):
        start, draw = procs[i]["start"], draws[procs[i]["draw"]]
        sources = start.get("sources") or {"names": ["(this run's data)"], "shares": [1.0], "index": None}
        draw.update(names=sources["names"], shares=sources["shares"])
        draw["steps"].append(step)
        component = _components(sources["index"], start["num_samples"], cache)
        if component is None:
            draw["missing"] = sources["index"]
            continue
        read = epoch_order(start["num_samples"], start["seed"], rec["epoch"])[rec["start"] : rec["end"]]
        counts = np.bincount(np.asarray(component)[read], minlength=len(sources["names"]))
        draw["delivered"] = counts if draw["delivered"] is None else draw["delivered"] + counts
    return [d for d in draws if d["steps"]]


def audit_lines(draws: list[dict]) -> list[str]:
    """The audit as summarize_run prints it: per source, configured -> delivered share over the whole
    run (configured: each draw's shares weighted by the samples it delivered), then per draw."""
    names = list(dict.fromkeys(n for d in draws for n in d["names"]))
    total = {n: [0.0, 0] for n in names}  # configured samples, delivered samples
    for d in draws:
        size = sum(d["delivered"]) if d["delivered"] is not None else 0
        for j, n in enumerate(d["names"]):
            total[n][0] += d["shares"][j] * size
            total[n][1] += int(d["delivered"][j]) if d["delivered"] is not None else 0
    samples = sum(t[1] for t in total.values())
    steps = [s for d in draws for s in d["steps"]]
    lines = [f"mixture         share of the train tokens per source, configured -> delivered "
             f"(steps {spans(steps)}: {samples:,} sequences, {len(draws)} draw(s))"]  # fmt: skip
    width = max(map(len, names))
    for n in names:
        conf, got = (total[n][0] / samples, total[n][1] / samples) if samples else (float("nan"),) * 2
        parts = [_draw_share(k, d, n) for k, d in enumerate(draws)] if len(draws) > 1 else []
        lines.append(
            f"  {n:<{width}}  {conf:6.1%} -> {got:6.1%}" + (f"   ({'; '.join(parts)})" if parts else "")
        )
    lines += [f"  draw {k + 1}: its mixture index {d['missing']} is gone: delivered shares unknown"
              for k, d in enumerate(draws) if d["missing"]]  # fmt: skip
    return lines


def _draw_share(k: int, d: dict, name: str) -> str:
    """One draw's configured -> delivered share of `name` (steps named)."""
    where = f"draw {k + 1}, steps {spans(d['steps'])}: "
    if name not in d["names"]:
        return where + "not a source"
    j = d["names"].index(name)
    got = "?" if d["delivered"] is None else f"{d['delivered'][j] / max(1, sum(d['delivered'])):.1%}"
    return where + f"{d['shares'][j]:.1%} -> {got}"
