"""Downstream tasks in the training loop (--eval_tasks; llama_train/train/tasks.py, utils/data/tasks.py)
and a mixture's eval loss per source.

First the readers and the bad inputs, without a launch. Then one module's runs, 2 ranks each, 20 steps
of the debug model on a two-source mixture, evaluated at steps 0, 10 and 20 on the built-in task and
one task file in each published layout (ARC, HellaSwag, PIQA, LAMBADA): DDP, DDP without --eval_tasks
(the train curve must be bit-identical), ZeRO-2, ZeRO-3 and FSDP2 (per-item log-likelihoods equal to
1e-5, predictions identical, per-source losses equal), and tensor parallel over both ranks (one step:
its step-0 scores against DDP's). Last, lm-evaluation-harness 0.4.13 (the `dev`
extra installs it; its HF backend, offline, with its own task definitions pointed at the same files)
scores the DDP run's export: the same per-item log-likelihoods (1e-4) and accuracies."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from llama_train.config import build_parser, parse_args
from llama_train.errors import ConfigError, DataSourceError
from llama_train.train.tasks import encode_pair, mean_stderr, model_input, task_requests
from tests.trainer_utils import ROOT, env, launch, read_metrics
from utils.data import builtin_task, load_tokenizer, read_task
from utils.data.sources import resolve_sources
from utils.data.tasks import builtin_items

pytestmark = pytest.mark.usefixtures("deepspeed_ops")  # tests/conftest.py

STEPS, SEQ, LIMIT = 20, 64, 40
LAYOUT_TASKS = ("arc", "hellaswag", "piqa", "lambada")


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def published_tasks(folder: Path, words: list[str]) -> dict[str, Path]:
    """Six items in each published layout, cut from real prose: ARC (the Hugging Face layout, one
    question long enough to be left-truncated), HellaSwag (brackets and [title] for its preprocess),
    PIQA (labels inline) and LAMBADA."""
    span = lambda k, n: " ".join(words[k : k + n])  # noqa: E731
    arc = [
        {"id": f"q{i}", "question": span(50 * i, 60 if i == 0 else 12),
         "choices": {"text": [span(50 * i + 12 + 4 * j, 3) for j in range(4)], "label": list("ABCD")},
         "answerKey": "ABCD"[i % 4]}
        for i in range(6)
    ]  # fmt: skip
    hellaswag = [
        {"ind": i, "activity_label": "Reading docs", "ctx_a": span(400 + 30 * i, 9), "ctx_b": span(409 + 30 * i, 3),
         "endings": [f"{span(420 + 30 * i + 3 * j, 3)} [title] {span(500 + j, 2)} [header]" for j in range(4)],
         "label": str(i % 4), "split": "val", "split_type": "indomain", "source_id": f"s{i}"}
        for i in range(6)
    ]  # fmt: skip
    piqa = [{"goal": span(700 + 20 * i, 8), "sol1": span(708 + 20 * i, 5), "sol2": span(713 + 20 * i, 5),
             "label": i % 2} for i in range(6)]  # fmt: skip
    lambada = [{"text": span(900 + 25 * i, 18)} for i in range(6)]
    rows = {"arc": arc, "hellaswag": hellaswag, "piqa": piqa, "lambada": lambada}
    return {name: write_jsonl(folder / f"{name}.jsonl", r) for name, r in rows.items()}


# --- the readers and the bad inputs, without a launch ---


def test_the_published_layouts_read_as_lm_eval_converts_them(tmp_path):
    words = " ".join(d for d, _ in zip(resolve_sources(["builtin"])[0].documents(), range(20))).split()
    files = published_tasks(tmp_path, words)
    arc, hs, piqa, lam = (read_task(files[n]) for n in LAYOUT_TASKS)
    assert [t.layout for t in (arc, hs, piqa, lam)] == list(LAYOUT_TASKS)
    assert arc.items[1].context == f"Question: {' '.join(words[50:62])}\nAnswer:" and arc.items[1].gold == 1
    assert (
        "[" not in hs.items[0].choices[0] and ". " in hs.items[0].choices[0]
    )  # [title] -> ". ", [header] gone
    assert hs.items[0].context.startswith("Reading docs: ") and [i.gold for i in hs.items] == [
        0,
        1,
        2,
        3,
        0,
        1,
    ]
    assert piqa.items[0].context.startswith("Question: ") and len(piqa.items[0].choices) == 2
    assert lam.kind == "cloze" and lam.items[0].choices == (" " + words[917],)
    assert lam.items[0].context == " ".join(words[900:917])
    assert arc.continuations(arc.items[0])[0] == " " + arc.items[0].choices[0]  # target_delimiter " "
    # AI2's own ARC release nests the choices in the question; PIQA as published keeps labels beside it
    ai2 = {"question": {"stem": "Why?", "choices": [{"text": "a", "label": "1"}, {"text": "b", "label": "2"}]},
           "answerKey": "2"}  # fmt: skip
    assert read_task(write_jsonl(tmp_path / "ai2.jsonl", [ai2])).items[0].gold == 1
    write_jsonl(tmp_path / "dev.jsonl", [{"goal": "g", "sol1": "a", "sol2": "b"}] * 2)
    (tmp_path / "dev-labels.lst").write_text("1\n0\n")
    assert [i.gold for i in read_task(tmp_path / "dev.jsonl").items] == [1, 0]


def test_bad_task_files_are_one_error_line_before_any_step(tmp_path):
    """A missing file, a malformed line, a gold index out of range: all named (file and line) in one
    `error:` line from the flag check, before any data or process group; pipeline and sequence
    parallel are refused."""
    good = {"context": "a b", "choices": ["c", "d"], "gold": 0}
    bad = write_jsonl(tmp_path / "bad.jsonl", [good])
    with open(bad, "a") as f:
        f.write('{"context": "x", "choices": ["c", "d"], "gold": 0\n')
    gold = write_jsonl(tmp_path / "gold.jsonl", [good, good, {**good, "gold": 2}])
    missing = tmp_path / "missing.jsonl"
    cmd = [
        sys.executable,
        "train_ddp.py",
        "--eval_tasks",
        f"builtin,{missing},{bad},{gold}",
        "--max_steps",
        "1",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("error:") == 1, proc.stderr[-2000:]
    assert f"{missing}: no such task file" in proc.stderr
    assert f"{bad}:2: invalid JSON" in proc.stderr
    assert f"{gold}:3: gold index 2 is out of range for 2 choices" in proc.stderr
    assert "step" not in proc.stdout
    flags = ["--eval_tasks", "builtin", "--pipeline_parallel_size", "2", "--sequence_parallel_size", "2"]
    with pytest.raises(ConfigError) as e:
        parse_args(build_parser("t", deepspeed=True), flags)
    assert "--pipeline_parallel_size 2" in str(e.value) and "--sequence_parallel_size 2" in str(e.value)
    with pytest.raises(DataSourceError, match=r"other.jsonl:1: not a task item of a known layout"):
        read_task(write_jsonl(tmp_path / "other.jsonl", [{"question_text": "?"}]))


def test_the_built_in_task_is_deterministic_and_its_choices_differ_only_in_order():
    docs = [" ".join(f"w{d}_{i}" for i in range(200)) for d in range(3)]
    items = builtin_items(docs, seed=5)
    assert items == builtin_items(docs, seed=5) and items != builtin_items(docs, seed=6)
    assert len(items) == 3 * len(range(24, 200 - 5 + 1, 16))
    for it in items:
        assert len(set(it["choices"])) == 4 and len({tuple(sorted(c.split())) for c in it["choices"]}) == 1
        assert it["context"].split()[-1].split("_")[1] == str(
            int(it["choices"][it["gold"]].split()[0].split("_")[1]) - 1
        )
    assert {it["gold"] for it in items} == {0, 1, 2, 3}


def test_the_standard_error_is_lm_evals():
    assert mean_stderr([1.0, 0.0, 1.0, 1.0]) == pytest.approx(0.25)  # sqrt(0.75 / 3) / sqrt(4)
    lm_eval_metrics = pytest.importorskip("lm_eval.api.metrics", reason="lm-eval is the `dev` extra's")
    values = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    assert mean_stderr(values) == pytest.approx(lm_eval_metrics.mean_stderr(values), rel=1e-12)


# --- the runs ---


@pytest.fixture(scope="module")
def setup(tmp_path_factory, shared_data):
    """Two sources cut from the built-in corpus, the task files, the flags every run shares."""
    folder = tmp_path_factory.mktemp("tasks")
    docs = [d for d, _ in zip(resolve_sources(["builtin"])[0].documents(), range(80))]
    a = write_jsonl(folder / "a.jsonl", [{"text": d[:600]} for d in docs[:40]])
    b = write_jsonl(folder / "b.jsonl", [{"text": d[:600]} for d in docs[40:]])
    files = published_tasks(folder, " ".join(docs[60:]).split())
    tasks = ",".join(["builtin", *(str(files[n]) for n in LAYOUT_TASKS)])
    common = (f"--data_path 0.5 {a} 0.5 {b} --data_split 80,20 --max_seq_len {SEQ} --max_steps {STEPS} "
              f"--eval_task_limit {LIMIT}").split()  # fmt: skip
    return {"files": files, "tasks": tasks, "common": common, "data": shared_data}


def run(tmp_path_factory, setup, name: str, kind: str, *extra: str, tasks: bool = True) -> Path:
    out = tmp_path_factory.mktemp(name)
    on = ["--eval_tasks", setup["tasks"], "--eval_interval", "10"] if tasks else ["--eval_interval", "0"]
    proc = launch(kind, [*setup["common"], *on, *extra], out, setup["data"])
    (out / "stdout.txt").write_text(proc.stdout)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, setup):
    return {
        "ddp": run(tmp_path_factory, setup, "ddp", "ddp", "--report_to", "csv"),
        "ddp_off": run(tmp_path_factory, setup, "ddp_off", "ddp", tasks=False),
        "zero2": run(
            tmp_path_factory, setup, "zero2", "deepspeed", "--deepspeed_config", "ds_configs/zero2.json"
        ),
        "zero3": run(
            tmp_path_factory, setup, "zero3", "deepspeed", "--deepspeed_config", "ds_configs/zero3.json"
        ),
        "fsdp2": run(tmp_path_factory, setup, "fsdp2", "ddp", "--fsdp"),
        # tensor parallel over both ranks (one replica): one step, compared at step 0
        "tp2": run(
            tmp_path_factory,
            setup,
            "tp2",
            "deepspeed",
            "--deepspeed_config",
            "ds_configs/tp2_zero1.json",
            "--max_steps",
            "1",
            "--no_export",
        ),  # fmt: skip
    }


def evals(out: Path) -> list[dict]:
    return [r for r in read_metrics(out) if r["event"] == "eval"]


def samples(out: Path, step: int) -> list[dict]:
    return [json.loads(line) for line in open(out / "eval_tasks" / f"step_{step}.jsonl")]


def test_evaluation_leaves_the_training_curve_bit_identical(runs):
    """DDP with --eval_tasks, evaluated at steps 0, 10, 20 and DDP without, evaluated at the end only:
    the same loss and gradient norm at every step, exactly."""
    on, off = ([r for r in read_metrics(runs[k]) if r["event"] == "train"] for k in ("ddp", "ddp_off"))
    assert len(on) == len(off) == STEPS
    assert [(r["loss"], r["grad_norm"]) for r in on] == [(r["loss"], r["grad_norm"]) for r in off]
    assert [r["step"] for r in evals(runs["ddp"])] == [0, 10, 20] and [
        r["step"] for r in evals(runs["ddp_off"])
    ] == [20]


@pytest.mark.parametrize("other", ["zero2", "zero3", "fsdp2"])
def test_every_strategy_scores_the_same(runs, other):
    """Per-item log-likelihoods within 1e-5 (relative) of DDP's, the same predictions and scores, at
    every evaluation; each source's eval loss and bpb too."""
    for step in (0, 10, 20):
        ours, theirs = samples(runs["ddp"], step), samples(runs[other], step)
        assert [(s["task"], s["item"]) for s in ours] == [(s["task"], s["item"]) for s in theirs]
        worst = max(abs(x - y) / abs(y) for s, t in zip(ours, theirs) for x, y in zip(s["lls"], t["lls"]))
        assert worst <= 1e-5, (step, worst)
        keys = ("pred", "acc", "acc_norm", "acc_bytes", "greedy")
        assert [[s.get(k) for k in keys] for s in ours] == [[t.get(k) for k in keys] for t in theirs]
    for mine, yours in zip(evals(runs["ddp"]), evals(runs[other])):
        for task, scores in mine["tasks"].items():
            same = ("n", "acc", "acc_norm", "stderr")
            assert [scores.get(k) for k in same] == [yours["tasks"][task].get(k) for k in same], (
                task,
                mine["step"],
            )
        assert mine["sources"].keys() == yours["sources"].keys() and len(mine["sources"]) == 2
        for name, s in mine["sources"].items():
            for k in ("eval_loss", "eval_bpb"):
                assert s[k] == pytest.approx(yours["sources"][name][k], rel=1e-5), (mine["step"], name, k)


def test_tensor_parallel_scores_as_ddp_does(runs):
    """AutoTP over 2 ranks (each holds half the heads and MLP units, the logits gathered) from the same
    initial weights: DDP's per-item log-likelihoods within the TP parity tolerance, the same predictions."""
    ours, theirs = samples(runs["ddp"], 0), samples(runs["tp2"], 0)
    assert [(s["task"], s["item"]) for s in ours] == [(s["task"], s["item"]) for s in theirs]
    worst = max(abs(x - y) / abs(y) for s, t in zip(ours, theirs) for x, y in zip(s["lls"], t["lls"]))
    assert worst <= 1e-5 and [s.get("pred") for s in ours] == [t.get("pred") for t in theirs], worst


def test_the_scores_reach_the_record_the_line_the_csv_and_the_summary(runs):
    out = runs["ddp"]
    first, last = evals(out)[0], evals(out)[-1]
    assert set(last["tasks"]) == {"builtin", *LAYOUT_TASKS}
    builtin = last["tasks"]["builtin"]
    assert {"acc", "acc_norm", "n", "stderr"} <= set(builtin) and 30 <= builtin["n"] <= LIMIT
    assert "ppl" in last["tasks"]["lambada"] and "acc_norm" not in last["tasks"]["lambada"]
    assert last["tasks"]["arc"]["n"] == 6 and 0 < last["tasks_seconds"] < last["seconds"]
    # the built-in task rises with training, by more than twice its standard error
    assert builtin["acc"] > first["tasks"]["builtin"]["acc"] + 2 * builtin["stderr"]
    stdout = (out / "stdout.txt").read_text()
    assert "eval tasks: builtin " in stdout and "arc 6 items (4 choices, arc layout)" in stdout
    assert f"builtin acc {builtin['acc']:.3f}" in stdout and "by source: " in stdout
    header = (out / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "eval/tasks/builtin/acc" in header and any(h.startswith("eval/sources/") for h in header)
    cmd = [sys.executable, "scripts/summarize_run.py", str(out), "--goodput"]
    summary = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300).stdout
    assert (
        f"builtin acc {first['tasks']['builtin']['acc']:.3f} (step 0) -> {builtin['acc']:.3f} (step {STEPS})"
        in summary
    )
    assert "eval_tasks" in summary and "eval by source" in summary


def test_a_choice_longer_than_the_window_is_refused_and_a_long_context_left_truncated(runs, setup):
    tok = load_tokenizer(runs["ddp"] / "tokenizer")
    # lm-eval's rule: a context's trailing space belongs to the continuation
    assert encode_pair(tok, "the value of x ", "is returned") == encode_pair(
        tok, "the value of x", " is returned"
    )
    assert model_input(list(range(100)), [7, 8], SEQ) == [*range(100 - SEQ + 1, 100), 7]  # lm-eval's cut
    long = read_task(write_jsonl(setup["files"]["arc"].parent / "long.jsonl", [
        {"context": "a b", "choices": ["word " * 80, "x"], "gold": 0}]))  # fmt: skip
    with pytest.raises(
        ConfigError, match=r"long.jsonl:1: choice 0 is \d+ tokens, more than --max_seq_len 64"
    ):
        task_requests(0, long, tok, SEQ, -1)


# --- the outside oracle: lm-evaluation-harness on the export ---

OURS_YAML = """task: llt_builtin
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""
# lm-eval's own definition of each published task, pointed at our file (its dataset lines replaced)
LM_EVAL_YAMLS = {"arc": "arc/arc_easy.yaml", "hellaswag": "hellaswag/hellaswag.yaml", "piqa": "piqa/piqa.yaml",
                 "lambada": "lambada/lambada_openai.yaml"}  # fmt: skip
DATASET_KEYS = (
    "tag:",
    "task:",
    "dataset_path:",
    "dataset_name:",
    "training_split:",
    "validation_split:",
    "test_split:",
)


def without_keys(lines: list[str], keys: tuple[str, ...]) -> list[str]:
    """A task YAML's lines less the top-level `keys` (with their indented continuation lines)."""
    out, dropping = [], False
    for line in lines:
        if not line.startswith(" "):
            dropping = line.startswith(keys)
        if not dropping:
            out.append(line)
    return out


def lm_eval_task_dir(folder: Path, files: dict[str, Path], builtin: str) -> Path:
    import lm_eval

    tasks_root = Path(lm_eval.__file__).parent / "tasks"
    folder.mkdir()
    (folder / "llt_builtin.yaml").write_text(OURS_YAML.format(path=builtin))
    for name, rel in LM_EVAL_YAMLS.items():
        kept = without_keys((tasks_root / rel).read_text().splitlines(), DATASET_KEYS)
        head = [f"task: llt_{name}", "dataset_path: json", "dataset_kwargs:", "  data_files:",
                f"    test: {files[name]}", "test_split: test"]  # fmt: skip
        (folder / f"llt_{name}.yaml").write_text("\n".join(head + kept) + "\n")
    (folder / "utils.py").write_text((tasks_root / "hellaswag" / "utils.py").read_text())  # its process_docs
    return folder


def test_lm_evaluation_harness_agrees_on_the_export(runs, setup, tmp_path):
    pytest.importorskip(
        "lm_eval", reason="lm-evaluation-harness is the `dev` extra's (make test installs it)"
    )
    builtin = builtin_task("80,20", 1234, setup["data"], -1).source  # the file the run scored (cached)
    include = lm_eval_task_dir(tmp_path / "tasks", setup["files"], builtin)
    names = ["builtin", *LAYOUT_TASKS]
    cmd = [str(Path(sys.executable).parent / "lm_eval"), "--model", "hf", "--model_args",
           f"pretrained={runs['ddp'] / 'hf'},dtype=float32", "--tasks", ",".join(f"llt_{n}" for n in names),
           "--include_path", str(include), "--limit", str(LIMIT), "--log_samples", "--output_path",
           str(tmp_path / "out"), "--device", "cpu", "--batch_size", "8"]  # fmt: skip
    offline = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "hf")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env(2) | offline, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = {}
    for s in samples(runs["ddp"], STEPS):
        ours.setdefault(s["task"], {})[s["item"]] = s
    for name in names:
        (path,) = (tmp_path / "out").glob(f"*/samples_llt_{name}_*.jsonl")
        theirs = {r["doc_id"]: r for r in map(json.loads, path.read_text().splitlines())}
        assert set(ours[name]) <= set(theirs) and len(ours[name]) >= 6
        for item, mine in ours[name].items():
            lls = [float(resp[0]) for resp in theirs[item]["filtered_resps"]]
            assert lls == pytest.approx(mine["lls"], rel=1e-4, abs=1e-4), (name, item)
            assert theirs[item]["acc"] == mine["acc"] and theirs[item].get("acc_norm", 0) == mine.get(
                "acc_norm", 0
            )
    assert "Truncating" in proc.stderr  # the long ARC question was cut, as ours was (the same lls)
