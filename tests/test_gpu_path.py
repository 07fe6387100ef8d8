"""The GPU path's decisions, tested here without a GPU (issue: the GPU path): each is a pure function
of device facts (names, compute capability, nvidia-smi's list, the environment) or runs on CPU the
same code the GPU runs (the step guards, the fp16 skip, checkpoint verification over 2 gloo ranks).
What only a GPU can show is in tests marked `cuda` (skipped here) and in docs/gpu.md "GPU status"."""

import hashlib
import json
import math
import os
import subprocess

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from llama_train.checkpoint import store as ckpt
from llama_train.config import build_parser, parse_args
from llama_train.distributed.dist import choose_dtype
from llama_train.distributed.ds_config import fill_precision, precision_defaults
from llama_train.errors import ConfigError
from llama_train.gpu import (
    cpu_adam_build_problems,
    cuda_unusable,
    deepspeed_devices,
    default_world_sizes,
    inference_device,
    visible_gpu_count,
)
from llama_train.model import PRESETS, Transformer, precompute_pos_cis
from llama_train.telemetry.metrics import UNKNOWN_PEAK, gpu_peak_flops
from llama_train.train.guards import SCALER, NonFiniteGuard, Stopper
from tests.trainer_utils import ROOT, env, free_port

SMI = [
    "GPU 0: NVIDIA H200 (UUID: GPU-6e3c0f2a-0000-0000-0000-000000000000)",
    "GPU 1: NVIDIA H200 (UUID: GPU-7f4d1a3b-0000-0000-0000-000000000001)",
]
CUDA_BUILD = "torch 2.13.0 built for CUDA 13.0"


# --- 1. setup: GPUs visible but unusable ---


def test_visible_but_unusable_gpus_are_refused_unless_hidden_on_purpose():
    why = "The NVIDIA driver on your system is too old (found version 12020)"
    msg = cuda_unusable(SMI, None, cuda_available=False, torch_build=CUDA_BUILD, why=why)
    assert "2 NVIDIA GPU(s) visible (GPU 0: NVIDIA H200" in msg and CUDA_BUILD in msg and why in msg
    assert "CUDA_VISIBLE_DEVICES=" in msg and "make setup" in msg
    cpu_only = cuda_unusable(SMI, "0", False, "torch 2.13.0+cpu (a CPU-only build)")
    assert "a CPU-only build" in cpu_only
    assert cuda_unusable(SMI, None, cuda_available=True, torch_build=CUDA_BUILD) is None
    assert cuda_unusable([], None, cuda_available=False, torch_build=CUDA_BUILD) is None  # a CPU machine
    for hidden in ("", "-1"):
        assert cuda_unusable(SMI, hidden, cuda_available=False, torch_build=CUDA_BUILD) is None


# --- 2. bf16: fp32 gradient accumulation and reduction under DeepSpeed ---


def test_bf16_configs_accumulate_and_reduce_in_fp32_and_zero0_says_it_cannot():
    assert precision_defaults(2, "bfloat16") == {
        "communication_data_type": "fp32",
        "data_types.grad_accum_dtype": "fp32",
    }
    assert precision_defaults(0, "bfloat16")["data_types.grad_accum_dtype"] == "bf16"  # DeepSpeed's limit
    assert precision_defaults(2, "float32") == precision_defaults(2, "float16") == {}
    config = {"zero_optimization": {"stage": 3}}
    assert fill_precision(config, "bfloat16", accumulation=32) is None
    assert config["communication_data_type"] == "fp32" and config["data_types"]["grad_accum_dtype"] == "fp32"
    mine = {"zero_optimization": {"stage": 1}, "communication_data_type": "bf16"}  # the user's choice stays
    fill_precision(mine, "bfloat16", accumulation=1)
    assert mine["communication_data_type"] == "bf16" and mine["data_types"]["grad_accum_dtype"] == "fp32"
    zero0 = {"zero_optimization": {"stage": 0}}
    assert "accumulates the 32 micro-batches' gradients in bf16" in fill_precision(zero0, "bfloat16", 32)
    assert fill_precision({"zero_optimization": {"stage": 0}}, "bfloat16", 1) is None


# --- 3. CUDA_VISIBLE_DEVICES survives the deepspeed launcher; 11. the benchmark's default ---


def test_gpu_check_says_what_training_will_run_on():
    from llama_train.gpu import usable_summary

    build = "torch 2.13.0 built for CUDA 12.6"
    assert usable_summary("torch 2.13.0 (a CPU-only build)", []).startswith(
        "no NVIDIA GPU visible to torch 2.13.0"
    )
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in usable_summary(
        build, []
    )  # CUDA wheel, no GPU
    two = usable_summary(build, [("NVIDIA H100 80GB HBM3", (9, 0))] * 2)
    assert two.startswith(f"2 GPU(s) usable by {build}, NCCL, bf16 under --dtype auto: 0: NVIDIA H100")
    assert "fp16 with loss scaling" in usable_summary(build, [("Tesla V100-SXM2-16GB", (7, 0))])


def test_cuda_visible_devices_becomes_include_for_the_deepspeed_launcher():
    assert deepspeed_devices(2, None, SMI) == (["--num_gpus", "2"], {})
    assert deepspeed_devices(None, None, SMI) == (["--num_gpus", "2"], {})
    assert deepspeed_devices(2, "4,5,6", SMI) == (["--include", "localhost:4,5"], {})
    assert deepspeed_devices(None, "1", SMI) == (["--include", "localhost:1"], {})
    uuid = SMI[1].split("UUID: ")[1].rstrip(")")
    ordered = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}  # nvidia-smi's indices are in PCI order, CUDA's need not be
    assert deepspeed_devices(1, uuid, SMI) == (["--include", "localhost:1"], ordered)
    assert deepspeed_devices(2, "", SMI) == (["--num_gpus", "2"], {"DS_ACCELERATOR": "cpu"})  # CPU on purpose
    assert deepspeed_devices(2, "0,1", []) == (["--num_gpus", "2"], {})  # no GPUs: nothing to honour
    with pytest.raises(ConfigError, match="names 1 GPU"):
        deepspeed_devices(2, "3", SMI)
    with pytest.raises(ConfigError, match="not MIG devices"):
        deepspeed_devices(1, "MIG-1234", SMI)
    assert visible_gpu_count(SMI, None) == 2 and visible_gpu_count(SMI, "1") == 1
    assert visible_gpu_count(SMI, "") == 0 and visible_gpu_count([], "0") == 0


def test_benchmark_and_tests_follow_the_machine():
    assert default_world_sizes(gpu_count=1, cpu_count=16) == [1]  # a 1-GPU box: not 2 ranks
    assert default_world_sizes(gpu_count=8, cpu_count=96) == [8]
    assert default_world_sizes(gpu_count=0, cpu_count=2) == [2] and default_world_sizes(0, 1) == [1]
    e = env()  # what the CPU-path tests launch trainers with
    assert e["CUDA_VISIBLE_DEVICES"] == "" and e["DS_ACCELERATOR"] == "cpu"


# --- 4. MFU peaks ---


def test_mfu_peaks_match_exact_names_use_true_fp32_and_can_be_overridden():
    cases = {
        "NVIDIA L40": (181e12, "L40"),
        "NVIDIA L4": (121e12, "L4"),
        "NVIDIA H100 NVL": (835e12, "H100 NVL"),
        "NVIDIA H200 NVL": (835e12, "H200 NVL"),
        "NVIDIA H100 80GB HBM3": (989e12, "H100 80GB HBM3"),
        "NVIDIA H800": (989e12, "H800"),
        "NVIDIA H20": (148e12, "H20"),
        "NVIDIA B200": (2250e12, "B200"),
        "NVIDIA GeForce RTX 5090": (209.5e12, "GeForce RTX 5090"),
        "NVIDIA RTX A6000": (154.8e12, "RTX A6000"),
        "Tesla V100-SXM2-16GB": (125e12, "V100-SXM2-16GB"),
    }
    for name, (peak, key) in cases.items():
        assert gpu_peak_flops(name, "bfloat16") == (peak, f"table:{key}:bfloat16"), name
    assert gpu_peak_flops("NVIDIA H200", "float32")[0] == 67e12  # plain fp32: TF32 stays off
    nan, why = gpu_peak_flops("NVIDIA Quadro P1000", "bfloat16")
    assert math.isnan(nan) and UNKNOWN_PEAK in why and "LLAMA_TRAIN_PEAK_TFLOPS" in why
    assert gpu_peak_flops("NVIDIA Quadro P1000", "bfloat16", override="20") == (
        20e12,
        "LLAMA_TRAIN_PEAK_TFLOPS=20",
    )


# --- 5. --dtype auto by compute capability ---


def test_auto_dtype_needs_compute_capability_8_for_bf16():
    assert choose_dtype("auto", "cuda", (9, 0)) == "bfloat16"  # H100/H200
    assert choose_dtype("auto", "cuda", (8, 0)) == "bfloat16"  # A100
    assert choose_dtype("auto", "cuda", (7, 0)) == "float16"  # V100: bf16 only emulated
    assert choose_dtype("auto", "cuda", (7, 5)) == "float16"  # T4
    assert choose_dtype("auto", "cpu") == "float32"
    assert choose_dtype("float32", "cuda", (7, 0)) == "float32"
    with pytest.raises(ConfigError, match="compute capability >= 8.0"):
        choose_dtype("bfloat16", "cuda", (7, 5))


# --- 6. host syncs: find_unused_parameters default; the guards decide a step later on every rank ---


def test_find_unused_parameters_is_off_by_default_and_says_why():
    parser = build_parser("t")
    assert parse_args(parser, []).find_unused_parameters is False
    assert parse_args(parser, ["--find_unused_parameters"]).find_unused_parameters is True
    assert "walks the autograd graph" in " ".join(parser.format_help().split())


def _ranks_worker(rank: int, world: int, port: int, ckpt_dir: str, results):
    """Two gloo ranks: the stop decision, and checkpoint hashing/verification split over ranks."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    stopper, stops = Stopper(stop_after_steps=-1, rank=rank), []
    for step in range(1, 9):
        stopper.signalled = stopper.signalled or (rank == 1 and step == 3)  # SIGTERM reaches rank 1 only
        stops.append(stopper.should_stop(step, torch.device("cpu")))
    ckpt.save_train_state(ckpt_dir, {"step": 7}, rank)  # the manifest: each rank hashes half the files
    dist.barrier()
    if rank == 0:  # corrupt a file rank 1 checks (files are split rank::world in manifest order)
        with open(os.path.join(ckpt_dir, "b.bin"), "r+b") as f:
            f.write(b"X")
    dist.barrier()
    try:
        ckpt.verify_checkpoint(ckpt_dir, rank=rank, world=world)
        verdict = None
    except ckpt.CheckpointError as e:
        verdict = str(e)
    results[rank] = (stops, verdict)
    dist.destroy_process_group()


def test_every_rank_stops_after_the_same_step_and_shares_the_checkpoint_verdict(tmp_path):
    for name in ("a.bin", "b.bin", "c.bin"):
        (tmp_path / name).write_bytes(os.urandom(3000) + name.encode())
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_ranks_worker, args=(2, free_port(), str(tmp_path), results), nprocs=2, join=True)
        results = dict(results)
    (stops0, verdict0), (stops1, verdict1) = results[0], results[1]
    # signalled during step 3 on one rank: both stop after step 4, one step later, with no host sync
    assert stops0 == stops1 == [False] * 3 + [True] * 5
    assert verdict0 == verdict1 and "b.bin is corrupted" in verdict0
    manifest = json.loads((tmp_path / ckpt.STATE_FILE).read_text())
    want = hashlib.sha256((tmp_path / "a.bin").read_bytes()).hexdigest()
    assert manifest["files"]["a.bin"]["sha256"] == want and set(manifest["files"]) == {
        "a.bin", "b.bin", "c.bin", ckpt.RNG_FILE,
    }  # fmt: skip


def test_one_process_decides_its_stop_without_a_collective(monkeypatch):
    """World 1 (torchrun/deepspeed with one GPU): the same timing as across ranks (signalled in step 3,
    stopped after step 4), with no fill, all-reduce or device-to-host copy a step."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    calls, all_reduce = [], dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: calls.append(1) or all_reduce(*a, **k))
    try:
        stopper, stops = Stopper(stop_after_steps=-1, rank=0), []
        for step in range(1, 7):
            stopper.signalled = stopper.signalled or step == 3
            stops.append(stopper.should_stop(step, torch.device("cpu")))
    finally:
        dist.destroy_process_group()
    assert stops == [False] * 3 + [True] * 3 and calls == []


def test_checkpoint_sizes_are_always_checked_hashes_on_request(tmp_path):
    (tmp_path / "w.bin").write_bytes(b"0123456789")
    ckpt.save_train_state(str(tmp_path), {"step": 1}, rank=0, hashes=False)
    (tmp_path / "w.bin").write_bytes(b"0123456780")  # same size, other content: unseen without hashes
    assert ckpt.verify_checkpoint(str(tmp_path))["step"] == 1
    (tmp_path / "w.bin").write_bytes(b"01234")
    with pytest.raises(ckpt.CheckpointError, match="w.bin is truncated or missing"):
        ckpt.verify_checkpoint(str(tmp_path))


# --- 10 (and 6). DDP: a skipped step is never applied, holds the LR schedule and is counted ---


def _ddp_engine(dtype: str):
    from llama_train.optim.adamw import build_adamw
    from llama_train.optim.optimizers import build_lr_scheduler
    from llama_train.train.engines.torch_engine import DDPEngine

    args = parse_args(build_parser("t"), "--preset debug --max_seq_len 16 --warmup_steps 3".split())
    torch.manual_seed(0)
    model = Transformer(PRESETS["debug"])
    optimizer = build_adamw(model, args)
    scheduler = build_lr_scheduler(optimizer, args, total_steps=10)
    return DDPEngine(model, optimizer, scheduler, torch.device("cpu"), dtype, grad_clip=1.0)


def _train(engine, guard, bad_steps: set[int], steps: int = 5):
    """(LR each update used, parameters after each step); `bad_steps` get an inf gradient."""
    tokens = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(1))
    lrs, weights = [], []
    for step in range(1, steps + 1):
        _, loss = engine(input_ids=tokens[:, :-1], labels=tokens[:, 1:])
        engine.backward(loss * (math.inf if step in bad_steps else 1.0))
        _, lr = engine.step(guard, step)
        lrs.append(lr)
        weights.append(engine.module.output.weight.detach().clone())
    guard.settle()
    return lrs, weights


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_a_skipped_step_is_not_applied_holds_the_lr_and_is_counted(dtype):
    engine = _ddp_engine(dtype)
    lrs, weights = _train(engine, NonFiniteGuard(limit=3), bad_steps={2})
    assert torch.equal(weights[1], weights[0]) and not torch.equal(weights[2], weights[1])
    assert all(torch.isfinite(w).all() for w in weights)
    assert lrs[2] == lrs[1] and lrs[1] > lrs[0] and lrs[3] > lrs[2]  # warmup held for one step
    assert engine.skipped_steps == 1
    if dtype == "float16":
        assert engine.scaler.get_scale() == 2.0**15  # GradScaler halved its scale after the inf step


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_non_finite_steps_in_a_row_stop_the_run_before_anything_is_applied(dtype):
    """A non-finite loss counts towards --max_nonfinite_steps in fp16 too (not only the GradScaler's)."""
    engine = _ddp_engine(dtype)
    with pytest.raises(FloatingPointError, match="2 optimizer steps in a row"):
        _train(engine, NonFiniteGuard(limit=2), bad_steps={2, 3})
    assert torch.isfinite(engine.module.output.weight).all()


def test_fp16_overflow_at_the_minimum_loss_scale_stops_the_run():
    """Gradients that overflow fp16 with a finite loss (x1e30: every scale overflows) are the GradScaler's
    to skip, not counted; its scale halves from 65536 each time, and an overflow at DeepSpeed's minimum
    scale 1 stops the run as DeepSpeed's fp16 does."""
    engine, guard = _ddp_engine("float16"), NonFiniteGuard(limit=2)
    tokens = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(1))
    before = engine.module.output.weight.detach().clone()
    with pytest.raises(FloatingPointError, match="step 17: .*minimum loss scale 1") as e:
        for step in range(1, 30):
            _, loss = engine(input_ids=tokens[:, :-1], labels=tokens[:, 1:])
            engine.backward(loss * 1e30)
            engine.step(guard, step)
            guard.settle()
    assert guard.total == 0 and engine.skipped_steps == 17, str(e.value)
    assert torch.equal(engine.module.output.weight, before)


def test_found_inf_lives_where_the_norm_is_and_a_negative_norm_is_non_finite():
    """FSDP2's CPU offload: the norm (and fused AdamW's kernel) on the CPU, the loss on the GPU. The
    optimizer's found_inf stays on the norm's device (a CPU kernel must not read a flag still in flight
    from the GPU); only the host flag joins the loss's verdict, on the loss's device (meta stands in
    for cuda here). DeepSpeed's group norms report inf/NaN as -1: non-finite too."""
    found = NonFiniteGuard(limit=2).watch(torch.tensor(3.0), 1, SCALER, loss=torch.tensor(1.0, device="meta"))
    assert found.device.type == "cpu" and found.item() == 0.0
    guard = NonFiniteGuard(limit=2)
    assert guard.watch(torch.tensor(-1.0), 1).item() == 1.0
    guard.settle()
    assert guard.total == 1


# --- 9. pos_cis and Module.to(dtype) ---


def test_module_to_bfloat16_keeps_the_rotary_table_complex_fp32():
    torch.manual_seed(0)
    model = Transformer(PRESETS["debug"])
    cast = Transformer(PRESETS["debug"])
    cast.load_state_dict(model.state_dict())
    cast.to(torch.bfloat16)  # casts complex buffers too: only the real part would be left
    assert cast.pos_cis.dtype == torch.complex64
    assert torch.equal(cast.pos_cis, precompute_pos_cis(16, 256))
    for p in model.parameters():  # the same bf16 weights, cast the way DeepSpeed casts (params only)
        p.data = p.data.to(torch.bfloat16)
    tokens = torch.randint(0, 512, (2, 16))
    with torch.no_grad():
        assert torch.equal(cast(tokens), model(tokens))


# --- 12. the smaller items ---


def test_cpu_adam_build_needs_are_named_before_the_build():
    assert cpu_adam_build_problems(prebuilt=True, ninja=False, cxx=None, python_h=False) == []
    assert cpu_adam_build_problems(prebuilt=False, ninja=True, cxx="/usr/bin/c++", python_h=True) == []
    missing = cpu_adam_build_problems(prebuilt=False, ninja=False, cxx=None, python_h=False)
    assert [m.split(" ")[0] for m in missing] == ["ninja", "a", "Python's"]


def test_inference_scripts_use_the_gpu_when_there_is_one():
    assert (
        inference_device("auto", cuda_ok=True) == "cuda" and inference_device("auto", cuda_ok=False) == "cpu"
    )
    assert inference_device("cuda:1", cuda_ok=True) == "cuda:1"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_attention_runs_on_the_flash_kernel_with_gqa():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = Transformer(PRESETS["debug"]).cuda()  # 4 query heads, 2 kv heads
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    tokens = torch.randint(0, 512, (2, 64), device="cuda")
    with torch.no_grad(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # raises if flash is not eligible
        model(tokens)


@pytest.mark.parametrize(
    ("extras", "spec"), [(None, '".[dev]"'), ("", '"."'), ("tensorboard", '".[tensorboard]"')]
)
def test_make_setup_installs_the_extras_asked_for(tmp_path, extras, spec):
    """`make setup EXTRAS=` installs what training needs and nothing else (a GPU image without wandb
    failed on the dev extra); the default stays `dev`, which `make test` asks for by name; each choice
    has its own stamp, so asking for more later installs it."""
    venv = tmp_path / "venv"
    cmd = ["make", "-n", "setup", f"VENV={venv}", *([] if extras is None else [f"EXTRAS={extras}"])]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    install = [line for line in out.splitlines() if " -e " in line]
    assert len(install) == 1 and install[0].endswith(f"-e {spec}"), out
    assert f"touch {venv}/.llama-train-installed" in out
    test = subprocess.run(["make", "-n", "test", f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True)
    assert "setup EXTRAS=dev" in test.stdout, test.stdout
