"""Downstream tasks scored in the training loop (`--eval_tasks`), the way lm-evaluation-harness's HF
backend scores them, so the numbers agree with it on the run's export (tests/test_eval_tasks.py).

What is matched, and how (lm_eval 0.4.13: api/model.py, models/huggingface.py, api/task.py):
- requests: multiple choice scores (context, " " + choice) for each choice (target_delimiter " "),
  cloze (context, target) with the target as written (LAMBADA: " " + the last word); zero-shot, no
  description, the context as the task file gives it (utils/data/tasks.py: the layouts' templates).
- encoding (`encode_pair`): trailing whitespace of the context moves to the continuation; the
  context + continuation is encoded whole and the continuation is what follows the context's own
  encoding; `tokenizer.encode` with its default special tokens (ours adds no BOS); an empty context
  is the BOS token (else EOS), as lm-eval's prefix_token_id.
- truncation (`model_input`): (context + continuation)[-(max_seq_len + 1):][:-1], the context
  losing its first tokens; a continuation longer than max_seq_len cannot be scored and is refused.
- scores: an item's log-likelihood is the sum of log_softmax(logits) (fp32) over the continuation's
  tokens; greedy = every continuation token is the argmax. acc = argmax of the choices'
  log-likelihoods is gold; acc_norm divides each by the choice's length in characters, acc_bytes by
  its UTF-8 bytes (np.argmax: the first of equal values); cloze: acc = greedy, ppl = exp(-mean ll).
  stderr = the sample standard deviation / sqrt(n) (lm-eval's mean_stderr).

Cost: requests are sorted by length and cut into batches of --batch_size, dealt round-robin to the
data-parallel replicas (the ranks of one replica score the same batches); every rank runs as many
forwards (ZeRO-3 and FSDP2 gather weights in each), and the scores are all-gathered once.
"""

import json
import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from llama_train.distributed.dist import all_gather_object, to_device
from llama_train.errors import ConfigError
from utils.data import BUILTIN_TASK, CLOZE, Task, builtin_task, read_task, task_entries


@dataclass(frozen=True)
class Request:
    tokens: tuple[int, ...]  # the model's input
    target: tuple[int, ...]  # the continuation's tokens, predicted by the input's last len(target) positions
    task: int
    item: int
    choice: int


@dataclass
class TaskSet:
    tasks: list[Task]
    requests: list[Request]
    items: list[int]  # per task: the items scored
    truncated: int  # requests whose context lost tokens to fit max_seq_len
    dropped: int  # built-in items left out: a choice longer than half of max_seq_len


def prefix_token(tokenizer) -> int:
    """lm-eval's prefix_token_id: what an empty context is (BOS, else EOS)."""
    return tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id


def tok_encode(tokenizer, text: str) -> list[int]:
    """lm-eval's HFLM.tok_encode (add_bos_token unset): the tokenizer's default special tokens, none
    added when the text already starts with the prefix token."""
    starts = text.startswith(tokenizer.decode(prefix_token(tokenizer)))
    return tokenizer.encode(text, **({"add_special_tokens": False} if starts else {}))


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context tokens, continuation tokens) as lm-eval's loglikelihood and _encode_pair make them."""
    if context == "":
        cont = tokenizer.encode(continuation, add_special_tokens=False)
        prefix = prefix_token(tokenizer)
        return ([prefix], cont) if prefix != cont[0] else (cont[:1], cont[1:])
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole, ctx = tok_encode(tokenizer, context + continuation), tok_encode(tokenizer, context)
    return ctx, whole[len(ctx) :]


def model_input(context: list[int], continuation: list[int], max_seq_len: int) -> list[int]:
    """lm-eval's causal input: the last max_seq_len + 1 tokens of context + continuation, less the last."""
    return (context + continuation)[-(max_seq_len + 1) :][:-1]


def task_requests(
    t: int, task: Task, tokenizer, max_seq_len: int, limit: int
) -> tuple[list[Request], list[int], int]:
    """(requests, the items scored, how many requests were left-truncated) for the first `limit` items
    of `task` (-1: all). A choice longer than max_seq_len cannot be scored (a context is left-truncated, a
    continuation never is): a ConfigError for a task file; the built-in task leaves out the items with
    a choice longer than half of it (so half the window is context), a property of the run's tokenizer."""
    fit = max_seq_len // 2 if task.name == BUILTIN_TASK else max_seq_len
    requests, items, truncated = [], [], 0
    for i, item in enumerate(task.items if limit < 0 else task.items[:limit]):
        pairs = [encode_pair(tokenizer, item.context, text) for text in task.continuations(item)]
        longest = max(range(len(pairs)), key=lambda c: len(pairs[c][1]))
        if len(pairs[longest][1]) > fit and task.name == BUILTIN_TASK:
            continue
        if len(pairs[longest][1]) > fit:
            raise ConfigError(
                f"{task.source}:{item.line}: choice {longest} is {len(pairs[longest][1])} tokens, more than "
                f"--max_seq_len {max_seq_len}: it cannot be scored (a context is left-truncated to fit, a "
                "continuation never is); shorten it or raise --max_seq_len"
            )
        for c, (ctx, cont) in enumerate(pairs):
            requests.append(Request(tuple(model_input(ctx, cont, max_seq_len)), tuple(cont), t, i, c))
            truncated += len(ctx) + len(cont) > max_seq_len + 1
        items.append(i)
    return requests, items, truncated


def prepare_tasks(args, tokenizer, local_rank: int) -> TaskSet | None:
    """--eval_tasks read (the built-in one built once under --data_output_path) and encoded: None
    without it. Files were checked by config.validate; a choice too long is a ConfigError here,
    before any step."""
    tasks = []
    for entry in task_entries(args.eval_tasks):
        if entry == BUILTIN_TASK:
            tasks.append(builtin_task(args.data_split, args.seed, args.data_output_path, local_rank))
        else:
            tasks.append(read_task(entry))
    if not tasks:
        return None
    limit, requests, items, truncated, dropped = args.eval_task_limit, [], [], 0, 0
    for t, task in enumerate(tasks):
        more, scored, cut = task_requests(t, task, tokenizer, args.max_seq_len, limit)
        requests, truncated, items = requests + more, truncated + cut, items + [len(scored)]
        dropped += (len(task.items) if limit < 0 else min(limit, len(task.items))) - len(scored)
    requests.sort(key=lambda r: (-len(r.tokens), r.tokens))  # lm-eval's order: longest first
    return TaskSet(tasks, requests, items, truncated, dropped)


def describe(taskset: TaskSet) -> str:
    """The start-up line: each task's items and kind; the contexts left-truncated, the items left out."""
    parts = []
    for t, n in zip(taskset.tasks, taskset.items):
        where = f": {t.source}" if t.name == BUILTIN_TASK else ""  # the file lm-eval can score too
        kind = "cloze" if t.kind == CLOZE else f"{len(t.items[0].choices)} choices"
        parts.append(f"{t.name} {n} items ({kind}, {t.layout} layout{where})")
    notes = [f"{taskset.truncated} request(s) left-truncated to --max_seq_len"] * bool(taskset.truncated)
    notes += [f"{taskset.dropped} built-in item(s) left out (a choice over half of --max_seq_len)"] * bool(
        taskset.dropped
    )
    return f"eval tasks: {', '.join(parts)}" + "".join(f"; {n}" for n in notes)


# --- scoring ---


def replica_batches(requests: list, batch_size: int, replica: int, replicas: int) -> list[list]:
    """Replica `replica`'s batches: every `replicas`-th batch of `batch_size` requests, padded to as
    many as every other replica's by repeating its last one (scored, then dropped), so all ranks run
    the same number of forwards."""
    batches = [requests[i : i + batch_size] for i in range(0, len(requests), batch_size)]
    mine, most = batches[replica::replicas], -(-len(batches) // replicas)
    return mine + [[]] * (most - len(mine))


@torch.no_grad()
def score_batch(engine, batch: list[Request], device, pad: list[Request]) -> list[tuple[float, bool]]:
    """(log-likelihood, greedy) of each request, one right-padded forward (causal: padding after a
    request changes none of its logits). An empty batch runs `pad` and returns nothing."""
    rows = batch or pad
    width = max(len(r.tokens) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r.tokens)] = torch.tensor(r.tokens)
    logits = engine(**to_device({"input_ids": ids}, device))
    logp = torch.log_softmax(logits.float(), dim=-1)
    out = []
    for i, r in enumerate(batch):
        n, end = len(r.target), len(r.tokens)
        picked, target = logp[i, end - n : end], torch.tensor(r.target, device=logp.device)
        ll = picked.gather(-1, target[:, None]).sum()
        out.append((float(ll), bool((picked.argmax(-1) == target).all())))
    return out


def score_requests(engine, taskset: TaskSet, device, replica: int, replicas: int, batch_size: int) -> list:
    """(log-likelihood, greedy) of every request of `taskset`, in its order, on every rank
    (collective: one all_gather_object)."""
    engine.eval()
    index = {id(r): k for k, r in enumerate(taskset.requests)}
    mine = []
    for batch in replica_batches(taskset.requests, batch_size, replica, replicas):
        scored = score_batch(engine, batch, device, taskset.requests[-batch_size:])  # pad: the shortest
        mine += [(index[id(r)], s) for r, s in zip(batch, scored)]
    engine.train()
    merged = {}
    for part in all_gather_object(mine):
        merged.update(part)  # the ranks of one replica (TP) send the same scores
    return [merged[k] for k in range(len(taskset.requests))]


def mean_stderr(values: list[float]) -> float:
    """lm-eval's mean_stderr: the sample standard deviation over sqrt(n) (NaN below two values)."""
    n = len(values)
    if n < 2:
        return float("nan")
    mu = sum(values) / n
    return math.sqrt(sum((x - mu) ** 2 for x in values) / (n - 1)) / math.sqrt(n)


def item_scores(task: Task, index: int, lls: list[float], greedy: list[bool]) -> dict:
    """One item's sample record: its log-likelihoods and what each metric makes of them."""
    item = task.items[index]
    record = {"item": index, "line": item.line, "gold": item.gold, "lls": lls, "greedy": greedy}
    if task.kind == CLOZE:
        return record | {"acc": float(greedy[0])}
    chars = np.array([float(len(c)) for c in item.choices])
    nbytes = np.array([float(len(c.encode("utf-8"))) for c in item.choices])
    pred, pred_norm, pred_bytes = (int(np.argmax(np.array(lls) / d)) for d in (1.0, chars, nbytes))
    return record | {
        "pred": pred,
        "acc": float(pred == item.gold),
        "acc_norm": float(pred_norm == item.gold),
        "acc_bytes": float(pred_bytes == item.gold),
    }


def task_metrics(samples: list[dict], kind: str) -> dict:
    """A task's scores over its item records: acc (and acc_norm, acc_bytes; cloze: ppl), n, stderrs."""
    out = {"n": len(samples)}
    for metric in ("acc",) if kind == CLOZE else ("acc", "acc_norm", "acc_bytes"):
        values = [s[metric] for s in samples]
        out[metric] = sum(values) / len(values)
        out["stderr" if metric == "acc" else f"{metric}_stderr"] = mean_stderr(values)
    if kind == CLOZE:
        out["ppl"] = math.exp(-sum(s["lls"][0] for s in samples) / len(samples))
    return out


def score_tasks(engine, taskset: TaskSet, device, replica: int, replicas: int, batch_size: int):
    """({task: scores}, {task: item records}) at this point of training (collective)."""
    scores = score_requests(engine, taskset, device, replica, replicas, batch_size)
    per_item: dict[tuple[int, int], dict[int, tuple]] = {}
    for r, s in zip(taskset.requests, scores):
        per_item.setdefault((r.task, r.item), {})[r.choice] = s
    metrics, samples = {}, {}
    for t, task in enumerate(taskset.tasks):
        rows = []
        for i in sorted(i for k, i in per_item if k == t):
            choices = [per_item[t, i][c] for c in range(len(per_item[t, i]))]
            rows.append(item_scores(task, i, [ll for ll, _ in choices], [g for _, g in choices]))
        samples[task.name], metrics[task.name] = rows, task_metrics(rows, task.kind)
    return metrics, samples


def write_samples(output_dir: str, step: int, samples: dict, rank: int) -> str | None:
    """Rank 0 writes every item's scores at this evaluation to <output_dir>/eval_tasks/step_N.jsonl,
    one line per item (as lm-eval's --log_samples): what tests and users compare item by item."""
    if rank != 0:
        return None
    folder = os.path.join(output_dir, "eval_tasks")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"step_{step}.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps({"task": name, **s}) + "\n" for name, rows in samples.items() for s in rows)
    return path
