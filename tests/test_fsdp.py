"""FSDP2 in the torch-native trainer (`torchrun train_ddp.py --fsdp`, llama_train/distributed/fsdp.py): the same
per-step losses as DDP and ZeRO-3 (fp32, 2 ranks, accumulation 2), an exact resume, a move in from a
ZeRO-3 checkpoint, checkpoints in the DDP trainer's own format, and the flags it cannot honour.

Three straight 20-step runs (DDP, ZeRO-3, FSDP2; checkpoints at 10 and 20) are shared by every test;
two more launches continue FSDP2 from step 10 (its own checkpoint, and ZeRO-3's).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from llama_train.config import build_parser, parse_args
from llama_train.errors import ConfigError
from llama_train.model import preset
from llama_train.plan.memory import expected_model_state_bytes, fsdp_units
from tests.trainer_utils import ROOT, assert_close_curves, env, launch, read_metrics, small_corpus

pytestmark = pytest.mark.usefixtures("deepspeed_ops")  # tests/conftest.py

STEPS, SAVED = 20, 10
RTOL = 1e-5  # the bar; fp32, the same gradients summed in another order
DUMP = "LLAMA_TRAIN_DUMP_STATE"  # the trainers write the engine's gathered state at saves and resumes
KINDS = {"ddp": ("ddp", []), "zero3": ("deepspeed", ["--deepspeed_config", "ds_configs/zero3.json"]),
         "fsdp2": ("ddp", ["--fsdp"])}  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """An epoch is a few optimizer steps, so the runs cross epoch boundaries (a new shuffle) before and
    after the resume."""
    return small_corpus(tmp_path_factory.mktemp("corpus"))


def flags(corpus, *extra: str) -> list[str]:
    common = f"--data_path {corpus} --data_split 90,10 --accumulation_steps 2 --max_steps {STEPS}"
    return [*common.split(), *" ".join(extra).split()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
    """name -> output_dir of its straight run: 2 ranks, 20 steps, checkpoints at 10 and 20, the
    engine state dumped at each save."""
    data, out = tmp_path_factory.mktemp("data"), {}
    for name, (launcher, extra) in KINDS.items():
        out[name] = tmp_path_factory.mktemp(name)
        env_extra = {DUMP: str(out[name] / "dumps")}
        launch(
            launcher,
            [*flags(corpus, f"--save_interval {SAVED}"), *extra],
            out[name],
            data,
            extra_env=env_extra,
        )
    out["data"] = data
    return out


def train(out, key: str = "loss") -> list:
    return [r[key] for r in read_metrics(out) if r["event"] == "train"]


def checkpoint(out, step: int) -> Path:
    return Path(out) / "checkpoints" / f"step_{step:08d}"


def test_fsdp2_ddp_and_zero3_compute_the_same_losses(runs):
    assert len(train(runs["fsdp2"])) == STEPS
    for name in ("fsdp2", "zero3"):
        assert_close_curves(train(runs[name]), train(runs["ddp"]), rtol=RTOL)
        assert_close_curves(train(runs[name], "grad_norm"), train(runs["ddp"], "grad_norm"), rtol=RTOL)
        assert train(runs[name], "lr") == pytest.approx(train(runs["ddp"], "lr"), rel=1e-12)
    config = next(r for r in read_metrics(runs["fsdp2"]) if r["event"] == "config")
    assert config["strategy"] == "fsdp2" and config["args"]["fsdp"]


def test_fsdp2_shards_model_state_and_accumulates_without_communicating(runs):
    """16 Psi / N of model state on each rank, as ZeRO-3; per step (2 micro-batches) every block is
    gathered for each forward and backward, the root once per micro-batch, and the gradients are
    reduce-scattered once: the first micro-batch's backward reduces nothing (DDP's no_sync)."""
    records = read_metrics(runs["fsdp2"])
    (memory,) = [r for r in records if r["event"] == "memory"]
    P = memory["num_params"]
    assert memory["zero_stage"] == 3
    assert memory["model_state_bytes"] == [expected_model_state_bytes(3, P, 2, "float32") + 84] * 2  # + steps
    root, _ = fsdp_units(preset("debug", max_seq_len=32))
    comm = [r for r in records if r["event"] == "comm"][-1]
    for rank in range(2):
        assert comm["bytes_by_op"][rank] == {"all_gather": 2 * (2 * P - root) * 4, "reduce_scatter": 4 * P}
        assert comm["calls_by_op"][rank] == {"all_gather": 2 * (1 + 2 * 2), "reduce_scatter": 1 + 2}
    assert comm["expected_bytes"] == 3 * 4 * P  # the paper's 3 Psi, as ZeRO-3


def test_fsdp2_writes_the_ddp_trainers_checkpoint_and_export(runs):
    """The same files, keys, shapes and optimizer indices as a DDP checkpoint of the same run, and the
    same values (to float summation order): either trainer loads the other's natively. The final
    export holds the same weights as DDP's."""
    ddp, fsdp = checkpoint(runs["ddp"], SAVED), checkpoint(runs["fsdp2"], SAVED)
    names = sorted(p.name for p in ddp.iterdir())
    assert sorted(p.name for p in fsdp.iterdir()) == names
    for name in ("model.pt", "optimizer.pt"):
        a, b = (torch.load(d / name, weights_only=True) for d in (ddp, fsdp))
        if name == "optimizer.pt":
            assert [g["params"] for g in a["param_groups"]] == [g["params"] for g in b["param_groups"]]
            a, b = a["state"], b["state"]
        assert a.keys() == b.keys()
        for key in a:
            x, y = (v if isinstance(v, dict) else {"weight": v} for v in (a[key], b[key]))
            assert x.keys() == y.keys(), (name, key)
            for part in x:
                same = x[part].shape == y[part].shape and torch.allclose(
                    x[part], y[part], rtol=1e-4, atol=1e-6
                )
                assert same, (name, key, part)
    state = json.loads((fsdp / "trainer_state.json").read_text())
    assert state["layout"] == {"strategy": "fsdp2", "world_size": 2, "dtype": "float32"}
    ddp, fsdp = (load_file(runs[name] / "hf" / "model.safetensors") for name in ("ddp", "fsdp2"))
    assert ddp.keys() == fsdp.keys()  # the final export: the full weights, gathered on rank 0
    assert all(torch.allclose(ddp[k], fsdp[k], rtol=1e-4, atol=1e-6) for k in ddp)


def test_fsdp2_resumes_bitwise(tmp_path, corpus, runs):
    proc = launch(
        "ddp",
        [*flags(corpus, f"--resume {checkpoint(runs['fsdp2'], SAVED)}"), "--fsdp"],
        tmp_path,
        runs["data"],
    )
    assert "(as saved)" in proc.stdout + proc.stderr
    for key in ("loss", "grad_norm", "lr"):
        assert train(tmp_path, key) == train(runs["fsdp2"], key)[SAVED:]


def test_a_zero3_checkpoint_moves_into_fsdp2(tmp_path, corpus, runs):
    """Through the neutral form: the curve continues within RTOL, and the sharded engine holds exactly
    the fp32 weights and AdamW moments ZeRO-3 saved (gathered both sides)."""
    source = checkpoint(runs["zero3"], SAVED)
    extra = [*flags(corpus, f"--resume {source}"), "--fsdp"]
    proc = launch("ddp", extra, tmp_path, runs["data"], extra_env={DUMP: str(tmp_path / "dumps")})
    assert (
        "deepspeed-zero3 x2 ranks (float32) -> fsdp2 x2 ranks (float32), converted"
        in proc.stdout + proc.stderr
    )
    assert_close_curves(train(tmp_path), train(runs["zero3"])[SAVED:], rtol=RTOL)
    before, after = (
        torch.load(d / f"{label}_{SAVED}.pt", weights_only=True)
        for d, label in ((runs["zero3"] / "dumps", "saved"), (tmp_path / "dumps", "resumed"))
    )
    assert before.keys() == after.keys() and len(before) == 21
    for name, tensors in before.items():
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            assert torch.equal(after[name][key], tensors[key]), (name, key)


def test_fsdp_flags_it_cannot_honour_are_refused_at_once(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError) as e:
        parse_args(build_parser("t"), ["--fsdp", "--find_unused_parameters"])
    assert "--find_unused_parameters is DDP's and has no meaning under --fsdp" in str(e.value)
    assert "--fsdp shards over a process group: start with `torchrun" in str(e.value)
    with pytest.raises(ConfigError, match="--fsdp_offload needs --fsdp"):
        parse_args(build_parser("t"), ["--fsdp_offload"])
    ds = build_parser("t", deepspeed=True)  # the DeepSpeed trainer has no --fsdp; model parallel is its own
    assert not any("--fsdp" in a.option_strings for a in ds._actions)
    with pytest.raises(SystemExit):  # argparse: "error: unrecognized arguments"
        build_parser("t").parse_args(["--fsdp", "--sequence_parallel_size", "2"])


def test_fsdp_offload_on_gpus_creates_the_process_group_with_a_cpu_backend(monkeypatch):
    """With --fsdp_offload the gradients and the optimizer step live on the host: clipping's norm and
    fp16's found_inf all-reduce CPU DTensors, which an NCCL-only group cannot (pytorch#148532). A CUDA
    run asks for "cpu:gloo,cuda:nccl" then (checked here on CPU: the backend string the DDP trainer's
    set-up asks for when torch sees GPUs)."""
    import torch.distributed.distributed_c10d as c10d

    import llama_train.distributed.dist as d

    for name in ("default_pg_timeout", "default_pg_nccl_timeout"):  # set-up sets them: put them back
        monkeypatch.setattr(c10d, name, getattr(c10d, name))
    asked = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(d, "check_cuda_usable", lambda: None)
    monkeypatch.setattr(d.dist, "init_process_group", lambda backend, **kw: asked.append(backend))
    monkeypatch.setattr(d.dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(d.dist, "get_world_size", lambda group=None: 2)
    for flags, backend in (("--fsdp --fsdp_offload", "cpu:gloo,cuda:nccl"), ("--fsdp", "nccl"), ("", "nccl")):
        asked.clear()
        d.setup_ddp(parse_args(build_parser("t"), flags.split()))
        assert asked == [backend], flags


def test_fsdp_bad_input_is_one_error_line(tmp_path):
    cmd = [
        sys.executable,
        "train_ddp.py",
        "--fsdp",
        "--find_unused_parameters",
        "--output_dir",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert [line for line in proc.stderr.splitlines() if "error" in line.lower()] == [
        "error: invalid arguments:"
    ], proc.stderr
    assert "--find_unused_parameters is DDP's" in proc.stderr and not (tmp_path / "metrics.jsonl").exists()
