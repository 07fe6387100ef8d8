"""Conversion between our LLaMA and transformers' `LlamaForCausalLM`.

The only non-trivial part is rotary layout: Meta (and we) rotate interleaved pairs
(x0, x1), (x2, x3), ... while HF rotates halves (x0, x_{d/2}), ... Both compute the same
attention if the rows of wq/wk are permuted per head, which is what `_permute` does
(the same permutation as transformers' `convert_llama_weights_to_hf.py`).
"""

import glob
import json
import os

import torch

from llama_train import checkpoint as ckpt
from llama_train import portable
from llama_train.dist import print0
from llama_train.errors import CheckpointError
from llama_train.model import ModelArgs, Transformer

# our name -> HF name, per layer ({i} = layer index); the rest are global
_LAYER_KEYS = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_GLOBAL_KEYS = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _key_map(args: ModelArgs) -> dict[str, str]:
    keys = dict(_GLOBAL_KEYS)
    for i in range(args.n_layers):
        for ours, theirs in _LAYER_KEYS.items():
            keys[f"layers.{i}.{ours}"] = f"model.layers.{i}.{theirs}"
    return keys


def _permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Meta interleaved rotary rows -> HF half-split rows, per head."""
    d_out, d_in = w.shape
    return w.view(n_heads, d_out // n_heads // 2, 2, d_in).transpose(1, 2).reshape(d_out, d_in)


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of `_permute`: HF half-split rows -> Meta interleaved rows."""
    d_out, d_in = w.shape
    return w.view(n_heads, 2, d_out // n_heads // 2, d_in).transpose(1, 2).reshape(d_out, d_in)


def to_hf_config(args: ModelArgs, bos_token_id: int = 1, eos_token_id: int = 2):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=args.ffn_hidden_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=args.max_seq_len,
        rms_norm_eps=args.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
        tie_word_embeddings=args.tie_embeddings,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        hidden_act="silu",
        architectures=["LlamaForCausalLM"],
    )


def from_hf_config(config) -> ModelArgs:
    """ModelArgs that reproduce an HF LlamaConfig (intermediate_size becomes multiple_of)."""
    rope = getattr(config, "rope_parameters", None) or {}
    return ModelArgs(
        dim=config.hidden_size,
        n_layers=config.num_hidden_layers,
        n_heads=config.num_attention_heads,
        n_kv_heads=config.num_key_value_heads,
        vocab_size=config.vocab_size,
        multiple_of=config.intermediate_size,  # ceil-rounding to itself gives it back exactly
        ffn_dim_multiplier=config.intermediate_size / int(8 * config.hidden_size / 3),
        norm_eps=config.rms_norm_eps,
        rope_theta=rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)),
        max_seq_len=config.max_position_embeddings,
        tie_embeddings=config.tie_word_embeddings,
    )


def to_hf_state_dict(state_dict: dict, args: ModelArgs) -> dict:
    """Our state dict -> LlamaForCausalLM's (q/k rows permuted to HF's rotary layout)."""
    out = {}
    for ours, theirs in _key_map(args).items():
        if ours == "output.weight" and args.tie_embeddings:
            continue  # HF ties lm_head to embed_tokens itself
        w = state_dict[ours]
        if ours.endswith("attention.wq.weight"):
            w = _permute(w, args.n_heads)
        elif ours.endswith("attention.wk.weight"):
            w = _permute(w, args.kv_heads)
        out[theirs] = w.clone()
    return out


def from_hf_state_dict(state_dict: dict, args: ModelArgs) -> dict:
    """LlamaForCausalLM's state dict -> ours (inverse of `to_hf_state_dict`)."""
    out = {}
    for ours, theirs in _key_map(args).items():
        if ours == "output.weight" and args.tie_embeddings:
            out[ours] = state_dict[_GLOBAL_KEYS["tok_embeddings.weight"]].clone()
            continue
        w = state_dict[theirs]
        if ours.endswith("attention.wq.weight"):
            w = _unpermute(w, args.n_heads)
        elif ours.endswith("attention.wk.weight"):
            w = _unpermute(w, args.kv_heads)
        out[ours] = w.clone()
    return out


def export_hf(state_dict: dict, args: ModelArgs, output_dir: str, tokenizer=None, dtype=torch.float32):
    """Write a directory that `AutoModelForCausalLM.from_pretrained` loads (safetensors)."""
    from transformers import LlamaForCausalLM

    config = to_hf_config(args)
    config.dtype = dtype
    model = LlamaForCausalLM(config).to(dtype)
    missing, unexpected = model.load_state_dict(to_hf_state_dict(state_dict, args), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"HF export mismatch: missing={missing} unexpected={unexpected}")
    os.makedirs(output_dir, exist_ok=True)
    model.save_pretrained(output_dir, safe_serialization=True)
    if tokenizer is not None:  # tokenizer.model too, which LLaMA tooling (llama.cpp, sentencepiece) expects
        from utils.data import save_tokenizer

        save_tokenizer(tokenizer, output_dir)
    with open(os.path.join(output_dir, "llama_train_args.json"), "w") as f:
        json.dump(args.to_dict(), f, indent=2)
    return output_dir


def load_for_inference(path: str, tokenizer_path: str | None = None):
    """(LlamaForCausalLM in eval mode, tokenizer) from an HF export directory, or from a
    checkpoint / run output_dir (converted in memory; the tokenizer comes from the run)."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from utils.data import load_tokenizer

    if os.path.isfile(os.path.join(path, "config.json")):
        return AutoModelForCausalLM.from_pretrained(path).eval(), load_tokenizer(tokenizer_path or path)
    ckpt_dir = ckpt.resolve_checkpoint(path)
    state_dict, model_dict = portable.consolidated_state_dict(ckpt_dir)  # read safely (weights_only)
    args = ModelArgs(**model_dict)
    model = LlamaForCausalLM(to_hf_config(args))
    model.load_state_dict(to_hf_state_dict(state_dict, args), strict=not args.tie_embeddings)
    run_dir = os.path.dirname(os.path.dirname(os.path.abspath(ckpt_dir)))
    return model.eval(), load_tokenizer(tokenizer_path or os.path.join(run_dir, "tokenizer"))


# --- --init_from: a new run from existing weights ---

HF_CONFIG_FIELDS = (
    "n_heads",
    "kv_heads",
    "head_dim",
    "ffn_hidden_dim",
    "norm_eps",
    "rope_theta",
    "tie_embeddings",
)


def init_from(args, model: Transformer, start, rank: int, world: int):
    """--init_from PATH: its weights into the freshly built `model`, before any engine wraps it (so
    every strategy starts from them; the optimizer and LR schedule start fresh, at step 0). PATH: an
    HF directory (ours, an export, or any LlamaForCausalLM of the flags' shape), a .safetensors or
    .pt state dict, a checkpoint or a run's output_dir. Without --tokenizer, PATH's tokenizer is used.
    A run that resumes (`start`, e.g. a requeued job started with --init_from) continues its checkpoint."""
    if not args.init_from or start is not None:
        return
    weights, what, tokenizer = read_weights(args.init_from, model.args, rank, world, args.hash_checkpoints)
    want = {k: v.shape for k, v in model.state_dict().items()}
    portable.check_shapes(
        {k: v.shape for k, v in weights.items()}, want, what=f"--init_from {args.init_from}"
    )
    model.load_state_dict(weights)
    note = ""
    if args.tokenizer is None and tokenizer is not None:
        args.tokenizer, note = tokenizer, f"; tokenizer from {tokenizer}"
    print0(
        f"initialised from {what} ({len(weights)} tensors); optimizer and LR schedule start fresh{note}",
        rank=rank,
    )


def read_weights(path: str, margs: ModelArgs, rank: int = 0, world: int = 1, hashes: bool = True):
    """(state dict in our names, what it is, its tokenizer dir or None) for --init_from PATH."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return _hf_dir_weights(path, margs), f"HF directory {path}", path
    if os.path.isdir(path):
        ckpt_dir = ckpt.resolve_checkpoint(path)
        state = ckpt.verify_checkpoint(ckpt_dir, rank=rank, world=world, hashes=hashes)
        _refuse_other_model(path, ModelArgs(**state["model"]), margs)
        weights, kind = portable.checkpoint_weights(ckpt_dir, state)
        run_tokenizer = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(ckpt_dir))), "tokenizer")
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
    weights = _load_state_dict_file(path)
    if any(k.startswith("model.") or k == "lm_head.weight" for k in weights):  # transformers' names
        return _from_hf(weights, margs, path), f"HF state dict {path}", None
    return weights, f"state dict {path}", None


def _load_state_dict_file(path: str) -> dict:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    sd = portable.safe_load(path, mmap=False)
    if not isinstance(sd, dict) or not all(torch.is_tensor(v) for v in sd.values()):
        raise CheckpointError(f"--init_from {path}: not a state dict (name -> tensor)")
    return sd


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
        weights.update(_load_state_dict_file(f))
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
    portable.check_shapes(have, want, what=f"--init_from {path}")
    return from_hf_state_dict(weights, margs)
