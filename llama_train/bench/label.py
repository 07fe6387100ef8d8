"""What every benchmark result file names: the machine it ran on, the date, and the commit."""

import datetime
import os
import subprocess

from llama_train.plan.planner import ROOT


def machine() -> str:
    """'Intel Xeon ..., 2 cores, 24 GiB' (+ the GPUs torch sees): what the numbers were measured on."""
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    out = f"{cpu}, {os.cpu_count()} cores, {ram:,.0f} GiB"
    import torch

    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        out += f", {len(names)} x {names[0]}"
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
