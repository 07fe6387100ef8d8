"""The optimizers --optimizer names, one record each (spec.py). A new optimizer is one more file like
muon.py and one more entry here; every other module reads the records through OPTIMIZERS and
optimizer_spec."""

from llama_train.optim.adamw import ADAMW
from llama_train.optim.muon import MUON
from llama_train.optim.spec import OptimizerSpec

OPTIMIZERS: dict[str, OptimizerSpec] = {spec.name: spec for spec in (ADAMW, MUON)}


def optimizer_spec(name: str) -> OptimizerSpec:
    """The record of --optimizer NAME (config.py refuses an unknown name before any work)."""
    return OPTIMIZERS[name]
