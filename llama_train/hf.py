"""Conversion between our LLaMA and transformers' `LlamaForCausalLM`: names, rotary layout and
config, both ways, and the export that writes our weights as an HF directory. Reading files is
checkpoint/formats.py's.

The only non-trivial part is rotary layout: Meta (and we) rotate interleaved pairs
(x0, x1), (x2, x3), ... while HF rotates halves (x0, x_{d/2}), ... Both compute the same
attention if the rows of wq/wk are permuted per head, which is what `_permute` does
(the same permutation as transformers' `convert_llama_weights_to_hf.py`).
"""

import json
import os

import torch

from llama_train.model import ModelArgs

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
