"""Muon (Newton-Schulz-orthogonalised momentum) for the hidden matrices, AdamW for the rest, the same
arithmetic in both trainers.

The split: every 2-D weight inside a transformer block (attention wq/wk/wv/wo, feed-forward w1/w2/w3)
gets Muon; the token embedding, the norms and the output head get AdamW (Muon is defined for hidden
linear maps, not for lookup tables or the logits layer). `train_deepspeed.py` runs DeepSpeed's own Muon
(`"optimizer": {"type": "Muon"}`, parameters tagged `use_muon`); `train_ddp.py` runs DeepSpeed's
`MuonWithAuxAdam` itself over the full parameters, the class DeepSpeed's ZeRO-0 engine uses, so both
call the same `muon_update` (momentum, Nesterov blend, Newton-Schulz) and the same torch AdamW. The
parameter groups are DeepSpeed's (engine._muon_param_groups): each of our AdamW groups (decay / no
decay) split into its Muon half and its AdamW half, in that order.

The Newton-Schulz iteration's precision is decided here (ns_dtype), the same in both trainers, not
left to DeepSpeed, which takes it from its accelerator's capability flags: fp16 wherever torch's oneDNN
has fp16 (an Intel Xeon with AVX512-FP16), fp32 elsewhere (an AMD EPYC), so one CPU run would give
other numbers on another CPU model.

MUON, at the end, is its record (spec.py): its flags and refusals, its DeepSpeed entry (fill_ds_config),
its state (one momentum buffer per matrix) and what ZeRO-3 moves for it (comm_extras).
"""

import re

import torch

from llama_train.errors import ConfigError
from llama_train.model import param_numels
from llama_train.optim.adamw import param_groups
from llama_train.optim.spec import OptimizerSpec, State

HIDDEN = re.compile(r"(^|\.)layers\.\d+\.")  # inside a block, also under a wrapper's `module.` prefix

# Newton-Schulz precision by device type and method (ds_config "ns_method"). GPUs: DeepSpeed's own
# choices: fp16 for the Gram iteration (normalised in fp32 first, restarted at iteration 2: fp16 keeps
# more mantissa than bf16 at the same speed), bf16 for the standard one, which casts before it
# normalises (a loss-scaled gradient would overflow fp16). Every CPU: fp32 for both, so a CPU run
# computes the same on every CPU model and the twins' parity holds at fp32's tolerance
# (tests/test_optimizers.py reads its tolerance from ns_dtype("cpu")).
NS_DTYPE = {"cuda": {"gram": torch.float16, "standard": torch.bfloat16}}


def uses_muon(name: str, shape: torch.Size) -> bool:
    """A hidden matrix: 2-D (its full `shape`) and inside a transformer block (`layers.N.attention.*` /
    `feed_forward.*`)."""
    return len(shape) == 2 and HIDDEN.search(name) is not None


def numel(args) -> int:
    """Parameters Muon steps (uses_muon: the blocks' matrices), from the ModelArgs, without a model."""
    D, F, kv = args.dim, args.ffn_hidden_dim, args.kv_heads * args.head_dim
    return args.n_layers * (2 * D * D + 2 * D * kv + 3 * F * D)


def ns_dtype(device_type: str, ns_method: str = "gram") -> torch.dtype:
    """The dtype Muon's Newton-Schulz iteration `ns_method` ("gram", "standard") runs in on `device_type`
    ("cuda", "cpu", ...)."""
    by_method = NS_DTYPE.get(device_type, {})
    return by_method.get("gram" if ns_method == "gram" else "standard", torch.float32)


def pin_ns_dtype(device_type: str) -> torch.dtype:
    """Make DeepSpeed's Newton-Schulz run in ns_dtype(device_type, method), for both trainers (the DDP twin
    calls DeepSpeed's muon_update too). DeepSpeed 0.19.8's iterations ask
    deepspeed/runtime/zero/muon/original_muon.py's `ns_compute_dtype(method)` at every call, which reads
    the accelerator's is_fp16_supported / is_bf16_supported; the module attribute is replaced, so every
    caller (ZeRO-0's MuonWithAuxAdam, ZeRO-1/2/3's optimizers) sees ours, per method. Returns the
    Gram iteration's (the default method). tests/test_optimizers.py notices when DeepSpeed moves or
    stops reading that function."""
    from deepspeed.runtime.zero.muon import original_muon

    def ns_compute_dtype(ns_method: str = "gram") -> torch.dtype:
        return ns_dtype(device_type, ns_method)

    current = original_muon.ns_compute_dtype
    ns_compute_dtype.original = getattr(current, "original", current)  # DeepSpeed's own, for the tests
    original_muon.ns_compute_dtype = ns_compute_dtype
    return ns_dtype(device_type)


def tag(model: torch.nn.Module):
    """Set `use_muon` on every parameter, the attribute DeepSpeed's Muon and ZeRO optimizers read.
    DeepSpeed 0.19.8's deepspeed.initialize tags it itself first, by name (every 2-D parameter whose
    name lacks "embed" or "lm_head"), which would give our output head (`output.weight`) Muon, unlike
    the DDP twin: ds_compat.keep_our_split runs this after it."""
    for name, p in model.named_parameters():
        p.use_muon = uses_muon(name, p.shape)


def split_groups(groups: list[dict], muon: dict, adam: dict) -> list[dict]:
    """Each AdamW group (llama_train.optim.adamw.param_groups) as its Muon half then its AdamW half, with
    `muon` / `adam` settings and the group's own weight decay: what DeepSpeed builds from the same
    groups (engine._muon_param_groups, one name per half), so the twins hold the same groups."""
    out = []
    for index, group in enumerate(groups):
        for use_muon, label, settings in ((True, "muon", muon), (False, "adam", adam)):
            half = [p for p in group["params"] if p.requires_grad and bool(p.use_muon) is use_muon]
            if half:
                name = f"group{index}-{label}-params" if len(groups) > 1 else f"{label}-params"
                wd = {"weight_decay": group["weight_decay"]}
                out.append(dict(params=half, use_muon=use_muon, name=name, **settings, **wd))
    return out


def muon_settings(args) -> dict:
    """The Muon half's hyper-parameters from the flags (DeepSpeed: optimizer.params muon_lr, momentum)."""
    return {"lr": args.muon_lr, "momentum": args.muon_momentum}


def adam_settings(args) -> dict:
    """The AdamW half's (DeepSpeed: optimizer.params adam_lr, betas, eps)."""
    return {"lr": args.learning_rate, "betas": (args.beta1, args.beta2), "eps": args.adam_eps}


def build_muon(model: torch.nn.Module, groups: list[dict], args) -> torch.optim.Optimizer:
    """The DDP trainer's Muon: DeepSpeed's MuonWithAuxAdam over `groups` (our AdamW groups), its AdamW
    half torch's non-fused AdamW, as DeepSpeed builds it for `"torch_adam": true`."""
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    class SkippingMuon(MuonWithAuxAdam):
        """Skips the whole update when `found_inf` (set by DDPEngine.step, train/engines/torch_engine.py, as for fused AdamW) is
        non-zero. Unlike fused AdamW it decides on the host: one sync per step."""

        found_inf = None

        @torch.no_grad()
        def step(self, closure=None):
            if self.found_inf is not None and bool(self.found_inf):
                return None
            return super().step(closure)

    tag(model)
    pin_ns_dtype(next(model.parameters()).device.type)
    halves = split_groups(groups, muon_settings(args), adam_settings(args))
    return SkippingMuon(halves, adam_optimizer=torch.optim.AdamW, adam_optimizer_kwargs={"foreach": None})


def add_flags(g):
    g.add_argument(
        "--muon_lr",
        type=float,
        default=0.02,
        help="peak LR of the Muon half (modded-nanogpt's 0.02-0.05 range)",
    )
    g.add_argument("--muon_momentum", type=float, default=0.95, help="Muon's momentum (Nesterov)")


def problems(args) -> list[str]:
    """Its flags' values, and the layouts it refuses when chosen (whole matrices are orthogonalised)."""
    out = []
    if args.muon_lr <= 0 or not 0 <= args.muon_momentum < 1:
        out.append(
            f"--muon_lr must be > 0 and --muon_momentum in [0, 1), got {args.muon_lr}, {args.muon_momentum}"
        )
    unsharded = {
        "--fsdp": getattr(args, "fsdp", False),
        "--pipeline_parallel_size": getattr(args, "pipeline_parallel_size", 1) > 1,
    }
    return out + [
        f"--optimizer muon with {flag}: not supported (Muon orthogonalises whole matrices; this layout splits "
        "them and nothing gathers them for it); use DDP or train_deepspeed.py with ZeRO-0..3"
        for flag, on in unsharded.items()
        if args.optimizer == "muon" and on
    ]


def ds_params(args) -> dict:
    """DeepSpeed's names for the Muon half's settings (optimizer.params muon_lr, momentum)."""
    return {"muon_lr": args.muon_lr, "momentum": args.muon_momentum}


def fill_ds_config(config: dict, stage: int, source: str):
    """What DeepSpeed 0.19.8's Muon can do, decided before any work (in place): tensor parallel and
    clipping at ZeRO-1/2/3 (which clips the orthogonalised update) are refused; ZeRO-3 needs
    "zero_optimization.reduce_scatter": false (stage3.py raises "Muon and reduce scatter cannot be used
    together"): set where the config leaves it open, refused where it says true."""
    if (config.get("tensor_parallel") or {}).get("autotp_size", 1) > 1:
        raise ConfigError(
            f'{source}: "tensor_parallel.autotp_size" > 1 with --optimizer muon: Muon would orthogonalise each rank\'s '
            "shard of a matrix, not the matrix; use ZeRO-0..3 without tensor parallel"
        )
    if config.get("gradient_clipping", 0) > 0 and stage > 0:
        raise ConfigError(
            f'--grad_clip {config["gradient_clipping"]} (ds_config "gradient_clipping") with --optimizer muon at ZeRO '
            f"stage {stage}: DeepSpeed 0.19.8's ZeRO optimizers clip the orthogonalised Muon update, "
            "whose norm is ~sqrt(rows) per matrix, so every Muon step would shrink ~10-100x (ZeRO-0 and DDP clip the "
            "raw gradient instead); pass --grad_clip 0 (the default with muon: the update is norm-bounded already)"
        )
    if stage != 3:
        return
    zero = config["zero_optimization"]
    if zero.get("reduce_scatter", "auto") == "auto":
        zero["reduce_scatter"] = False
    elif zero["reduce_scatter"]:
        raise ConfigError(
            f'{source}: "zero_optimization.reduce_scatter" is true, which DeepSpeed\'s ZeRO-3 Muon cannot do '
            '(it orthogonalises full gradients, gathered instead of reduce-scattered); set it to false or "auto"'
        )


GATHERS = (
    "ZeRO-3 Muon gathers each Muon matrix whole: its gradient and momentum partitions (2 M), then, for each "
    "reduce bucket's Muon matrices in rounds of one a rank, the orthogonalised update and the momentum back, "
    "world x the round's largest matrix each ({rounds:,} elements; 2 M when every round is full and "
    "same-shaped; M = {m:,} Muon parameters)"
)


def round_numel(args, bucket: float, world: int) -> int:
    """Elements ZeRO-3 Muon gathers back a step, as DeepSpeed 0.19.8's `_muon_update_sub_group` runs
    once per reduce bucket: the parameters fill buckets in backward order (a bucket is reduced before
    a parameter that would overflow it), each bucket's Muon matrices (the blocks' wq .. w3), largest
    first, go in rounds of `world`, and a round gathers update and momentum at world x its largest."""
    numels = param_numels(args)
    muon = [False] + [i < 7 for _ in range(args.n_layers) for i in range(9)]
    muon += [False] * (len(numels) - len(muon))  # the final norm, an untied output head
    groups, held = [[]], 0
    for n, is_muon in zip(reversed(numels), reversed(muon)):
        if held and held + n > bucket:
            groups, held = [*groups, []], 0
        held += n
        groups[-1] += [n] * is_muon
    groups = [sorted(g, reverse=True) for g in groups]  # DeepSpeed orders a bucket's matrices by size
    return sum(2 * world * g[i] for g in groups for i in range(0, len(g), world))


def comm_extras(stage: int, world: int, grad_bytes: int, args, bucket: float) -> list:
    """(why, bytes) DeepSpeed 0.19.8's Muon adds per step: ZeRO-3's gathers (docs/optimizers.md: traced on
    the debug preset, 2 ranks, this formula's figure with dim² buckets; an upper bound with larger ones);
    ZeRO-1/2 all-reduce whole gradients already, and DDP / ZeRO-0 hold them: nothing."""
    taken = numel(args)
    if not taken or world <= 1 or stage != 3:
        return []
    rounds = round_numel(args, bucket, world)
    return [(GATHERS.format(rounds=rounds, m=taken), (2 * taken + rounds) * grad_bytes)]


MUON = OptimizerSpec(
    name="muon",
    title="Muon",
    help="Newton-Schulz-orthogonalised momentum (DeepSpeed's Muon, the same update in train_ddp.py) for the "
    "2-D weights inside the blocks, AdamW at --learning_rate for embeddings, norms and the output head.",
    ds_type="Muon",
    build=lambda model, args: build_muon(
        model, param_groups(model, args.weight_decay, args.decay_all_params), args
    ),
    # one fp32 momentum buffer per matrix, whole-matrix under ZeRO-1/2 (get_flat_partition), no step count
    state=State(("momentum_buffer",), bytes=4, whole_under_zero=True),
    carries="AdamW moments, Muon momentum",
    grad_clip=0.0,
    grad_clip_why="its update is norm-bounded by construction; DeepSpeed's ZeRO-1/2/3 Muon would clip the update "
    "itself",
    takes=uses_muon,
    numel=numel,
    claims=lambda group: bool(group.get("use_muon")),
    tag=tag,
    prepare=pin_ns_dtype,
    add_flags=add_flags,
    problems=problems,
    ds_params=ds_params,
    fill_ds_config=fill_ds_config,
    comm_extras=comm_extras,
    offload_moves="the strategy-neutral form does not read or write an offloaded Muon momentum",
)
