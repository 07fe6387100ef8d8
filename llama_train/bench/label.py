"""What every benchmark result file names: the machine it ran on, the date, and the commit."""

import datetime
import os
import subprocess

from llama_train import gpu
from llama_train.plan.planner import ROOT


def machine() -> str:
    """'Intel Xeon ..., 2 cores, 24 GiB' (+ the GPUs this process may use): what the numbers were measured on."""
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    out = f"{cpu}, {os.cpu_count()} cores, {ram:,.0f} GiB"
    smi = gpu.nvidia_smi_gpus()  # not torch: asking it would create a CUDA context in this process
    count = gpu.visible_gpu_count(smi, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if count:
        out += f", {count} x {smi[0].split(': ', 1)[1].split(' (UUID')[0]}"
    return out


def commit() -> str:
    """The checkout's commit, '+changes' when tracked files differ from it; outside git (a copied
    tree) $LLAMA_TRAIN_COMMIT, else 'unknown'."""

    def git(*args):
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("LLAMA_TRAIN_COMMIT", "unknown")


def run_label() -> dict[str, str]:
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return {"machine": machine(), "date": date, "commit": commit()}


def label_line(label: dict[str, str]) -> str:
    return f"Machine: {label['machine']}. Date: {label['date']}. Commit: {label['commit']}."
