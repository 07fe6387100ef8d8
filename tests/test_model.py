"""The model against an outside oracle: transformers' LlamaForCausalLM."""

from dataclasses import replace

import pytest
import torch
from transformers import LlamaForCausalLM

from llama_train.hf import from_hf_config, from_hf_state_dict, to_hf_config, to_hf_state_dict
from llama_train.model import PRESETS, ModelArgs, Transformer, apply_rotary_emb, precompute_pos_cis

CONFIGS = {
    "mha": ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=101, multiple_of=32, max_seq_len=64),
    "gqa": ModelArgs(
        dim=64, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=101, multiple_of=32, max_seq_len=64
    ),
    # dim 96 is not a power of two; ffn_dim_multiplier and rope_theta off their defaults
    "odd_dim": ModelArgs(
        dim=96,
        n_layers=3,
        n_heads=6,
        n_kv_heads=3,
        vocab_size=77,
        multiple_of=48,
        ffn_dim_multiplier=1.3,
        rope_theta=500000.0,
        norm_eps=1e-6,
        max_seq_len=64,
    ),
    "tied": ModelArgs(
        dim=64, n_layers=2, n_heads=4, vocab_size=101, multiple_of=32, max_seq_len=64, tie_embeddings=True
    ),
}


def _pair(args: ModelArgs, seed: int = 0):
    torch.manual_seed(seed)
    ours = Transformer(args).eval()
    with torch.no_grad():  # random norms too, so a wrong norm mapping cannot hide behind ones
        for name, p in ours.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    hf = LlamaForCausalLM(to_hf_config(args)).eval()
    hf.load_state_dict(to_hf_state_dict(ours.state_dict(), args), strict=not args.tie_embeddings)
    return ours, hf


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_transformers(name):
    args = CONFIGS[name]
    ours, hf = _pair(args)
    tokens = torch.randint(0, args.vocab_size, (2, 37))
    with torch.no_grad():
        diff = (ours(tokens) - hf(tokens).logits).abs().max().item()
    print(f"{name}: max |logits diff| = {diff:.2e}")
    assert diff <= 1e-4


@pytest.mark.parametrize("name", ["mha", "gqa"])
def test_loss_matches_transformers(name):
    args = CONFIGS[name]
    ours, hf = _pair(args)
    tokens = torch.randint(0, args.vocab_size, (3, 20))
    # HF shifts labels inside; ours are pre-shifted, the last position has no target
    labels = torch.cat([tokens[:, 1:], torch.full((3, 1), -100)], dim=1)
    with torch.no_grad():
        _, loss = ours(tokens, labels=labels)
        hf_loss = hf(tokens, labels=tokens).loss
    assert abs(loss.item() - hf_loss.item()) <= 1e-5


@pytest.mark.parametrize("name", CONFIGS)
def test_state_dict_round_trip_is_exact(name):
    args = CONFIGS[name]
    ours, _ = _pair(args)
    sd = ours.state_dict()
    back = from_hf_state_dict(to_hf_state_dict(sd, args), args)
    assert back.keys() == sd.keys()
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


@pytest.mark.parametrize("name", CONFIGS)
def test_config_round_trip(name):
    args = CONFIGS[name]
    back = from_hf_config(to_hf_config(args))
    assert back.ffn_hidden_dim == args.ffn_hidden_dim
    for f in (
        "dim",
        "n_layers",
        "n_heads",
        "kv_heads",
        "vocab_size",
        "norm_eps",
        "rope_theta",
        "tie_embeddings",
    ):
        assert getattr(back, f) == getattr(args, f), f


@pytest.mark.parametrize("name", ["mha", "gqa", "odd_dim"])
def test_sdpa_and_math_attention_agree(name):
    args = CONFIGS[name]
    torch.manual_seed(0)
    flash = Transformer(args)
    math = Transformer(ModelArgs(**{**args.to_dict(), "use_flash_attn": False}))
    math.load_state_dict(flash.state_dict())
    tokens = torch.randint(0, args.vocab_size, (2, 33))
    labels = torch.randint(0, args.vocab_size, (2, 33))
    (_, l1), (_, l2) = flash(tokens, labels), math(tokens, labels)
    l1.backward()
    l2.backward()
    assert abs(l1.item() - l2.item()) <= 1e-6
    for (n, p1), p2 in zip(flash.named_parameters(), math.parameters()):
        assert torch.allclose(p1.grad, p2.grad, atol=1e-6), n


@pytest.mark.parametrize("every", [1, 2])  # every block; every other block (selective)
def test_gradient_checkpointing_gives_same_gradients(every):
    args = replace(CONFIGS["gqa"], n_layers=3)
    torch.manual_seed(0)
    plain = Transformer(args)
    ckpt = Transformer(replace(args, gradient_checkpointing=True, checkpoint_every=every))
    ckpt.load_state_dict(plain.state_dict())
    assert [ckpt.args.checkpointed(i) for i in range(3)] == [True, every == 1, True]
    recomputed = []
    for i, layer in enumerate(ckpt.layers):  # a checkpointed block runs twice: forward and recompute
        layer.register_forward_pre_hook(lambda *_, i=i: recomputed.append(i))
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    plain(tokens, tokens)[1].backward()
    ckpt(tokens, tokens)[1].backward()
    assert sorted(recomputed) == sorted([0, 1, 2] + [i for i in range(3) if ckpt.args.checkpointed(i)])
    for p1, p2 in zip(plain.parameters(), ckpt.parameters()):
        assert torch.allclose(p1.grad, p2.grad, atol=1e-6)


def test_pos_cis_is_complex_nonpersistent_and_survives_half():
    m = Transformer(CONFIGS["gqa"])
    assert m.pos_cis.dtype == torch.complex64
    assert "pos_cis" not in m.state_dict()
    m.bfloat16()  # DeepSpeed casts this way; complex buffers must be left alone
    assert m.pos_cis.dtype == torch.complex64


def test_rotary_is_a_rotation():
    # |q| is preserved and position 0 is the identity
    q = torch.randn(1, 5, 2, 16)
    freqs = precompute_pos_cis(16, 5)
    rq, _ = apply_rotary_emb(q, q, freqs)
    assert torch.allclose(rq.norm(dim=-1), q.norm(dim=-1), atol=1e-5)
    assert torch.allclose(rq[:, 0], q[:, 0])


def test_labels_ignore_index_and_too_long_input():
    args = CONFIGS["mha"]
    m = Transformer(args).eval()  # eval: full logits (training gives (None, loss), tests/test_loss_head.py)
    tokens = torch.randint(0, args.vocab_size, (1, 8))
    labels = tokens.clone()
    labels[:, 4:] = -100
    logits, loss = m(tokens, labels)
    ref = torch.nn.functional.cross_entropy(logits[0, :4], labels[0, :4])
    assert torch.allclose(loss, ref)
    assert torch.allclose(m.train()(tokens, labels)[1], ref)  # the chunked training head
    with pytest.raises(ValueError, match="exceeds max_seq_len=64"):
        m(torch.zeros(1, 65, dtype=torch.long))


def test_invalid_config_lists_every_problem():
    with pytest.raises(ValueError) as e:
        Transformer(ModelArgs(dim=66, n_layers=1, n_heads=4, n_kv_heads=3, vocab_size=10))
    assert "not divisible by n_heads=4" in str(e.value) and "n_kv_heads=3" in str(e.value)


def test_presets_sizes_and_flops():
    sizes = {}
    for name, args in PRESETS.items():
        with torch.device("meta"):
            m = Transformer(args)
        sizes[name] = m.num_params()
        # 6N dominates the FLOP count; attention adds 12 L d T
        n_body = m.num_params(non_embedding=True) - m.output.weight.numel()
        expect = 6 * n_body + 6 * args.vocab_size * args.dim + 12 * args.n_layers * args.dim * 1024
        assert m.flops_per_token(1024) == expect
    assert 20e6 < sizes["25m"] < 30e6
    assert 110e6 < sizes["125m"] < 140e6
    assert 1.0e9 < sizes["1b"] < 1.2e9
    assert 6.6e9 < sizes["7b"] < 6.8e9  # LLaMA-2 7B: 6.74B
