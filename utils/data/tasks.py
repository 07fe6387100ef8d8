"""Downstream tasks for the in-loop evaluation (`--eval_tasks`): task files read from local disk and
the built-in task, made from held-out documents of the built-in corpus.

A task file is JSON Lines, one item a line, in one of these layouts (told apart by the first item's
keys; LAYOUTS), converted as lm-evaluation-harness's own task definitions convert them:

    ours, multiple choice   {"context": str, "choices": [str, ...], "gold": int}
    ours, cloze             {"context": str, "target": str}   (the target scored as written)
    hellaswag               HellaSwag's {"activity_label", "ctx_a", "ctx_b", "endings", "label", ...}:
                            lm-eval's hellaswag preprocess (brackets dropped, "[title]" a full stop)
    arc                     ARC's {"question", "choices": {"text", "label"}, "answerKey"} (the Hugging
                            Face layout) or {"question": {"stem", "choices": [{"text", "label"}]},
                            "answerKey"} (AI2's release): "Question: {question}\\nAnswer:"
    piqa                    PIQA's {"goal", "sol1", "sol2"[, "label"]}, labels from the "label" field or,
                            as published, from FILE-labels.lst beside FILE.jsonl: "Question: {goal}\\nAnswer:"
    lambada                 LAMBADA's {"text"}: the context is every word but the last, the target " "
                            + the last word (lm-eval's lambada_openai)

Multiple choice: each choice is scored as " " + choice after the context (lm-eval's default
target_delimiter). Cloze: the target alone, one continuation (lm-eval's `loglikelihood` tasks).
A malformed line, a gold index out of range or a missing file is a DataSourceError naming the file
and line; `task_problems` collects them for the flag check.
"""

import hashlib
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from llama_train.errors import DataSourceError
from utils.data.cache import build_once, sha256_json
from utils.data.data_utils import document_splits, parse_split
from utils.data.sources import BuiltinSource, _lines

BUILTIN = "builtin"
MULTIPLE_CHOICE, CLOZE = "multiple_choice", "cloze"
TARGET_DELIMITER = " "  # lm-eval's default: between the context and each choice


@dataclass(frozen=True)
class TaskItem:
    """One question: the context, the choices (cloze: the one target) and the gold choice's index."""

    context: str
    choices: tuple[str, ...]
    gold: int
    line: int = 0  # where it came from in its file (1-based), for error messages


@dataclass(frozen=True)
class Task:
    name: str
    kind: str  # MULTIPLE_CHOICE or CLOZE
    items: tuple[TaskItem, ...]
    source: str  # the file it was read from
    layout: str

    def continuations(self, item: TaskItem) -> list[str]:
        """The strings scored after `item.context`, as lm-eval builds its requests."""
        if self.kind == CLOZE:
            return [item.choices[0]]
        return [TARGET_DELIMITER + c for c in item.choices]


# --- the layouts ---


def _string(record: dict, key: str, where: str) -> str:
    value = record.get(key)
    if not isinstance(value, str) or not value.strip():
        raise DataSourceError(f"{where}: {key!r} must be a non-empty string, got {value!r}")
    return value


def _gold(value, n: int, where: str) -> int:
    """An index into `n` choices (an int or a digit string, as datasets publish labels)."""
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise DataSourceError(f"{where}: the gold label must be an integer index, got {value!r}")
    if not 0 <= value < n:
        raise DataSourceError(f"{where}: gold index {value} is out of range for {n} choices (0..{n - 1})")
    return value


def _choices(value, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) < 2 or not all(isinstance(c, str) and c for c in value):
        raise DataSourceError(f"{where}: 'choices' must be a list of two or more non-empty strings")
    return tuple(value)


def ours_mc(r: dict, where: str, label=None) -> TaskItem:
    choices = _choices(r.get("choices"), where)
    return TaskItem(_string(r, "context", where), choices, _gold(r.get("gold"), len(choices), where))


def ours_cloze(r: dict, where: str, label=None) -> TaskItem:
    return TaskItem(_string(r, "context", where), (_string(r, "target", where),), 0)


def _hellaswag_text(text: str) -> str:
    """lm-eval's hellaswag `preprocess` (tasks/hellaswag/utils.py)."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub("\\[.*?\\]", "", text).replace("  ", " ")


def hellaswag(r: dict, where: str, label=None) -> TaskItem:
    ctx = _string(r, "ctx_a", where) + " " + str(r.get("ctx_b", "")).capitalize()
    endings = _choices(r.get("endings"), where)
    query = _hellaswag_text(str(r.get("activity_label", "")) + ": " + ctx)
    return TaskItem(
        query, tuple(_hellaswag_text(e) for e in endings), _gold(r.get("label"), len(endings), where)
    )


def arc(r: dict, where: str, label=None) -> TaskItem:
    question = r.get("question")
    if isinstance(question, dict):  # AI2's release: the choices inside the question
        texts = [c.get("text") for c in question.get("choices", [])]
        labels = [c.get("label") for c in question.get("choices", [])]
        question = question.get("stem")
    else:
        texts, labels = (r.get("choices") or {}).get("text"), (r.get("choices") or {}).get("label")
    if not isinstance(question, str) or not question.strip():
        raise DataSourceError(f"{where}: no question text")
    choices = _choices(texts, where)
    key = r.get("answerKey")
    if not isinstance(labels, list) or key not in labels:
        raise DataSourceError(f"{where}: answerKey {key!r} is not one of the choice labels {labels}")
    return TaskItem(f"Question: {question}\nAnswer:", choices, labels.index(key))


def piqa(r: dict, where: str, label=None) -> TaskItem:
    choices = (_string(r, "sol1", where), _string(r, "sol2", where))
    gold = r.get("label", label)
    if gold is None:
        raise DataSourceError(f"{where}: no 'label' field and no FILE-labels.lst line for it")
    return TaskItem(f"Question: {_string(r, 'goal', where)}\nAnswer:", choices, _gold(gold, 2, where))


def lambada(r: dict, where: str, label=None) -> TaskItem:
    words = _string(r, "text", where).split(" ")
    if len(words) < 2:
        raise DataSourceError(f"{where}: 'text' needs at least two words (a context and the last word)")
    return TaskItem(" ".join(words[:-1]), (" " + words[-1],), 0)


# layout -> (the keys that identify it, its kind, the converter); the first whose keys a record has wins
LAYOUTS: dict[str, tuple[frozenset, str, Callable]] = {
    "ours": (frozenset({"context", "choices", "gold"}), MULTIPLE_CHOICE, ours_mc),
    "ours-cloze": (frozenset({"context", "target"}), CLOZE, ours_cloze),
    "hellaswag": (frozenset({"ctx_a", "endings", "label"}), MULTIPLE_CHOICE, hellaswag),
    "arc": (frozenset({"question", "answerKey"}), MULTIPLE_CHOICE, arc),
    "piqa": (frozenset({"goal", "sol1", "sol2"}), MULTIPLE_CHOICE, piqa),
    "lambada": (frozenset({"text"}), CLOZE, lambada),
}


def layout_of(record, where: str) -> str:
    keys = set(record) if isinstance(record, dict) else set()
    for name, (needed, _, _) in LAYOUTS.items():
        if needed <= keys:
            return name
    shown = ", ".join(sorted(map(str, keys))[:10]) or type(record).__name__
    raise DataSourceError(
        f"{where}: not a task item of a known layout (keys: {shown}); write "
        '{"context": ..., "choices": [...], "gold": N} or {"context": ..., "target": ...} (docs/evaluation.md)'
    )


def _records(path: Path):
    """(line number, parsed JSON) of every non-blank line; an invalid line names itself."""
    for lineno, line in _lines(path):
        if line.strip():
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataSourceError(
                    f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})"
                ) from None


def _labels_file(path: Path) -> list[str] | None:
    """PIQA's published labels: FILE-labels.lst beside FILE.jsonl, one 0/1 a line."""
    beside = path.with_name(path.stem + "-labels.lst")
    return beside.read_text().split() if beside.is_file() else None


def read_task(path: str | Path, name: str | None = None) -> Task:
    """The task in the JSONL file `path` (its layout from the first item); DataSourceError naming the
    file and line of the first bad item."""
    path = Path(path)
    if not path.is_file():
        raise DataSourceError(f"{path}: no such task file; give a task JSONL (docs/evaluation.md) or builtin")
    items, layout, labels = [], None, None
    for lineno, record in _records(path):
        where = f"{path}:{lineno}"
        if layout is None:
            layout = layout_of(record, where)
            labels = _labels_file(path) if layout == "piqa" else None
        elif layout_of(record, where) != layout:
            raise DataSourceError(f"{where}: a {layout_of(record, where)} item in a {layout} task file")
        label = labels[len(items)] if labels and len(items) < len(labels) else None
        items.append(replace(LAYOUTS[layout][2](record, where, label), line=lineno))
    if not items:
        raise DataSourceError(f"{path}: no task items (the file is empty)")
    return Task(name or path.stem, LAYOUTS[layout][1], tuple(items), str(path), layout)


def task_entries(spec: str | None) -> list[str]:
    """--eval_tasks NAME|PATH[,NAME|PATH...] as a list (empty: none)."""
    return [e.strip() for e in (spec or "").split(",") if e.strip()]


def task_name(entry: str) -> str:
    return BUILTIN if entry == BUILTIN else Path(entry).stem


def task_problems(spec: str | None) -> list[str]:
    """Every problem with --eval_tasks, one per task: a missing file, a malformed line, a gold index
    out of range (read in full here, so they are said before any work), two tasks of one name."""
    problems, names = [], [task_name(e) for e in task_entries(spec)]
    for entry in task_entries(spec):
        if entry != BUILTIN:
            try:
                read_task(entry)
            except DataSourceError as e:
                problems.append(f"--eval_tasks: {e}")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        problems.append(
            f"--eval_tasks names the task(s) {', '.join(twice)} twice (a task is named by its file's stem)"
        )
    return problems


# --- the built-in task: a held-out passage's next words in their true order, among reorderings of them ---

BUILTIN_FORMAT = 2
CONTEXT_WORDS, CONTINUATION_WORDS, STRIDE, CHOICES = 24, 5, 16, 4


def builtin_items(held_out: list[str], seed: int) -> list[dict]:
    """Items in our multiple-choice layout from held-out documents (whitespace runs as single spaces):
    every STRIDE words, the CONTEXT_WORDS before a point are the context; the true choice is the
    CONTINUATION_WORDS after it, the other CHOICES - 1 are the same words in other orders (so every
    choice has the same characters: an untrained model scores them alike, and a model that learned how
    the words follow each other and the context picks the true one). Seeded by `seed` alone
    (random.Random over a sha256), so every process and machine makes the same."""
    rng = random.Random(int.from_bytes(hashlib.sha256(f"builtin-task:{seed}".encode()).digest()[:8], "big"))
    items = []
    for words in (doc.split() for doc in held_out):
        for at in range(CONTEXT_WORDS, len(words) - CONTINUATION_WORDS + 1, STRIDE):
            true = words[at : at + CONTINUATION_WORDS]
            choices = [" ".join(true)]
            for _ in range(50):  # distinct reorderings (a span of repeated words has too few)
                order = " ".join(rng.sample(true, len(true)))
                if len(choices) < CHOICES and order not in choices:
                    choices.append(order)
            if len(choices) < CHOICES:
                continue
            gold = rng.randrange(CHOICES)
            choices.insert(gold, choices.pop(0))
            items.append(
                {"context": " ".join(words[at - CONTEXT_WORDS : at]), "choices": choices, "gold": gold}
            )
    if not items:
        raise DataSourceError(
            "the built-in task found no passage in the eval split's held-out built-in text: give --data_split a "
            "larger eval weight (e.g. '90,10')"
        )
    return items


def held_out_builtin(data_split: str, seed: int) -> list[str]:
    """The built-in corpus's documents that --data_split and --seed put in the eval split (the ones a
    run on builtin never trains on: data_utils.document_splits)."""
    splits = document_splits(parse_split(data_split), seed)
    return [doc for doc, split in zip(BuiltinSource().documents(), splits) if split == "eval"]


def builtin_task(data_split: str, seed: int, cache_root, local_rank: int) -> Task:
    """The built-in task, written once as a task file in our layout under `cache_root` (keyed by the
    corpus's fingerprint, the split and the seed), then read back as any task file is: lm-eval scores
    that same file. Built by local rank 0 (the others wait), as the token cache is."""
    inputs = {
        "format": BUILTIN_FORMAT,
        "corpus": BuiltinSource().fingerprint(),
        "split": data_split,
        "seed": seed,
    }
    key = sha256_json(inputs)
    folder = Path(cache_root) / f"task-builtin-{key[:16]}"

    def build(tmp: Path) -> dict:
        items = builtin_items(held_out_builtin(data_split, seed), seed)
        (tmp / "builtin.jsonl").write_text("".join(json.dumps(i) + "\n" for i in items))
        return {"format": BUILTIN_FORMAT, "key": key, "items": len(items)}

    build_once(folder, build, local_rank, what="built-in task")
    return read_task(folder / "builtin.jsonl", BUILTIN)
