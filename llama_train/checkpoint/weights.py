"""Weights from anything a user points at, converted for what the tools call: `init_from` (the
trainers' --init_from), `load_for_inference` (scripts/eval_ppl.py, generate.py) and
`consolidated_state_dict` (scripts/export_hf.py).

    HF directory        *.safetensors (or *.bin), ours, an export or any LlamaForCausalLM of the
                        flags' shape; transformers' names and rotary layout converted by hf.py
    state dict file     .safetensors, or a .pt of name -> tensor (ours or transformers' names)
    checkpoint          of any strategy, or a run's output_dir (its `latest`): its full fp32 state
                        dict, from the neutral form or the merged model-parallel shards

Every file is read by formats.py (the one safe reader); here the names and layouts are converted and
every tensor's shape is checked against the model the flags describe.
"""

import glob
import os
from dataclasses import dataclass

import torch

from llama_train.checkpoint.formats import (
    checkpoint_kind,
    load_state_dict_file,
    merged_checkpoint_state,
    open_checkpoint,
)
from llama_train.checkpoint.identity import run_tokenizer
from llama_train.checkpoint.store import resolve_checkpoint, run_dir, verify_checkpoint
from llama_train.distributed.dist import print0
from llama_train.errors import CheckpointError
from llama_train.hf import from_hf_config, from_hf_state_dict, to_hf_config, to_hf_state_dict
from llama_train.model import ModelArgs, Transformer
from utils.data import load_tokenizer

# --- what the tools call ---


@dataclass
class Init:
    """What --init_from decided for a new run: the weights it starts from (None: its own seeded
    initialisation) and its tokenizer (--tokenizer, else the one beside those weights; None: trained
    or reused under --data_output_path)."""

    weights: dict | None
    tokenizer: str | None


def init_from(args, margs: ModelArgs, start, rank: int, world: int) -> Init:
    """--init_from PATH, decided before the model is built (so every strategy starts from the same
    weights; the optimizer and LR schedule start fresh, at step 0). PATH: an HF directory (ours, an
    export, or any LlamaForCausalLM of the flags' shape), a .safetensors or .pt state dict, a
    checkpoint or a run's output_dir; every tensor's shape is checked against the flags' model. A run
    that resumes (`start`, e.g. a requeued job started with --init_from) continues its checkpoint,
    with its own tokenizer."""
    if not args.init_from or start is not None:
        return Init(None, run_tokenizer(args, start))  # a resume: the run's own (identity.py)
    weights, what, tokenizer = read_weights(args.init_from, margs, rank, world, args.hash_checkpoints)
    with torch.device("meta"):
        want = {k: v.shape for k, v in Transformer(margs).state_dict().items()}
    check_shapes({k: v.shape for k, v in weights.items()}, want, what=f"--init_from {args.init_from}")
    note = f"; tokenizer from {tokenizer}" if args.tokenizer is None and tokenizer is not None else ""
    print0(
        f"initialised from {what} ({len(weights)} tensors); optimizer and LR schedule start fresh{note}",
        rank=rank,
    )
    return Init(weights, args.tokenizer or tokenizer)


def load_for_inference(path: str, tokenizer_path: str | None = None):
    """(LlamaForCausalLM in eval mode, tokenizer) from an HF export directory, or from a
    checkpoint / run output_dir (converted in memory; the tokenizer comes from the run)."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    if os.path.isfile(os.path.join(path, "config.json")):
        return AutoModelForCausalLM.from_pretrained(path).eval(), load_tokenizer(tokenizer_path or path)
    ckpt_dir = resolve_checkpoint(path)
    state_dict, model_dict = consolidated_state_dict(ckpt_dir)
    args = ModelArgs(**model_dict)
    model = LlamaForCausalLM(to_hf_config(args))
    model.load_state_dict(to_hf_state_dict(state_dict, args), strict=not args.tie_embeddings)
    return model.eval(), load_tokenizer(tokenizer_path or os.path.join(run_dir(ckpt_dir), "tokenizer"))


def consolidated_state_dict(ckpt_dir: str) -> tuple[dict, dict]:
    """(full fp32 state dict, the run's model args as a dict) of any of our checkpoints, read
    safely (for export, evaluation, generation)."""
    state = verify_checkpoint(ckpt_dir)
    return checkpoint_weights(ckpt_dir, state)[0], state["model"]


# --- weights alone: HF directories, state dict files, any checkpoint ---

HF_CONFIG_FIELDS = (
    "n_heads",
    "kv_heads",
    "head_dim",
    "ffn_hidden_dim",
    "norm_eps",
    "rope_theta",
    "tie_embeddings",
)


def read_weights(path: str, margs: ModelArgs, rank: int = 0, world: int = 1, hashes: bool = True):
    """(state dict in our names, what it is, its tokenizer dir or None) for --init_from PATH."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return _hf_dir_weights(path, margs), f"HF directory {path}", path
    if os.path.isdir(path):
        ckpt_dir = resolve_checkpoint(path)
        state = verify_checkpoint(ckpt_dir, rank=rank, world=world, hashes=hashes)
        _refuse_other_model(path, ModelArgs(**state["model"]), margs)
        weights, kind = checkpoint_weights(ckpt_dir, state)
        run_tokenizer = os.path.join(run_dir(ckpt_dir), "tokenizer")
        return (
            weights,
            f"checkpoint {ckpt_dir} ({kind})",
            run_tokenizer if os.path.isdir(run_tokenizer) else None,
        )
    if not os.path.isfile(path):
        raise CheckpointError(
            f"--init_from {path}: no such file or directory (give an HF directory, a .safetensors/.pt state "
            "dict, a checkpoint or a run's output_dir)"
        )
    weights = load_state_dict_file(path)
    if any(k.startswith("model.") or k == "lm_head.weight" for k in weights):  # transformers' names
        return _from_hf(weights, margs, path), f"HF state dict {path}", None
    return weights, f"state dict {path}", None


def _hf_dir_weights(path: str, margs: ModelArgs) -> dict:
    """An HF directory's weights (safetensors, or .bin read with weights_only), checked against the
    flags' model: the config's head layout and numerics, then every tensor's shape."""
    from transformers import AutoConfig

    _refuse_other_model(path, from_hf_config(AutoConfig.from_pretrained(path)), margs)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors"))) or sorted(
        glob.glob(os.path.join(path, "*.bin"))
    )
    if not files:
        raise CheckpointError(f"--init_from {path}: no *.safetensors or *.bin weights in it")
    weights = {}
    for f in files:
        weights.update(load_state_dict_file(f))
    return _from_hf(weights, margs, path)


def _refuse_other_model(path: str, theirs: ModelArgs, ours: ModelArgs):
    """Fields that would change the model's numerics with the same tensor shapes."""
    diffs = [
        f"{k}: --init_from {getattr(theirs, k)!r}, flags {getattr(ours, k)!r}"
        for k in HF_CONFIG_FIELDS
        if getattr(theirs, k) != getattr(ours, k)
    ]
    if diffs:
        raise CheckpointError(
            f"--init_from {path} is another model than the flags describe:\n  - "
            + "\n  - ".join(diffs)
            + "\nset the model flags (--preset, --dim, --n_heads, ...) to match it"
        )


def _from_hf(weights: dict, margs: ModelArgs, path: str) -> dict:
    """transformers' LlamaForCausalLM names and rotary layout -> ours, shapes checked by HF name."""
    with torch.device("meta"):
        ours = Transformer(margs).state_dict()
    want = {k: v.shape for k, v in to_hf_state_dict(ours, margs).items()}
    # older transformers saved the rotary table too; it is recomputed, not a weight
    have = {k: v.shape for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
    check_shapes(have, want, what=f"--init_from {path}")
    return from_hf_state_dict(weights, margs)


def checkpoint_weights(ckpt_dir: str, state: dict) -> tuple[dict, str]:
    """(full fp32 state dict, what kind of checkpoint) of a verified checkpoint of any strategy:
    tensor-parallel shards and pipeline stages merged, ZeRO partitions through the neutral form."""
    if kind := checkpoint_kind(ckpt_dir):
        return {k: v.float() for k, v in merged_checkpoint_state(ckpt_dir).items()}, f"{kind} parallel"
    reader = open_checkpoint(ckpt_dir, state)
    sd = {name: reader.weight(name) for name in reader.shapes()}
    if state["model"].get("tie_embeddings") and "tok_embeddings.weight" in sd:
        sd["output.weight"] = sd["tok_embeddings.weight"]
    return sd, reader.kind


def check_shapes(have: dict, want: dict, what: str):
    """Refuse, naming every parameter that is missing, extra or shaped otherwise."""
    problems = [
        f"{n}: {what} {tuple(have[n])}, model {tuple(s)}"
        for n, s in want.items()
        if n in have and tuple(have[n]) != tuple(s)
    ]
    problems += [f"{n}: missing from the {what}" for n in want if n not in have]
    problems += [f"{n}: in the {what}, not in the model" for n in have if n not in want]
    if problems:
        raise CheckpointError(
            f"the {what} does not fit the model the flags describe:\n  - " + "\n  - ".join(problems)
        )
