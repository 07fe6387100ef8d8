"""LLaMA in plain PyTorch: the trainable form of Meta's reference `llama/model.py`.

Names follow Meta's reference (ModelArgs, RMSNorm, precompute_pos_cis, apply_rotary_emb,
repeat_kv, Attention, FeedForward, TransformerBlock, Transformer; wq/wk/wv/wo, w1/w2/w3,
attention_norm, ffn_norm, tok_embeddings, output) so a diff against it stays meaningful.
Trainable form as in torchtitan: no KV cache, the rotary table is a non-persistent complex
buffer `pos_cis` computed in fp32, and an explicit `init_weights()`.

Packed documents (--document_mask): `forward(..., position_ids=...)` takes each token's position in
its own document and keeps attention and rotary positions inside each document (`document_mask`:
an SDPA boolean mask on CPU, a FlexAttention block mask on CUDA).

This file imports only torch: no distributed code, no device placement.
Labels are pre-shifted by the data pipeline: `labels[:, t]` is the token that follows
`input_ids[:, t]`, so `forward` does not shift them.
"""

import functools
import math
import warnings
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torch.utils.checkpoint import checkpoint


@dataclass
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None = n_heads (MHA); fewer = grouped-query attention
    vocab_size: int = 32000
    multiple_of: int = 256  # SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048  # length of the rotary table; longer inputs are an error
    tie_embeddings: bool = False  # share tok_embeddings and output weights
    use_flash_attn: bool = True  # SDPA (FlashAttention kernels on GPU) vs explicit math
    gradient_checkpointing: bool = False  # recompute each block in backward to save memory
    # with gradient_checkpointing: recompute every k-th block only (blocks 0, k, 2k, ...): 2 saves about
    # half the activation memory for half the recompute (selective checkpointing); 1: every block
    checkpoint_every: int = 1
    # training loss head: logits and their gradient for this many tokens at a time, never the full
    # (tokens, vocab) fp32 logits (0: full logits + F.cross_entropy). 2048: on an H200 7% over full
    # logits where 256 cost 48%, 3.1 GiB less at 125m 8 x 1024; on CPU the size does not change speed
    # (docs/performance.md)
    loss_chunk_tokens: int = 2048

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_heads, or n_heads when it is None (decided here, at use, so that
        overriding n_heads on a multi-head preset keeps it multi-head)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def problems(self) -> list[str]:
        """Every inconsistency at once, so a user fixes them in one go."""
        out = []
        if self.dim % self.n_heads:
            out.append(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        elif self.head_dim % 2:
            out.append(f"head_dim={self.head_dim} (dim/n_heads) must be even for rotary embeddings")
        if self.kv_heads <= 0 or self.n_heads % self.kv_heads:
            out.append(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.kv_heads}")
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "max_seq_len"):
            if getattr(self, name) <= 0:
                out.append(f"{name} must be positive, got {getattr(self, name)}")
        if self.checkpoint_every < 1:
            out.append(f"checkpoint_every must be >= 1 (1: every block), got {self.checkpoint_every}")
        if self.loss_chunk_tokens < 0:
            out.append(f"loss_chunk_tokens must be >= 0 (0: full logits), got {self.loss_chunk_tokens}")
        return out

    def to_dict(self) -> dict:
        return asdict(self)

    def checkpointed(self, layer: int) -> bool:
        """Whether block `layer` is recomputed in backward (gradient_checkpointing, checkpoint_every)."""
        return self.gradient_checkpointing and layer % self.checkpoint_every == 0

    @property
    def checkpointed_layers(self) -> int:
        return sum(self.checkpointed(i) for i in range(self.n_layers))


# Named sizes. `debug` runs in seconds on a CPU; `tiny` is the `make demo` model; 25m/125m are the CPU benchmark models;
# 1b is TinyLlama's shape; 7b is LLaMA-2 7B.
PRESETS: dict[str, ModelArgs] = {
    "debug": ModelArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, multiple_of=32, max_seq_len=256
    ),
    "tiny": ModelArgs(dim=128, n_layers=4, n_heads=4, vocab_size=2048, multiple_of=64, max_seq_len=512),
    "25m": ModelArgs(dim=512, n_layers=5, n_heads=8, vocab_size=8192, max_seq_len=1024),
    "125m": ModelArgs(dim=768, n_layers=12, n_heads=12, vocab_size=32000, max_seq_len=2048),
    "1b": ModelArgs(dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, vocab_size=32000, max_seq_len=2048),
    "7b": ModelArgs(dim=4096, n_layers=32, n_heads=32, vocab_size=32000, max_seq_len=4096),
}


def preset(name: str, **overrides) -> ModelArgs:
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return replace(PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})


def param_numels(args: ModelArgs) -> list[int]:
    """Elements of each parameter of `Transformer(args)`, in its order (tests check it against the
    model), without building it."""
    D, F, kv, V = args.dim, args.ffn_hidden_dim, args.kv_heads * args.head_dim, args.vocab_size
    layer = [D * D, D * kv, D * kv, D * D, F * D, D * F, F * D, D, D]  # wq wk wv wo w1 w2 w3, 2 norms
    return [V * D, *layer * args.n_layers, D] + ([] if args.tie_embeddings else [V * D])


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        # normalise in fp32 for stability under bf16/fp16, as Meta's reference does
        return self._norm(x.float()).type_as(x) * self.weight


def precompute_pos_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    """The rotary table: e^(i t theta_k) for positions t < end (Meta's `precompute_freqs_cis`)."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    t = torch.arange(end, dtype=torch.float32)
    return torch.polar(torch.ones(end, dim // 2), torch.outer(t, freqs))  # complex64


def reshape_for_broadcast(pos_cis: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if pos_cis.ndim == 3:  # (B, T, hd/2): a table per row, positions restarting at each document
        return pos_cis[:, :, None]
    shape = [d if i in (1, x.ndim - 1) else 1 for i, d in enumerate(x.shape)]
    return pos_cis.view(*shape)


def apply_rotary_emb(xq, xk, pos_cis):
    # rotate pairs (x[2i], x[2i+1]) as complex numbers: Meta's interleaved layout
    if torch.compiler.is_compiling():
        return _apply_rotary_emb_real(xq, xk, pos_cis)
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    pos_cis = reshape_for_broadcast(pos_cis, xq_)
    xq_out = torch.view_as_real(xq_ * pos_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * pos_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def _apply_rotary_emb_real(xq, xk, pos_cis):
    """The same rotation in real arithmetic, (x0 + i x1)(c + i s) = (x0 c - x1 s) + i (x0 s + x1 c), bit
    for bit: inductor has no complex kernels, and this form it fuses into one loop (eager, the complex
    multiply is 4x faster than these separate element-wise ops)."""
    table = pos_cis if pos_cis.ndim == 3 else pos_cis[None]  # (B or 1, T, head_dim / 2)
    cs = torch.view_as_real(table)[:, :, None]  # (B or 1, T, 1, head_dim / 2, [cos, sin])
    c, s = cs[..., 0], cs[..., 1]

    def rotate(x):
        x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
        return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(3).type_as(x)

    return rotate(xq), rotate(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, T, n_kv_heads, hd) -> (B, T, n_kv_heads * n_rep, hd)."""
    if n_rep == 1:
        return x
    B, T, n_kv, hd = x.shape
    return x[:, :, :, None, :].expand(B, T, n_kv, n_rep, hd).reshape(B, T, n_kv * n_rep, hd)


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) positions within each token's document -> (B, T) document numbers: a new document
    wherever the position restarts at 0 (transformers reads packed rows the same way)."""
    return (position_ids == 0).cumsum(-1)


def document_mask(position_ids: torch.Tensor, fused: bool):
    """Causal attention confined to each token's own document of a packed row. `fused`: a
    FlexAttention BlockMask, whose kernel skips the blocks masked whole (the GPU path); else a
    boolean (B, 1, T, T) mask for SDPA, exact on any device."""
    doc = document_ids(position_ids)
    B, T = doc.shape
    if fused:

        def same_document(b, h, q, kv):
            return (doc[b, q] == doc[b, kv]) & (kv <= q)

        return document_block_mask(doc, same_document)
    causal = torch.ones(T, T, dtype=torch.bool, device=doc.device).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


def document_block_mask(doc: torch.Tensor, mask_mod, block: int = 128) -> BlockMask:
    """The BlockMask of causal attention within documents, from each `block`-token block's first and
    last document number (`doc`: (B, T), non-decreasing along a row), in O(B x (T / block)^2): what
    create_block_mask(mask_mod, ...) gives, without evaluating mask_mod on every (row, query, key)
    element (uncompiled, it holds ~11 bytes an element each forward: +713 MiB at B=4, T=4096).
    A key block before a query block holds some allowed pair iff its last document is the query
    block's first, all of them iff both blocks lie whole in that one document; a diagonal block is
    causal, so partial; a block the row's end cuts short is never full."""
    B, T = doc.shape
    n = -(-T // block)
    first = doc[:, ::block]  # (B, n)
    last = doc[:, torch.clamp(torch.arange(1, n + 1, device=doc.device) * block, max=T) - 1]
    i = torch.arange(n, device=doc.device)
    below, whole = i[None, :] < i[:, None], (i + 1) * block <= T  # key block j before query block i
    shared = last[:, None, :] == first[:, :, None]  # (B, i, j): j's last document is i's first
    one = first[:, None, :] == last[:, :, None]  # j's first document is i's last: one document for both
    full = below & one & whole[:, None] & whole[None, :]
    partial = ((below & shared) | (i[None, :] == i[:, None])) & ~full
    return BlockMask.from_kv_blocks(
        *_ordered(partial[:, None]), *_ordered(full[:, None]), block, mask_mod, seq_lengths=(T, T)
    )


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H, Q blocks, KV blocks) booleans -> BlockMask's (count, indices): each query block's key
    blocks, the marked ones first in ascending order."""
    count = blocks.sum(-1, dtype=torch.int32)
    order = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True)
    return count, order.to(torch.int32)


@functools.cache
def fused_flex_attention():
    """flex_attention compiled once: uncompiled it runs an unfused reference that holds every score."""
    return torch.compile(flex_attention, dynamic=False)


class CoreAttention(nn.Module):
    """Causal attention of queries (B, T, H, hd) over keys/values (B, T, H_kv, hd) -> (B, T, H, hd).
    No weights: a module of its own so that parallelism applied from outside can wrap it (Ulysses
    sequence parallel gives it the whole sequence for a share of the heads). `mask`: None (causal
    over the whole row) or `document_mask`'s (causal within each document)."""

    def __init__(self, n_rep: int, use_flash_attn: bool):
        super().__init__()
        self.n_rep, self.use_flash_attn = n_rep, use_flash_attn

    def forward(self, xq: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor, mask=None) -> torch.Tensor:
        T = xq.shape[1]
        if self.use_flash_attn:  # SDPA shares each kv head among its query heads itself (no copies)
            xq, xk, xv = (t.transpose(1, 2) for t in (xq, xk, xv))  # (B, H, T, hd)
            gqa = self.n_rep > 1
            if mask is None:
                out = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True, enable_gqa=gqa)
            elif isinstance(mask, BlockMask):
                out = fused_flex_attention()(xq, xk, xv, block_mask=mask, enable_gqa=gqa)
            else:
                out = F.scaled_dot_product_attention(xq, xk, xv, attn_mask=mask, enable_gqa=gqa)
        else:
            xk, xv = repeat_kv(xk, self.n_rep), repeat_kv(xv, self.n_rep)
            xq, xk, xv = (t.transpose(1, 2) for t in (xq, xk, xv))  # (B, H, T, hd)
            scores = (xq @ xk.transpose(2, 3)) / math.sqrt(xq.shape[-1])
            if mask is None:
                mask = torch.full((T, T), float("-inf"), device=xq.device).triu(1)
            else:
                mask = torch.zeros(mask.shape, device=xq.device).masked_fill(~mask, float("-inf"))
            scores = F.softmax((scores + mask).float(), dim=-1).type_as(xq)
            out = scores @ xv
        return out.transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.core = CoreAttention(self.n_heads // self.n_kv_heads, args.use_flash_attn)

    def forward(self, x: torch.Tensor, pos_cis: torch.Tensor, mask=None) -> torch.Tensor:
        B, T, _ = x.shape
        # -1: the heads this module holds (all of them, or a tensor-parallel rank's share)
        xq = self.wq(x).view(B, T, -1, self.head_dim)
        xk = self.wk(x).view(B, T, -1, self.head_dim)
        xv = self.wv(x).view(B, T, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, pos_cis)
        return self.wo(self.core(xq, xk, xv, mask).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x, pos_cis, mask=None):
        h = x + self.attention(self.attention_norm(x), pos_cis, mask)
        return h + self.feed_forward(self.ffn_norm(h))


def softmax_xent(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor):
    """One chunk of the loss head: (sum of its token losses, d (summed loss) / d logits) for fp32 logits
    (chunk, vocab), labels (chunk,) and `valid` (chunk,): 1, 0 at ignored tokens. The gradient is
    (softmax - onehot) * valid, written over `logits`: values in [-1, 1], whatever the token count
    (ChunkedCrossEntropy divides by it later, in fp32)."""
    lse = torch.logsumexp(logits, dim=-1)
    target = labels.clamp(min=0)[:, None]  # ignored (-100) rows: any index, zeroed below
    loss = ((lse - logits.gather(1, target).squeeze(1)) * valid).sum()
    g = logits.sub_(lse[:, None]).exp_()
    g.scatter_add_(1, target, torch.full_like(target, -1.0, dtype=g.dtype))
    return loss, g.mul_(valid[:, None])


class ChunkedCrossEntropy(torch.autograd.Function):
    """mean cross_entropy(h @ weight.T, labels, ignore_index=-100) for h (N, dim), labels (N,),
    `chunk` tokens at a time, so at most (chunk, vocab) logits exist. Forward computes the gradients
    too, chunk by chunk, as Liger's fused linear cross-entropy does: g = d loss / d logits from
    `kernel` (softmax_xent, or its compiled form), grad_h = g @ weight, grad_weight += g.T @ h.
    Backward only scales them by the incoming gradient (once: nothing is kept to run it twice).
    No matmul is recomputed; the price is grad_weight (vocab x dim, fp32) allocated in forward.
    Logits, loss and the kept gradients are fp32 (fp64 for fp64 inputs).

    fp16: the gradients are formed before backward brings the loss scale, and 1 / n_valid times a
    softmax entry (about 1e-9 at 8k tokens and a 32k vocab) is below fp16's smallest subnormal. So
    the GEMMs take g unscaled (in [-1, 1]), 1 / n_valid is applied in fp32, and grad_h and
    grad_weight stay fp32 until backward has multiplied in the incoming (loss-scaled) gradient: only
    then are they cast to the inputs' dtypes (tests/test_loss_head.py, fp16 against fp32)."""

    @staticmethod
    def forward(ctx, h, weight, labels, chunk: int, kernel):
        want_h, want_w = ctx.needs_input_grad[:2]
        acc = torch.promote_types(h.dtype, torch.float32)  # logits, loss and kept gradients: fp32 at least
        valid = (labels != -100).to(acc)
        n_valid = valid.sum()  # 0 gives nan, as F.cross_entropy does
        grad_h = torch.empty(h.shape, dtype=acc, device=h.device) if want_h else None
        grad_w, loss = None, torch.zeros((), dtype=acc, device=h.device)
        # accumulate grad_weight inside the GEMM (no temporary) unless autocast picks the GEMM's dtype
        in_gemm = h.dtype == weight.dtype == acc and not torch.is_autocast_enabled(h.device.type)
        for s in range(0, h.shape[0], chunk):
            hc = h[s : s + chunk]
            logits = F.linear(hc, weight).to(acc)  # (chunk, vocab): the only big buffer
            loss_c, g = kernel(logits, labels[s : s + chunk], valid[s : s + chunk])
            loss += loss_c
            g = g.to(hc.dtype)
            if want_h:
                grad_h[s : s + chunk] = g @ weight
            if want_w and grad_w is None:
                grad_w = (g.t() @ hc).to(acc)
            elif want_w:
                grad_w.addmm_(g.t(), hc) if in_gemm else grad_w.add_(g.t() @ hc)
        ctx.grads, ctx.dtypes, ctx.n_valid = (grad_h, grad_w), (h.dtype, weight.dtype), n_valid
        return loss / n_valid

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.grads is None:
            raise RuntimeError("ChunkedCrossEntropy's backward runs once (retain_graph is not supported)")
        grads, ctx.grads = ctx.grads, None
        scale = grad_loss / ctx.n_valid  # fp32: the loss scale and the mean over tokens together
        grad_h, grad_w = (None if g is None else g.mul_(scale).to(t) for g, t in zip(grads, ctx.dtypes))
        return grad_h, grad_w, None, None, None


class OutputHead(nn.Linear):
    """The output projection `output` (a Linear to state dicts, HF and DeepSpeed). With labels it
    returns the loss instead, through ChunkedCrossEntropy: inside this module's forward, so ZeRO-3
    has gathered its weight (a tied one too) as for any Linear. `kernel` is the per-chunk
    softmax / cross-entropy (llama_train.distributed.compile swaps in a compiled one)."""

    def __init__(self, dim: int, vocab_size: int, chunk: int):
        super().__init__(dim, vocab_size, bias=False)
        self.chunk, self.kernel = chunk, softmax_xent

    def forward(self, h: torch.Tensor, labels: torch.Tensor | None = None):
        if labels is None:
            return super().forward(h)
        h, labels = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
        return ChunkedCrossEntropy.apply(h, self.weight, labels, self.chunk, self.kernel)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of (B, T, vocab) logits against pre-shifted labels (ignore index -100):
    the full-logits loss of Transformer.forward and of a pipeline's last stage."""
    return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        if problems := args.problems():
            raise ValueError("invalid model config: " + "; ".join(problems))
        self.args = args
        device = torch.get_default_device()  # the CPU, or the caller's `with torch.device(...)`
        with torch.device("meta"):  # no storage yet, so no default init: init_weights() is the only one
            self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
            self.layers = nn.ModuleList(TransformerBlock(i, args) for i in range(args.n_layers))
            self.norm = RMSNorm(args.dim, eps=args.norm_eps)
            self.output = OutputHead(args.dim, args.vocab_size, args.loss_chunk_tokens)
        self.register_buffer("pos_cis", torch.empty(0, dtype=torch.complex64), persistent=False)  # below
        self.to_empty(device=device)  # 1b: 1.1B fp32 weights allocated once, initialised once
        if args.tie_embeddings:  # after to_empty, which gives each module its own tensor
            self.output.weight = self.tok_embeddings.weight
        # complex64 rotary table; non-persistent, so checkpoints carry only weights.
        # `.half()`/`.bfloat16()` leave complex buffers alone; DDP must be told to ignore it.
        pos_cis = precompute_pos_cis(args.head_dim, args.max_seq_len, args.rope_theta)
        self.register_buffer("pos_cis", pos_cis.to(device), persistent=False)
        self.init_weights()

    def _apply(self, fn, recurse=True):
        """`.to(torch.bfloat16)` (unlike `.bfloat16()`) casts complex buffers too, keeping only the
        real part: rotary would silently break. Whatever a cast did, the table stays fp32 complex."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Casting complex values to real")  # undone just below
            super()._apply(fn, recurse)
        if self.pos_cis.dtype != torch.complex64:
            table = precompute_pos_cis(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta)
            self.pos_cis = table.to(self.pos_cis.device)
        return self

    @torch.no_grad()
    def init_weights(self):
        """GPT-2 / nanoGPT init: N(0, 0.02), residual projections scaled by 1/sqrt(2 n_layers)."""
        std = 0.02
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("wo.weight", "w2.weight")):
                nn.init.normal_(p, mean=0.0, std=std / math.sqrt(2 * self.args.n_layers))
            else:
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ):
        """Logits (B, T, vocab) in fp32; with `labels`, also the mean cross-entropy.

        Returns `logits` alone, or `(logits, loss)` when labels are given (ignore index -100),
        as nanoGPT does. Training with labels (module in train mode, grad enabled) returns
        `(None, loss)` from the chunked loss head (`loss_chunk_tokens`), which never holds the
        full logits, as Liger's LLaMA does; eval mode and `loss_chunk_tokens=0` give both.

        `position_ids` (B, T): each token's position in its own document, 0 where a document of a
        packed row begins (the document boundaries): attention stays within each document and
        rotary positions restart with it. None: each row is one causal sequence.
        """
        T = input_ids.shape[1]
        if T > self.args.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len={self.args.max_seq_len}")
        h = self.tok_embeddings(input_ids)
        pos_cis, mask = self.pos_cis[:T], None
        if position_ids is not None:
            pos_cis = self.pos_cis[position_ids]  # (B, T, head_dim / 2): each token's own position
            mask = document_mask(position_ids, fused=h.is_cuda and self.args.use_flash_attn)
        for i, layer in enumerate(self.layers):
            if self.training and self.args.checkpointed(i):
                h = checkpoint(layer, h, pos_cis, mask, use_reentrant=False)
            else:
                h = layer(h, pos_cis, mask)
        h = self.norm(h)
        # a tensor-parallel run's output is AutoTP's own vocab-split Linear: the full-logits path below
        chunked = getattr(self.output, "chunk", 0)
        if labels is not None and chunked and self.training and torch.is_grad_enabled():
            return None, self.output(h, labels)
        logits = self.output(h).float()
        if labels is None:
            return logits
        return logits, causal_lm_loss(logits, labels)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count; `non_embedding` drops the input embedding (and a tied output)."""
        n = sum(p.numel() for p in self.parameters())  # a tied weight is counted once
        if non_embedding:
            n -= self.tok_embeddings.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """PaLM-style training FLOPs per token, forward + backward (PaLM paper, appendix B):
        6 N_nonembedding + 6 vocab dim (output layer) + 12 n_layers dim seq (attention)."""
        a = self.args
        n_body = self.num_params(non_embedding=True) - (0 if a.tie_embeddings else self.output.weight.numel())
        return 6 * n_body + 6 * a.vocab_size * a.dim + 12 * a.n_layers * a.dim * seq_len
