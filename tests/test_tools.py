"""Every tool behaves like the trainers (issue 17): a nonexistent path given to any script, a
ds_config that DeepSpeed itself rejects, a hub source on an offline machine: exit 2, one line that
names the culprit, no traceback, and (for the trainers) before any tokenizer or data-cache work.

All commands run in one module fixture, two at a time (each is mostly Python start-up)."""

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.trainer_utils import BASE_FLAGS, ROOT, env

pytestmark = pytest.mark.usefixtures("deepspeed_ops")  # tests/conftest.py

MISSING = "/nonexistent/llama-train-test"
# script -> its arguments, one of them a path that does not exist
SCRIPTS = {
    "bench_checkpoint.py": ["--checkpoint", MISSING],
    "bench_cluster.py": ["--from_results", MISSING],
    "bench_data.py": ["--tokenizer", MISSING],
    "benchmark.py": ["--strategies", f"mine={MISSING}.json"],
    "check_hostfile.py": [MISSING],
    "eval_ppl.py": ["--model", MISSING],
    "eval_tasks.py": ["--model", MISSING, "--tasks", "builtin"],
    "export_hf.py": ["--checkpoint", MISSING, "--output_dir", "{tmp}/export"],
    "generate.py": ["--model", MISSING],
    "plan_memory.py": ["--calibration", MISSING],
    "summarize_run.py": [MISSING],
    "train_tokenizer.py": ["--data_path", f"{MISSING}.jsonl", "--output_dir", "{tmp}/tok"],
}
# scripts that read no input path: every path they take is an output they create
NO_INPUT_PATH = {
    "bench_cpu_dtype.py",
    "bench_gpu.py",
    "bench_ledger.py",
    "bench_optim.py",
    "bench_overhead.py",
    "plan_published.py",
}
OPTIMIZER = {"optimizer": {"type": "auto"}}  # else the missing optimizer block is the first error
BAD_DS_CONFIGS = {
    "stage": (
        {**OPTIMIZER, "zero_optimization": {"stage": 5}},
        '"zero_optimization.stage" = 5',
        "allowed: 0, 1, 2, 3",
    ),
    "offload_device": (
        {**OPTIMIZER, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "gpu"}}},
        "\"zero_optimization.offload_optimizer.device\" = 'gpu'",
        "allowed: 'none', 'cpu', 'nvme'",
    ),
}


def trainer(script: str, tmp, *flags) -> list[str]:
    paths = ["--data_output_path", f"{tmp}/data", "--output_dir", f"{tmp}/out"]
    return [sys.executable, script, *BASE_FLAGS, *paths, *flags]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tools")
    cmds = {
        name: [sys.executable, f"scripts/{name}", *(a.format(tmp=tmp / name) for a in args)]
        for name, args in SCRIPTS.items()
    }
    for case, (config, _, _) in BAD_DS_CONFIGS.items():
        (tmp / f"{case}.json").write_text(json.dumps(config))
        cmds[f"ds_{case}"] = trainer(
            "train_deepspeed.py", tmp / case, "--deepspeed_config", str(tmp / f"{case}.json")
        )
    cmds["hf_offline"] = trainer("train_ddp.py", tmp / "hf", "--data_path", "hf:someone/corpus")
    run_env = {**env(), "HF_HUB_OFFLINE": "1"}

    def run(cmd):
        return subprocess.run(cmd, cwd=ROOT, env=run_env, capture_output=True, text=True, timeout=300)

    with ThreadPoolExecutor(2) as pool:
        procs = dict(zip(cmds, pool.map(run, cmds.values())))
    return tmp, procs


def one_error_line(proc) -> str:
    """The one line a user error prints (exit 2, no traceback); library log lines aside."""
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("[20")]
    assert len(lines) == 1, lines  # "[2026-...] [WARNING] ..." are DeepSpeed's logger lines
    return lines[0]


def test_every_script_is_covered():
    scripts = {p.name for p in (ROOT / "scripts").glob("*.py")}
    assert scripts == set(SCRIPTS) | NO_INPUT_PATH


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_a_nonexistent_path_is_one_line_and_exit_2(results, script):
    line = one_error_line(results[1][script])
    assert MISSING in line, line


@pytest.mark.parametrize("case", sorted(BAD_DS_CONFIGS))
def test_a_ds_config_deepspeed_rejects_is_one_line_before_any_work(results, case):
    tmp, procs = results
    line = one_error_line(procs[f"ds_{case}"])
    _, key, allowed = BAD_DS_CONFIGS[case]
    assert line.startswith(f"error: {tmp}/{case}.json: {key} is rejected by DeepSpeed"), line
    assert allowed in line, line
    assert not (tmp / case / "data").exists()  # no tokenizer was trained, no cache built


def test_a_hub_source_offline_is_one_line(results):
    line = one_error_line(results[1]["hf_offline"])
    assert line.startswith("error: hf:someone/corpus: "), (
        line
    )  # without `datasets`, or offline: both say what to do
