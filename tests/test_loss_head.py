"""The chunked loss head against F.cross_entropy on the full logits: the loss and every parameter's
gradient (fp32, relative 1e-5), with ignored labels, tied embeddings, gradient checkpointing and
chunks that do not divide the token count. In-process and fast: no compilation here
(tests/test_compile.py runs the compiled trainers)."""

import pytest
import torch
import torch.nn.functional as F

from llama_train.model import (
    ChunkedCrossEntropy,
    ModelArgs,
    Transformer,
    _apply_rotary_emb_real,
    apply_rotary_emb,
    precompute_pos_cis,
    softmax_xent,
)

RTOL = 1e-5
ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, multiple_of=32, max_seq_len=64)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |b|: relative to the tensor's scale (elementwise ratios blow up near 0)."""
    return ((a - b).abs().max() / b.abs().max()).item()


def batch(args: ModelArgs, B: int = 3, T: int = 21, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, args.vocab_size, (B, T), generator=g)
    labels = torch.randint(0, args.vocab_size, (B, T), generator=g)
    labels[0, :5] = -100  # padding-like runs and scattered ignored targets
    labels[2, ::4] = -100
    return tokens, labels


@pytest.mark.parametrize("chunk", [1, 7, 16, 63, 64, 1000])
def test_chunked_cross_entropy_equals_full_logits(chunk):
    torch.manual_seed(0)
    N, D, V = 64, 24, 97
    h = torch.randn(N, D, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, D, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, V, (N,))
    y[::3] = -100
    ref = F.cross_entropy(h @ w.t(), y, ignore_index=-100)
    (2.5 * ref).backward()  # a non-unit incoming gradient, as under accumulation
    expect = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    loss = ChunkedCrossEntropy.apply(h, w, y, chunk, softmax_xent)
    (2.5 * loss).backward()
    assert abs(loss.item() - ref.item()) <= 1e-12 * ref.item()
    assert rel(h.grad, expect[0]) <= 1e-12 and rel(w.grad, expect[1]) <= 1e-12


@pytest.mark.parametrize(
    "name,overrides",
    [
        ("untied", {}),
        ("tied", {"tie_embeddings": True}),
        ("checkpointed", {"gradient_checkpointing": True}),
        ("math attention, chunk 5", {"use_flash_attn": False, "loss_chunk_tokens": 5}),
    ],
)
def test_model_loss_and_every_gradient_equal_full_logits(name, overrides):
    args = ModelArgs(**{**ARGS.to_dict(), **overrides})
    full_args = ModelArgs(**{**args.to_dict(), "loss_chunk_tokens": 0})
    torch.manual_seed(0)
    chunked, full = Transformer(args), Transformer(full_args)
    full.load_state_dict(chunked.state_dict())
    tokens, labels = batch(args)
    logits, loss = chunked(tokens, labels)
    assert logits is None  # training through the chunked head: the logits never exist
    ref_logits, ref = full(tokens, labels)
    assert torch.equal(ref, F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten(), ignore_index=-100))
    loss.backward()
    ref.backward()
    assert abs(loss.item() - ref.item()) <= RTOL * ref.item(), name
    grads = dict(full.named_parameters())
    for n, p in chunked.named_parameters():
        assert rel(p.grad, grads[n].grad) <= RTOL, f"{name}: {n}"


def test_eval_and_no_labels_still_return_logits():
    torch.manual_seed(0)
    m = Transformer(ARGS)
    tokens, labels = batch(ARGS)
    train_loss = m(tokens, labels)[1].item()
    m.eval()
    logits, loss = m(tokens, labels)  # eval mode: the full logits, and the same loss
    assert logits.shape == (*tokens.shape, ARGS.vocab_size) and logits.dtype == torch.float32
    assert abs(loss.item() - train_loss) <= RTOL * train_loss
    assert torch.equal(m(tokens), logits)
    m.train()
    with torch.no_grad():  # no gradient wanted (e.g. a forward-only probe): the full path as well
        assert m(tokens, labels)[0] is not None


def test_backward_twice_is_refused():
    h = torch.randn(8, 4, requires_grad=True)
    w = torch.randn(11, 4, requires_grad=True)
    loss = ChunkedCrossEntropy.apply(h, w, torch.randint(0, 11, (8,)), 3, softmax_xent)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="runs once"):
        loss.backward()


def test_loss_chunk_tokens_is_validated():
    with pytest.raises(ValueError, match="loss_chunk_tokens must be >= 0"):
        Transformer(ModelArgs(**{**ARGS.to_dict(), "loss_chunk_tokens": -1}))


def test_real_rotary_is_the_complex_rotation_bit_for_bit():
    """The form compiled blocks use (inductor has no complex kernels) against the eager one."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 9, 4, 16), torch.randn(2, 9, 2, 16)
    pos_cis = precompute_pos_cis(16, 9, theta=500000.0)
    for ours, eager in zip(_apply_rotary_emb_real(q, k, pos_cis), apply_rotary_emb(q, k, pos_cis)):
        assert torch.equal(ours, eager)


def fp16_head_errors(autocast: bool) -> dict[str, float]:
    """The chunked head's gradients in fp16 under a 2^16 loss scale, against fp32 F.cross_entropy on the
    same (fp16-representable) inputs, at sizes where d loss / d logits falls below fp16's range
    (8,192 tokens, vocab 4,096): relative error (norm of the difference over the reference's norm) of
    grad_h, grad_w, and grad_w's rows that no token targets (only the softmax part pushes them).
    autocast False: fp16 weights, as DeepSpeed's fp16 engine holds them; True: fp32 weights under
    fp16 autocast, as the DDP twin trains."""
    torch.manual_seed(0)
    N, D, V, scale = 8192, 32, 4096, 2.0**16
    h32 = torch.randn(N, D).half().float()
    w32 = (0.02 * torch.randn(V, D)).half().float()
    y = torch.randint(0, V, (N,))
    ref_h, ref_w = h32.clone().requires_grad_(), w32.clone().requires_grad_()
    F.cross_entropy(ref_h @ ref_w.t(), y).backward()
    dtype = torch.float32 if autocast else torch.float16
    h, w = h32.to(dtype).requires_grad_(), w32.to(dtype).requires_grad_()
    with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
        loss = ChunkedCrossEntropy.apply(h, w, y, 2048, softmax_xent)
    (loss * scale).backward()  # the loss scale arrives in backward, as fp16 training applies it
    gh, gw = h.grad.float() / scale, w.grad.float() / scale
    untargeted = torch.ones(V, dtype=torch.bool)
    untargeted[y] = False

    def err(a, b):
        return ((a - b).norm() / b.norm()).item()

    return {
        "grad_h": err(gh, ref_h.grad),
        "grad_w": err(gw, ref_w.grad),
        "untargeted rows": err(gw[untargeted], ref_w.grad[untargeted]),
    }


@pytest.mark.parametrize("autocast", [False, True], ids=["fp16 weights", "fp16 autocast"])
def test_fp16_gradients_survive_until_the_loss_scale_arrives(autocast):
    """d loss / d logits is (softmax - onehot) / n_valid: about 1e-8 here, below fp16's smallest
    subnormal, so a head that forms it (or grad_h, grad_w) in fp16 before backward's loss scale
    flushes it to zero and the untargeted output rows get no gradient at all."""
    errors = fp16_head_errors(autocast)
    assert all(e < 0.02 for e in errors.values()), errors
