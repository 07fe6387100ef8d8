"""What the GPU path decides from device facts, as pure functions of those facts.

The facts are nvidia-smi's GPU list, CUDA_VISIBLE_DEVICES, compute capability, torch's build and
the tools a DeepSpeed op build needs. The queries that collect them are thin wrappers here, so
every decision is tested on a machine without a GPU (tests/test_gpu_path.py).

    python -m llama_train.gpu check              exit 2 with the reason if NVIDIA GPUs are visible but torch cannot use them
    python -m llama_train.gpu count              GPUs this process may use (CUDA_VISIBLE_DEVICES applied); 0 without CUDA
    python -m llama_train.gpu deepspeed [N]      the `deepspeed` launcher for N local ranks (default: count), one word
                                                 a line: [env DS_ACCELERATOR=cpu] PYTHON -m deepspeed.launcher.runner
                                                 --num_gpus N | --include localhost:...
"""

import os
import shutil
import subprocess
import sys
import sysconfig
import warnings

import torch

from llama_train.errors import ConfigError

# The launchers as modules of the running Python, found wherever it finds torch and deepspeed: a venv
# that reaches a GPU image's torch through a .pth (make setup, SYSTEM_TORCH=1) has no bin/torchrun.
# Both re-exec their workers with sys.executable, as the `torchrun` and `deepspeed` scripts do.
LAUNCHER_MODULES = {"torchrun": "torch.distributed.run", "deepspeed": "deepspeed.launcher.runner"}


def launcher(name: str, python: str | None = None) -> list[str]:
    """`torchrun` or `deepspeed` as a command: [python, "-m", its module] (python: this one)."""
    return [python or sys.executable, "-m", LAUNCHER_MODULES[name]]


def hidden(visible: str | None) -> bool:
    """CUDA_VISIBLE_DEVICES set to hide every GPU ("" or a leading -1): a CPU run on purpose."""
    return visible is not None and (visible.strip() == "" or visible.strip().startswith("-"))


def visible_ids(visible: str | None) -> list[str] | None:
    """The entries of CUDA_VISIBLE_DEVICES; None when it is unset (every GPU)."""
    if visible is None:
        return None
    return [] if hidden(visible) else [v.strip() for v in visible.split(",") if v.strip()]


def visible_gpu_count(smi_gpus: list[str], visible: str | None) -> int:
    """GPUs a process may use: nvidia-smi's list, narrowed by CUDA_VISIBLE_DEVICES."""
    ids = visible_ids(visible)
    return len(smi_gpus) if ids is None else min(len(ids), len(smi_gpus))


def cuda_unusable(
    smi_gpus: list[str], visible: str | None, cuda_available: bool, torch_build: str, why: str = ""
) -> str | None:
    """Why a run would silently fall back to CPU although NVIDIA GPUs are there, or None.

    `torch_build` is e.g. "torch 2.13.0 built for CUDA 12.8" or "torch 2.13.0+cpu (a CPU-only build)";
    `why` is what torch said when CUDA failed to initialise (a too old driver, ...)."""
    if cuda_available or not smi_gpus or hidden(visible):
        return None
    return (
        f"{len(smi_gpus)} NVIDIA GPU(s) visible ({smi_gpus[0]}) but {torch_build} cannot use them"
        + (f" ({why})" if why else "")
        + ": training would silently run on CPU in fp32. Install a torch whose CUDA the driver supports "
        "(`make setup` pins the tested one; `nvidia-smi` shows the driver's CUDA version; "
        "TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 make setup picks another CUDA build), "
        "or hide the GPUs on purpose with CUDA_VISIBLE_DEVICES= to train on CPU"
    )


def deepspeed_devices(
    num: int | None, visible: str | None, smi_gpus: list[str]
) -> tuple[list[str], dict[str, str]]:
    """(`deepspeed` launcher arguments, environment to add) for `num` local ranks (None: all visible).

    The launcher deletes CUDA_VISIBLE_DEVICES when --num_gpus is given and trains on GPUs 0..N-1
    (another job's GPUs, perhaps), so a set variable becomes `--include localhost:<its first N>`
    (GPU UUIDs are translated to nvidia-smi's indices, which are in PCI bus order, so the ranks get
    CUDA_DEVICE_ORDER=PCI_BUS_ID: CUDA's own order, fastest first, can differ on a host with mixed GPU
    models). Hidden GPUs ("") are a CPU run: DeepSpeed's
    per-rank launcher would set CUDA_VISIBLE_DEVICES to 0..N-1 again and each rank pick the GPU
    accelerator, so DS_ACCELERATOR=cpu pins the choice. Without GPUs the variable means nothing."""
    ids = visible_ids(visible)
    if not ids or not smi_gpus:
        return ["--num_gpus", str(num if num is not None else max(1, len(smi_gpus)))], launcher_env(visible)
    index = {line.split("UUID: ")[-1].rstrip(")"): line.split(":")[0].split()[-1] for line in smi_gpus}
    translated = [i if i.isdigit() else index.get(i, i) for i in ids]
    order = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"} if translated != ids else {}
    ids = translated
    if not all(i.isdigit() for i in ids):
        raise ConfigError(
            f"CUDA_VISIBLE_DEVICES={visible!r}: the deepspeed launcher selects GPUs by index "
            "(--include localhost:0,1); use indices or GPU UUIDs that nvidia-smi -L lists (not MIG devices)"
        )
    n = len(ids) if num is None else num
    if n > len(ids):
        raise ConfigError(f"{n} ranks asked for but CUDA_VISIBLE_DEVICES={visible!r} names {len(ids)} GPU(s)")
    return ["--include", "localhost:" + ",".join(ids[:n])], order


def launcher_env(visible: str | None) -> dict[str, str]:
    """Environment a `deepspeed` launch adds: DS_ACCELERATOR=cpu when GPUs are hidden on purpose."""
    return {"DS_ACCELERATOR": "cpu"} if hidden(visible) else {}


def default_world_sizes(gpu_count: int, cpu_count: int) -> list[int]:
    """The benchmark's default ranks per run: every visible GPU; on CPU 2 ranks (1 on one core)."""
    return [gpu_count] if gpu_count > 0 else [2 if cpu_count >= 2 else 1]


def cpu_adam_build_problems(prebuilt: bool, ninja: bool, cxx: str | None, python_h: bool) -> list[str]:
    """What a JIT build of DeepSpeedCPUAdam (the offload configs' optimizer) lacks, or [].

    DeepSpeed 0.19's CUDA accelerator builds it with the CPU op builder: a C++ compiler, ninja
    and Python's headers, no nvcc (older releases compiled it against CUDA and needed an nvcc
    matching torch's CUDA). An op installed prebuilt (DS_BUILD_CPU_ADAM=1) needs none of them."""
    if prebuilt:
        return []
    missing = [] if ninja else ["ninja on PATH (pip install ninja; a venv's bin/ must be on PATH)"]
    missing += [] if cxx else ["a C++ compiler (c++/g++ on PATH, or CXX)"]
    missing += [] if python_h else ["Python's headers, Python.h (e.g. apt-get install python3-dev)"]
    return missing


def usable_summary(build: str, devices: list[tuple[str, tuple[int, int]]]) -> str:
    """What `python -m llama_train.gpu check` says when training can start: the devices torch will
    train on (name, compute capability) and the precision `--dtype auto` picks there."""
    if not devices:
        note = (
            "; this torch is a CUDA build (GBs of CUDA libraries unused here): for the CPU-only wheel, "
            "make clean && make setup TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu"
        )
        return f"no NVIDIA GPU visible to {build}: training runs on CPU (gloo), fp32 under --dtype auto" + (
            note if "built for CUDA" in build else ""
        )
    bf16 = all(cap >= (8, 0) for _, cap in devices)
    names = "; ".join(
        f"{i}: {name} (compute capability {cap[0]}.{cap[1]})" for i, (name, cap) in enumerate(devices)
    )
    dtype = "bf16" if bf16 else "fp16 with loss scaling (compute capability < 8.0)"
    return f"{len(devices)} GPU(s) usable by {build}, NCCL, {dtype} under --dtype auto: {names}"


def inference_device(requested: str, cuda_ok: bool) -> str:
    """scripts/generate.py and eval_ppl.py: `auto` is the GPU when torch can use one, else the CPU."""
    return ("cuda" if cuda_ok else "cpu") if requested == "auto" else requested


# --- thin wrappers: the facts of this machine ---


def nvidia_smi_gpus() -> list[str]:
    """`nvidia-smi -L` lines ("GPU 0: NVIDIA H200 (UUID: ...)"); [] without the tool or a driver."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.startswith("GPU ")]


def torch_build() -> str:
    if torch.version.cuda:
        return f"torch {torch.__version__} built for CUDA {torch.version.cuda}"
    return f"torch {torch.__version__} (a CPU-only build)"


def cuda_available() -> tuple[bool, str]:
    """(torch.cuda.is_available(), the warning torch gave when it is not: driver too old, ...)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ok = torch.cuda.is_available()
    return ok, "; ".join(str(w.message).splitlines()[0] for w in caught)[:300]


def cuda_devices() -> list[tuple[str, tuple[int, int]]]:
    """(name, compute capability) of each GPU torch can use here."""
    if not torch.cuda.is_available():
        return []
    return [
        (torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i))
        for i in range(torch.cuda.device_count())
    ]


def deepspeed_launch(num: int | None) -> tuple[list[str], dict[str, str]]:
    """`deepspeed_devices` for this machine and environment."""
    return deepspeed_devices(num, os.environ.get("CUDA_VISIBLE_DEVICES"), nvidia_smi_gpus())


def deepspeed_command(num: int | None) -> list[str]:
    """The `deepspeed` launcher for `num` local ranks on this machine, as words: [env VAR=... ]
    PYTHON -m deepspeed.launcher.runner, then its device arguments."""
    args, env = deepspeed_launch(num)
    prefix = ["env", *(f"{k}={v}" for k, v in env.items())] if env else []
    return [*prefix, *launcher("deepspeed"), *args]


def check_cuda_usable():
    """Stop (ConfigError) when NVIDIA GPUs are visible but torch cannot use them."""
    smi = nvidia_smi_gpus()
    if not smi:
        return
    ok, why = cuda_available()
    problem = cuda_unusable(smi, os.environ.get("CUDA_VISIBLE_DEVICES"), ok, torch_build(), why)
    if problem:
        raise ConfigError(problem)


def warn_cpu_adam_build():
    """Before DeepSpeed builds DeepSpeedCPUAdam, name what the build would lack (a warning: an op
    built earlier into TORCH_EXTENSIONS_DIR loads without a compiler)."""
    from deepspeed.git_version_info import installed_ops

    python_h = os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    prebuilt = bool(installed_ops.get("cpu_adam"))
    missing = cpu_adam_build_problems(prebuilt, shutil.which("ninja") is not None, cxx, python_h)
    if missing:
        print(
            "warning: the offload config's optimizer, DeepSpeedCPUAdam, is compiled on first use and this "
            f"machine lacks: {'; '.join(missing)}. If no earlier build is cached the build fails.",
            file=sys.stderr,
            flush=True,
        )


def main(argv: list[str]) -> int:
    what = argv[0] if argv else ""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    count = visible_gpu_count(nvidia_smi_gpus(), visible) if cuda_available()[0] else 0
    try:
        if what == "check":
            check_cuda_usable()
            print(usable_summary(torch_build(), cuda_devices()))
        elif what == "count":
            print(count)
        elif what == "deepspeed":
            num = int(argv[1]) if len(argv) > 1 else (count or None)
            print("\n".join(deepspeed_command(num)))
        else:
            print(__doc__, file=sys.stderr)
            return 2
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
