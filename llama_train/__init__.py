"""The library both trainers share (docs/developing.md: "Layout").

Importing it first checks that `utils.data` is this project's data package (utils/data, beside
llama_train/). PyPI has an unrelated package called `utils`; installed into the same environment it
sits in site-packages, which Python searches before an editable install's finder, so a script
under scripts/ imports that `utils`. The finder still supplies our `utils.data` when that package
has none; where it has one, the scripts would import the wrong module and fail far from the cause.
Every trainer and script imports llama_train before utils, so the cause is named here."""

import importlib.util
import os
from pathlib import Path


def _check_utils_data_is_ours():
    ours = Path(__file__).resolve().parent.parent / "utils" / "data"
    try:
        spec = importlib.util.find_spec("utils.data")
    except ImportError:  # `utils` is a plain module (utils.py), not a package
        spec = None
    where = None if spec is None else (spec.submodule_search_locations or [spec.origin])
    if where is None or [Path(p).resolve() for p in where] != [ours]:
        found = "missing" if where is None else ", ".join(map(str, where))
        raise ImportError(
            f"utils.data is {found}, not this project's {ours}: another package named utils is installed "
            "in this environment and shadows ours (pip uninstall utils)"
        )


_check_utils_data_is_ours()


def _deepspeed_on_cpu_without_a_word():
    """Where torch sees no GPU, DeepSpeed's accelerator is the CPU's anyway, but DeepSpeed says so in a
    warning ("Setting accelerator to CPU. If you have GPU ...") from whichever process imports it first:
    a plain `python train_deepspeed.py` before its first line, the DDP twin when it reads a checkpoint.
    Naming it (DS_ACCELERATOR=cpu, as the launch front does) before any of our modules imports DeepSpeed
    keeps the choice and drops the line; a DS_ACCELERATOR of the user's own is kept."""
    import torch

    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


_deepspeed_on_cpu_without_a_word()
