"""Bad input fails before the run starts: exit 2, one message naming the culprit, no traceback."""

import json
import subprocess
import sys

import pytest

from tests.trainer_utils import BASE_FLAGS, ROOT, env

pytestmark = pytest.mark.usefixtures("deepspeed_ops")  # tests/conftest.py


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("errors")
    text = "The quick brown fox jumps over the lazy dog. " * 40
    (d / "good.jsonl").write_text("".join(json.dumps({"text": f"{i} {text}"}) + "\n" for i in range(60)))
    return d


def fail(script: str, *flags, tmp_path) -> str:
    paths = ["--data_output_path", str(tmp_path / "data"), "--output_dir", str(tmp_path / "out")]
    cmd = [sys.executable, script, *BASE_FLAGS, *paths, *flags]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc.stderr


def test_missing_data_path(tmp_path):
    err = fail("train_ddp.py", "--data_path", "/nonexistent/corpus.jsonl", tmp_path=tmp_path)
    assert "/nonexistent/corpus.jsonl" in err


def test_empty_corpus(tmp_path):
    (tmp_path / "empty.txt").write_text("\n\n")
    err = fail("train_ddp.py", "--data_path", str(tmp_path / "empty.txt"), tmp_path=tmp_path)
    assert "empty.txt" in err and "no documents" in err


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": "broken\n')
    err = fail("train_ddp.py", "--data_path", str(tmp_path / "bad.jsonl"), tmp_path=tmp_path)
    assert "bad.jsonl:2" in err


def test_tokenizer_larger_than_embedding(tmp_path, corpus):
    tok = tmp_path / "tok"
    data = str(corpus / "good.jsonl")
    train_tokenizer = [
        sys.executable,
        "scripts/train_tokenizer.py",
        "--data_path",
        data,
        "--vocab_size",
        "300",
    ]
    subprocess.run([*train_tokenizer, "--output_dir", str(tok)], cwd=ROOT, check=True, capture_output=True)
    err = fail(
        "train_ddp.py", "--tokenizer", str(tok), "--vocab_size", "260", "--data_path", data, tmp_path=tmp_path
    )
    assert "300 tokens" in err and "--vocab_size" in err


def test_max_seq_len_above_preset(tmp_path):
    err = fail("train_ddp.py", "--max_seq_len", "4096", tmp_path=tmp_path)
    assert "--max_seq_len 4096 is above the 'debug' preset's 256" in err


def test_invalid_ds_config_json(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "zero_optimization": {"stage": 2,\n}\n')
    err = fail("train_deepspeed.py", "--deepspeed_config", str(bad), tmp_path=tmp_path)
    assert f"{bad}:3" in err and "invalid JSON" in err


def test_unknown_ds_config(tmp_path):
    err = fail("train_deepspeed.py", "--deepspeed_config", "ds_configs/zero7.json", tmp_path=tmp_path)
    assert "'ds_configs/zero7.json' not found" in err


def test_ds_config_contradicting_a_flag(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"gradient_accumulation_steps": 8, "zero_optimization": {"stage": 1}}))
    err = fail(
        "train_deepspeed.py", "--deepspeed_config", str(cfg), "--accumulation_steps", "2", tmp_path=tmp_path
    )
    assert '"gradient_accumulation_steps" is 8' in err and "command line gives 2" in err


def test_global_batch_that_does_not_divide(tmp_path):
    err = fail("train_ddp.py", "--global_batch_size", "10", tmp_path=tmp_path)  # micro batch 4, 1 rank
    assert "--global_batch_size 10 is not divisible by --batch_size 4" in err


def test_zero_stage_without_the_feature(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}))
    err = fail("train_deepspeed.py", "--deepspeed_config", str(cfg), tmp_path=tmp_path)
    assert "offload_param needs ZeRO stage 3" in err


def test_distributed_flag_without_launcher(tmp_path):
    err = fail("train_ddp.py", "--local_rank", "1", tmp_path=tmp_path)
    assert "--local_rank 1 given but no launcher environment" in err and "torchrun" in err


def test_stale_build_lock_is_named(tmp_path, monkeypatch, capsys):
    """An interrupted JIT build's lock makes DeepSpeed wait forever: the trainer names it first."""
    import os
    import time

    from llama_train.distributed.ds_compat import warn_stale_build_locks

    old, fresh = tmp_path / "py311_cpu" / "cpu_adam" / "lock", tmp_path / "py311_cpu" / "shm" / "lock"
    for lock in (old, fresh):
        lock.parent.mkdir(parents=True)
        lock.touch()
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert warn_stale_build_locks() == [str(old)]  # a fresh lock may be a build in progress
    assert f"rm {old}" in capsys.readouterr().err
