"""Load a ds_configs/*.json and finish it from the command line (`build_ds_config`: once, before
any work).

The JSON files hold engine knobs (ZeRO stage, offload, buckets); what the command line
decides -- batch sizes, accumulation, clipping, precision, optimizer hyper-parameters -- they
leave as "auto". `fill_ds_config` is the one place that fills them, and it refuses a config
whose explicit value contradicts the command line, naming the key and both values.
"""

import copy
import json
import os
import sys

from llama_train.errors import ConfigError
from llama_train.gpu import warn_cpu_adam_build
from llama_train.optim.registry import optimizer_spec


def load_ds_config(path: str) -> dict:
    if not os.path.isfile(path):
        known = (
            sorted(f for f in os.listdir("ds_configs") if f.endswith(".json"))
            if os.path.isdir("ds_configs")
            else []
        )
        raise ConfigError(
            f"DeepSpeed config {path!r} not found" + (f"; ds_configs/ has {known}" if known else "")
        )
    with open(path) as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: a DeepSpeed config must be a JSON object, got {type(config).__name__}")
    return config


def cli_values(
    *,
    micro_batch: int,
    accumulation: int,
    world_size: int,
    grad_clip: float,
    dtype: str,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    optimizer: str = "adamw",
    optimizer_params: dict | None = None,
) -> dict[str, object]:
    """What the command line decides, keyed by dotted config path. `optimizer`: --optimizer (its record
    names the "optimizer.type"); `optimizer_params`: its "optimizer.params" beyond AdamW's (ds_params)."""
    extra = {f"optimizer.params.{k}": v for k, v in (optimizer_params or {}).items()}
    return {
        "optimizer.type": optimizer_spec(optimizer).ds_type,
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": micro_batch * accumulation * world_size,
        "gradient_clipping": grad_clip,
        "bf16.enabled": dtype == "bfloat16",
        "fp16.enabled": dtype == "float16",
        "optimizer.params.lr": lr,
        "optimizer.params.betas": list(betas),
        "optimizer.params.eps": eps,
        "optimizer.params.weight_decay": weight_decay,
        **extra,
    }


def _lookup(config: dict, dotted: str):
    """(parent dict, key) for a dotted path, or (None, key) when a parent is absent."""
    *parents, key = dotted.split(".")
    node = config
    for p in parents:
        node = node.get(p)
        if not isinstance(node, dict):
            return None, key
    return node, key


def fill_ds_config(config: dict, values: dict[str, object], source: str = "ds_config") -> dict:
    """A copy of `config` with every "auto" (or missing top-level) value set from `values`.

    An explicit value that differs from the command line is an error naming the key, both
    values and the fix; all such conflicts are reported together.
    """
    config = copy.deepcopy(config)
    conflicts = []
    for dotted, want in values.items():
        parent, key = _lookup(config, dotted)
        if parent is None:
            continue  # e.g. no "fp16" section: that feature stays off
        have = parent.get(key, "auto")
        if have == "auto" or (dotted.endswith(".enabled") and have is False and want is False):
            parent[key] = want
        elif (
            have != want
            and not _same_name(have, want)
            and not (
                isinstance(have, int | float)
                and isinstance(want, int | float)
                and abs(have - want) <= 1e-12 * max(abs(want), 1)
            )
        ):
            conflicts.append(
                f'"{dotted}" is {have!r} in {source} but the command line gives {want!r}'
                f' (set it to "auto" or change the flag)'
            )
    if conflicts:
        raise ConfigError("DeepSpeed config contradicts the command line:\n  - " + "\n  - ".join(conflicts))
    if "train_batch_size" not in config:
        config["train_batch_size"] = values["train_batch_size"]
    _check_batch(config, source)
    _check_features(config, source)
    return config


def complete_sections(config: dict, dtype: str, source: str) -> dict:
    """A copy of `config` with the sections the flags decide present, so `fill_ds_config` fills
    them: without a `bf16` (`fp16`) block --dtype bfloat16 (float16) would train in fp32 while the
    run record, checkpoints and MFU say otherwise. An `optimizer` without `params` gets them.
    Without an `optimizer` the engine has none and dies in deepspeed.initialize, after the data
    build: `require_optimizer` refuses that, before any work."""
    config = copy.deepcopy(config)
    section = {"bfloat16": "bf16", "float16": "fp16"}.get(dtype)
    if section and not isinstance(config.get(section), dict):
        config[section] = {"enabled": "auto"}
    if isinstance(config.get("optimizer"), dict):
        config["optimizer"].setdefault("params", {})  # its hyper-parameters are the flags'
    return config


def require_optimizer(config: dict, source: str):
    optimizer = config.get("optimizer")
    if not isinstance(optimizer, dict) or not optimizer.get("type"):
        raise ConfigError(
            f'{source}: no "optimizer" block; the engine would be built without one. '
            'Add one as ds_configs/zero2.json has it ("type": "auto", filled from --optimizer; its "params" "auto")'
        )


def _same_name(have, want) -> bool:
    """DeepSpeed reads names (optimizer.type) case-insensitively: "adamw" is "AdamW"."""
    return isinstance(have, str) and isinstance(want, str) and have.lower() == want.lower()


def _check_features(config: dict, source: str):
    """Combinations DeepSpeed rejects late or silently ignores, refused up front."""
    stage = zero_stage(config)
    if offloads_params(config) and stage != 3:
        raise ConfigError(
            f"{source}: offload_param needs ZeRO stage 3 (parameters are only partitioned there), "
            f"got stage {stage}; use offload_optimizer, or stage 3"
        )
    if offloads_optimizer(config) and stage == 0:
        raise ConfigError(f"{source}: offload_optimizer needs ZeRO stage 1, 2 or 3, got stage 0")


def _check_batch(config: dict, source: str):
    micro = config["train_micro_batch_size_per_gpu"]
    acc = config["gradient_accumulation_steps"]
    total = config["train_batch_size"]
    if total % (micro * acc):
        raise ConfigError(
            f"{source}: train_batch_size={total} is not micro ({micro}) x accumulation ({acc}) x world"
        )


# DeepSpeed's own monitors would write a second copy of the scalars, under other names
MONITORS = {"tensorboard": "tensorboard", "wandb": "wandb", "csv_monitor": "csv", "comet": None}


def refuse_monitors(config: dict, source: str):
    """A ds_config that enables DeepSpeed's tensorboard / wandb / csv_monitor / comet block: refused with
    the --report_to value that writes the same (one writer per scalar, the same names as under DDP)."""
    for key, ours in MONITORS.items():
        block = config.get(key)
        if isinstance(block, dict) and block.get("enabled", False):
            fix = f"pass --report_to {ours} instead" if ours else "--report_to has no comet writer"
            raise ConfigError(
                f'{source}: "{key}" is enabled, so DeepSpeed would log the scalars a second time under its own '
                f"names; remove the block and {fix} (it writes the same names under DDP and DeepSpeed)"
            )


# pydantic model -> the ds_config section it validates, to name keys as the user wrote them
_SECTIONS = {
    "DeepSpeedZeroConfig": "zero_optimization",
    "DeepSpeedZeroOffloadOptimizerConfig": "zero_optimization.offload_optimizer",
    "DeepSpeedZeroOffloadParamConfig": "zero_optimization.offload_param",
    "DeepSpeedBF16Config": "bf16",
    "DeepSpeedFP16Config": "fp16",
    "DeepSpeedActivationCheckpointingConfig": "activation_checkpointing",
    "DeepSpeedFlopsProfilerConfig": "flops_profiler",
    "DeepSpeedCommsConfig": "comms_logger",
}


def _pydantic_line(e, source: str) -> str:
    """One line for a pydantic ValidationError: the key, the value given, what is allowed."""
    section = _SECTIONS.get(e.title, e.title)
    err = e.errors()[0]
    key = ".".join([section, *map(str, err["loc"])])
    expected = (err.get("ctx") or {}).get("expected")
    if expected:  # "0, 1, 2, 3 or 3" (DeepSpeed's stage enum has an alias): each allowed value once
        allowed = list(dict.fromkeys(v.strip() for v in expected.replace(" or ", ", ").split(", ")))
        what = f"allowed: {', '.join(allowed)}"
    else:
        what = err["msg"]
    more = f" (and {len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
    return f'{source}: "{key}" = {err.get("input")!r} is rejected by DeepSpeed: {what}{more}'


class BatchRanks:
    """The one thing DeepSpeedConfig asks an `mpu` for: how many data-parallel ranks the batch is
    split over (with sequence or pipeline parallelism fewer than the world size)."""

    def __init__(self, world: int):
        self.world = world

    def get_data_parallel_world_size(self) -> int:
        return self.world


def validate_with_deepspeed(config: dict, source: str, world: int):
    """The filled config through DeepSpeed's own DeepSpeedConfig (its pydantic models), before any
    tokenizer or data work: otherwise DeepSpeed rejects it only inside deepspeed.initialize, after
    the data cache was built, in a 30-line traceback. Its errors become one ConfigError line.
    `world`: the ranks the batch arithmetic counts (the one build_ds_config filled it for)."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from pydantic import ValidationError

    try:
        DeepSpeedConfig(copy.deepcopy(config), mpu=BatchRanks(world))
    except ValidationError as e:
        raise ConfigError(_pydantic_line(e, source)) from None
    except (AssertionError, ValueError, TypeError, KeyError) as e:  # DeepSpeed's own checks
        raise ConfigError(f"{source}: rejected by DeepSpeed: {e}") from None


def precision_defaults(stage: int, dtype: str) -> dict[str, str]:
    """The data types a bf16 run gets unless its config sets them ("auto" or absent): gradients
    accumulated and reduced in fp32, as under DDP's autocast. DeepSpeed's default is the model
    dtype, bf16, in which 32 accumulated micro-batches lose precision and the twins stop computing
    the same thing. ZeRO-0 cannot accumulate in fp32 (DeepSpeed raises NotImplementedError for a
    bf16 model with fp32 accumulation there), so it accumulates in bf16 and reduces in fp32."""
    if dtype != "bfloat16":
        return {}
    return {
        "communication_data_type": "fp32",
        "data_types.grad_accum_dtype": "fp32" if stage >= 1 else "bf16",
    }


def fill_precision(config: dict, dtype: str, accumulation: int) -> str | None:
    """Set `precision_defaults` where the config leaves them open (in place); a warning when a
    ZeRO-0 bf16 run accumulates several micro-batches in bf16, or None."""
    stage = zero_stage(config)
    for dotted, value in precision_defaults(stage, dtype).items():
        *parents, key = dotted.split(".")
        node = config
        for p in parents:
            node = node.setdefault(p, {})
        if node.get(key, "auto") == "auto":
            node[key] = value
    if stage == 0 and dtype == "bfloat16" and accumulation > 1:
        return (
            f"warning: ZeRO-0 with bf16 accumulates the {accumulation} micro-batches' gradients in bf16 "
            "(DeepSpeed supports fp32 accumulation only from ZeRO-1 on; DDP accumulates in fp32): "
            "ds_configs/zero1.json accumulates in fp32"
        )
    return None


def bucket_sizes(margs) -> dict[str, int]:
    """ZeRO's buffer sizes for the model `margs` (a ModelArgs), in elements. The reduce bucket holds
    the largest parameter (the embedding or output head, vocab x dim; else a SwiGLU matrix), so a
    ZeRO-1/2 micro-step issues a handful of reductions, each through DeepSpeed's Python path: 4 at the
    125m width with 2 layers, where transformers' dim x dim made one per matrix, 24 (DDP's C++ buckets:
    4); DeepSpeed's own 5e8 would hold a 125M-parameter model whole, for 1-2 GiB of buffers.
    ZeRO-3's prefetch bucket and persistence threshold follow transformers' integration (0.9 dim^2,
    10 dim). The planner counts what the buckets hold (plan/memory.py)."""
    dim = margs.dim
    largest = max(margs.vocab_size, margs.ffn_hidden_dim, dim) * dim
    return {
        "reduce_bucket_size": largest,
        "stage3_prefetch_bucket_size": int(0.9 * dim * dim),
        "stage3_param_persistence_threshold": 10 * dim,
    }


def speed_settings(dp: int, pipeline: bool = False) -> dict[str, object]:
    """Engine switches that only cost time here, by dotted key: overlap_comm only where there is
    something to overlap with, data-parallel peers (off, there is no device-wide synchronize after
    each micro-backward and no second bucket), on a GPU (a side stream) and on a CPU alike (which has
    no streams: ds_cpu makes ZeRO-1/2's all-reduces asynchronous), and not under pipeline
    parallelism, whose engine drives ZeRO-1's reductions itself; and DeepSpeed's throughput timer off
    (two device syncs a step; the step logger times steps). Applied where the config says "auto" or
    (the timer) says nothing."""
    return {"zero_optimization.overlap_comm": dp > 1 and not pipeline, "timers.throughput.enabled": False}


def fill_buckets(config: dict, margs) -> dict:
    """Set each `bucket_sizes` key that the config's zero_optimization says "auto" (in place); an
    explicit value wins, an absent one stays DeepSpeed's default."""
    zero = config.get("zero_optimization", {})
    for key, value in bucket_sizes(margs).items():
        if zero.get(key) == "auto":
            zero[key] = value
    return config


def fill_speed(config: dict, dp: int, pipeline: bool = False) -> dict:
    """`speed_settings` where the config leaves them open (in place): an "auto" overlap_comm, and the
    throughput timer unless the config has a "timers" block."""
    settings = speed_settings(dp, pipeline)
    zero = config.get("zero_optimization", {})
    if zero.get("overlap_comm") == "auto":
        zero["overlap_comm"] = settings["zero_optimization.overlap_comm"]
    if "timers" not in config:
        config["timers"] = {"throughput": {"enabled": settings["timers.throughput.enabled"]}}
    return config


def zero_stage(config: dict) -> int:
    return int(config.get("zero_optimization", {}).get("stage", 0))


def offloads_optimizer(config: dict) -> bool:
    return _offloads(config, "offload_optimizer")


def offloads_params(config: dict) -> bool:
    return _offloads(config, "offload_param")


def _offloads(config: dict, block: str) -> bool:
    device = (config.get("zero_optimization", {}).get(block) or {}).get("device", "none")
    return device not in (None, "none")


def build_ds_config(config: dict, args, margs, layout, dtype: str) -> dict:
    """The ds_config, finished once: `config` (read by load_ds_config) with every "auto" filled from
    the flags (contradictions refused), the buckets sized for the model, the switches that only cost
    time set for the data-parallel size and pipeline (speed_settings), the model-parallel and
    profiler sections set for `layout` (parallel.Layout), validated by DeepSpeed itself before any
    work. The dict returned is the one deepspeed.initialize gets, and the one the strategy is named
    from."""
    from llama_train.distributed.ds_compat import batch_world

    source, world, spec = args.deepspeed_config, batch_world(layout), optimizer_spec(args.optimizer)
    values = cli_values(
        micro_batch=args.batch_size,
        accumulation=args.accumulation_steps,
        world_size=world,
        grad_clip=args.grad_clip,
        dtype=dtype,
        lr=args.learning_rate,
        betas=(args.beta1, args.beta2),
        eps=args.adam_eps,
        weight_decay=args.weight_decay,
        optimizer=args.optimizer,
        optimizer_params=spec.ds_params(args),
    )
    config = fill_ds_config(complete_sections(config, dtype, source), values, source=source)
    require_optimizer(config, source)
    spec.fill_ds_config(config, zero_stage(config), source)  # what the optimizer needs or refuses
    fill_buckets(config, margs)
    fill_speed(config, layout.dp * layout.sp, layout.pp > 1)  # ZeRO reduces over data x sequence ranks
    refuse_monitors(config, source)
    fill_model_parallel(config, layout)
    note = fill_precision(config, dtype, args.accumulation_steps)
    if args.profile:
        fill_profiler(config, layout, args.profile_interval, args.output_dir)
    validate_with_deepspeed(config, source, world)  # what DeepSpeed itself rejects, before any work
    if note and os.environ.get("RANK", "0") == "0":
        print(note, file=sys.stderr, flush=True)
    if offloads_optimizer(config) and os.environ.get("LOCAL_RANK", "0") == "0":
        warn_cpu_adam_build()  # DeepSpeedCPUAdam is compiled on first use: say what a build would lack
    return config


# AutoTP layer specs for llama_train/model.py's module names (DeepSpeed has no policy for them:
# "Not able to determine model policy automatically"). Column: output rows split (a rank's heads,
# its share of the SwiGLU hidden units); row: input columns split, outputs summed (all-reduce).
# parallel.merge_tp_shards joins the shards along the same dimensions.
TP_LAYER_SPECS = [
    {
        "patterns": [r".*\.attention\.w[qkv]\.weight$", r".*\.feed_forward\.w[13]\.weight$"],
        "partition_type": "column",
    },
    {"patterns": [r".*\.attention\.wo\.weight$", r".*\.feed_forward\.w2\.weight$"], "partition_type": "row"},
    {"patterns": [r"^output\.weight$"], "partition_type": "column", "gather_output": True},
]


def fill_model_parallel(config: dict, layout):
    """Tensor parallel: our layer specs, which the engine shards the model by (unless the config
    brings its own partition_config). Sequence and pipeline parallel need no section."""
    if layout.tp > 1:
        tp = config.setdefault("tensor_parallel", {})
        tp.setdefault(
            "partition_config",
            {"use_default_specs": False, "strict_mode": True, "layer_specs": TP_LAYER_SPECS},
        )


PIPELINE_NO_FLOPS_PROFILE = (
    "warning: --profile with pipeline parallel writes the torch.profiler trace but not DeepSpeed's flops "
    "profile: with its timers on, DeepSpeed 0.19.8 starts the backward timer a second time on a pipeline "
    "stage's backward (runtime/engine.py _backward_prologue, called from the backward hook while "
    "runtime/pipe/engine.py _exec_backward_pass runs) and stops with 'bwd_microstep timer has already been started'"
)


def fill_profiler(config: dict, layout, step: int, output_dir: str):
    """--profile: DeepSpeed's flops profiler (per-module FLOPs and latency at one step); not on a
    pipeline stage (PIPELINE_NO_FLOPS_PROFILE, said once)."""
    if layout.pp > 1:
        if os.environ.get("RANK", "0") == "0":
            print(PIPELINE_NO_FLOPS_PROFILE, file=sys.stderr, flush=True)
        return
    config["flops_profiler"] = {
        "enabled": True,
        "profile_step": step,
        "module_depth": -1,
        "top_modules": 3,
        "detailed": True,
        "output_file": os.path.join(output_dir, "flops_profile.txt"),
    }
