"""One record per parallelism strategy: how it launches, which kinds of model state it shards, whether
a checkpoint continues natively or through the neutral form, what it communicates and what a rank
holds beyond the ZeRO paper's formula. The planner (plan/planner.py), the memory and communication
formulas (plan/memory.py, plan/comm.py), the resume decision (checkpoint/resuming.py), the run's records
and the benchmark (bench/) ask these records instead of matching names.

A strategy (`Strategy`: what scripts/benchmark.py and scripts/plan_memory.py name) runs on a kind of
engine (`EngineKind`: the trainer, its checkpoint files, how its gradients travel, its measured CPU
footprint) and shards the first `stage` kinds of STATE_KINDS over the data-parallel ranks, as ZeRO
counts them. A new strategy is one record in RECORDS; its twins (with --compile, with each other
--optimizer) follow from its flags.

A run's strategy is the same value, resolved once at start-up from the flags and the ds_config
(run_strategy) and passed down: its recorded name (Strategy.run_name), its checkpoints' form
(Strategy.form), the ZeRO stage the memory record and the probe read, the live engine's
(llama_train/train/engines/) `strategy`.
"""

from dataclasses import dataclass, field, replace

from llama_train.distributed.ds_config import offloads_optimizer, offloads_params, zero_stage
from llama_train.optim.adamw import ADAMW
from llama_train.optim.registry import OPTIMIZERS

MiB = 2**20
STATE_KINDS = ("optimizer", "grads", "params")  # ZeRO stage N shards the first N of these

# stage -> {collective: (multiplier of Psi, what is communicated)}: the ZeRO paper's bytes per step;
# DDP communicates as stage 0
PAPER_VOLUME = {
    0: {"all_reduce": (2, "grad")},  # all-reduce of the gradients = reduce-scatter + all-gather
    1: {"reduce_scatter": (1, "grad"), "all_gather": (1, "param")},  # gradients, then updated params
    2: {"reduce_scatter": (1, "grad"), "all_gather": (1, "param")},
    3: {"all_gather": (2, "param"), "reduce_scatter": (1, "grad")},  # params in forward and backward
}


@dataclass(frozen=True)
class EngineKind:
    """What every strategy of one kind of engine shares (the live engines: llama_train/train/engines/)."""

    name: str  # the `strategy` its runs record in metrics.jsonl and checkpoints (DeepSpeed's: its prefix)
    trainer: str  # the script that launches it
    # its checkpoints hold full state dicts, the same files at any world size: they continue natively
    # under any full-state engine; the others only in the form they were saved in (strategy, world
    # size, dtype, offload), through the neutral form (checkpoint/portable.py) elsewhere
    full_state: bool
    configured: bool  # by a ds_config (--deepspeed_config): its forms name both offloads, always
    fp32_comm: bool  # autocast keeps fp32 weights: gradients and parameters travel in fp32
    # Peak RSS per rank of a 2-rank fp32 CPU run of an (almost) empty model (preset debug with --dim 8
    # --n_heads 2 --n_layers 1: 9,240 parameters): Python, torch, transformers, the tokenizer and the
    # data pipeline, gloo, the start-up matmul that measures the CPU's peak; DeepSpeed adds its imports
    # and buffers, ZeRO-1..3 their optimizers' imports. By ZeRO stage, the last for every higher one.
    # Measured on the 2-core development machine.
    cpu_runtime: tuple[int, ...]
    # Heap a CPU rank keeps beyond its live tensors after the steps (ZeRO-2/3's bucketed reductions and
    # parameter gathers, FSDP2's per-unit gathers and reductions allocate and free gradient- and
    # parameter-sized buffers all step long; glibc keeps much of it), in units of the rank's fp32
    # partition (4P/N), by (stage, offload): the peak RSS of 2-rank fp32 runs of the 25m preset less
    # everything else plan/memory.py counts (docs/memory.md: 'What ZeRO costs, read together'; FSDP2, with or
    # without its offload: fitted the same way, checked on the tiny preset and on 25m with activation
    # checkpointing, docs/fsdp.md). At 2 ranks only, on CPU only; a GPU's caching allocator differs.
    cpu_heap: dict = field(default_factory=dict)

    def run_name(self, layout_name: str | None = None, stage: int = 0) -> str:
        """The `strategy` a run records: 'ddp', 'fsdp2'; DeepSpeed's names its layout and stage
        ('deepspeed-zero1', 'deepspeed-tp2-zero1')."""
        if not self.configured:
            return self.name
        return "-".join(filter(None, (self.name, layout_name, f"zero{stage}")))


DDP = EngineKind(
    "ddp", "train_ddp.py", full_state=True, configured=False, fp32_comm=True, cpu_runtime=(356 * MiB,)
)
FSDP2 = EngineKind(
    "fsdp2",
    "train_ddp.py",
    full_state=True,
    configured=False,
    fp32_comm=False,
    cpu_runtime=(360 * MiB,),
    cpu_heap={(3, False): 5.7, (3, True): 5.7},
)
DEEPSPEED = EngineKind(
    "deepspeed",
    "train_deepspeed.py",
    full_state=False,
    configured=True,
    fp32_comm=False,
    cpu_runtime=(394 * MiB, 430 * MiB),
    cpu_heap={(2, False): 1.4, (3, False): 3.8, (2, True): 3.75, (3, True): 4.7},
)
ENGINE_KINDS = (DDP, FSDP2, DEEPSPEED)


def kind_of(run_name: str | None) -> EngineKind | None:
    """The engine kind of a run's recorded `strategy` (Strategy.run_name); None when none is recorded."""
    for kind in ENGINE_KINDS:
        if run_name == kind.name or str(run_name).startswith(kind.name + "-"):
            return kind
    return None


@dataclass(frozen=True)
class Strategy:
    """One strategy's facts: its launch (engine, DeepSpeed config, flags), what it shards (`stage`,
    `offload`), and its place in the benchmark; for a run, resolved once (run_strategy)."""

    name: str  # scripts/benchmark.py --strategies NAME, scripts/plan_memory.py --strategies
    engine: EngineKind
    ds_config: str | None = None  # train_deepspeed.py --deepspeed_config, relative to the checkout
    flags: tuple[str, ...] = ()  # the trainer's flags that select it
    stage: int = 0  # STATE_KINDS[:stage] sharded (DeepSpeed's: its config's ZeRO stage, tested)
    offload: bool = False  # optimizer state in host memory (FSDP2's: parameters and gradients too)
    offload_params: bool = False  # parameters in host memory too (ZeRO-3's offload_param, FSDP2's offload)
    model_parallel: str | None = None  # a run's Layout.name (tp2, sp2, pp2), None for data parallelism alone
    default: bool = False  # in the benchmark's and the planner's default set
    compiled_twin: bool = False  # NAME_compiled: the same with --compile (ZeRO-3 refuses it)
    optimizer_twins: bool = False  # NAME_OPTIMIZER: the same with each other --optimizer

    @property
    def trainer(self) -> str:
        return self.engine.trainer

    @property
    def sharded(self) -> tuple[str, ...]:
        """The kinds of model state split over the data-parallel ranks; the rest every rank holds whole."""
        return STATE_KINDS[: self.stage]

    @property
    def paper_volume(self) -> dict:
        """Its communication per step as the ZeRO paper counts it (PAPER_VOLUME)."""
        return PAPER_VOLUME[self.stage]

    @property
    def run_name(self) -> str:
        """The `strategy` a run records in metrics.jsonl and its checkpoints: 'ddp', 'fsdp2',
        'deepspeed-zero1', 'deepspeed-tp2-zero1'."""
        return self.engine.run_name(self.model_parallel, self.stage)

    def form(self, world: int, dtype: str) -> dict:
        """What a checkpoint's files depend on (trainer_state.json's `layout`): the engine's own loader
        reads them only when all of it is unchanged; otherwise the state goes through the neutral form.
        A ds_config's runs name both offloads, the DDP trainer's only FSDP2's (parameters, gradients
        and AdamW state in host memory)."""
        offload = {"offload_optimizer": self.offload, "offload_params": self.offload_params}
        shown = self.engine.configured or any(offload.values())
        return {"strategy": self.run_name, "world_size": world, "dtype": dtype, **(offload if shown else {})}


def _zero(stage: int, config: str = "", **kw) -> Strategy:
    return Strategy(
        f"zero{stage}", DEEPSPEED, f"ds_configs/{config or f'zero{stage}'}.json", stage=stage, **kw
    )


# The records, in the benchmark's order; the default set first
RECORDS = (
    Strategy("ddp", DDP, default=True, compiled_twin=True, optimizer_twins=True),
    _zero(0, default=True, compiled_twin=True, optimizer_twins=True),
    _zero(1, default=True, compiled_twin=True, optimizer_twins=True),
    _zero(2, default=True, compiled_twin=True, optimizer_twins=True),
    _zero(3, default=True, optimizer_twins=True),
    replace(_zero(2, "zero2_offload"), name="zero2_offload", offload=True, default=True, compiled_twin=True),
    replace(_zero(3, "zero3_offload"), name="zero3_offload", offload=True, default=True),
    # torch's fully_shard in train_ddp.py: sharded like ZeRO-3, and with CPUOffloadPolicy
    Strategy("fsdp2", FSDP2, flags=("--fsdp",), stage=3, default=True, compiled_twin=True),
    Strategy(
        "fsdp2-offload",
        FSDP2,
        flags=("--fsdp", "--fsdp_offload"),
        stage=3,
        offload=True,
        offload_params=True,
        default=True,
    ),
    # opt-in: DDP without the unused-parameter search (the trainer's default), and with it (what it costs)
    Strategy("ddp_static", DDP, flags=("--no-find_unused_parameters",)),
    Strategy("ddp_unused", DDP, flags=("--find_unused_parameters",)),
    # opt-in, model parallel over 2 ranks (x data parallel over the rest): docs/parallelism.md
    replace(_zero(1, "tp2_zero1"), name="tp2"),  # AutoTP: heads and SwiGLU units split
    replace(_zero(1), name="sp2", flags=("--sequence_parallel_size", "2")),  # Ulysses: sequences split
    replace(_zero(1), name="pp2", flags=("--pipeline_parallel_size", "2")),  # two pipeline stages
)


def table() -> dict[str, Strategy]:
    """Every strategy by name: the records, then their twins with the trainers' --compile
    (scripts/benchmark.py --compile adds them), then their twins with each other --optimizer
    (llama_train/optim/registry.py: its state and what it moves)."""
    out = {s.name: s for s in RECORDS}
    twin = dict(default=False, compiled_twin=False, optimizer_twins=False)
    for s in RECORDS:
        if s.compiled_twin:
            out[f"{s.name}_compiled"] = replace(
                s, name=f"{s.name}_compiled", flags=(*s.flags, "--compile"), **twin
            )
    for optimizer in (o for o in OPTIMIZERS if o != ADAMW.name):
        for s in RECORDS:
            if s.optimizer_twins:
                flags = (*s.flags, "--optimizer", optimizer)
                out[f"{s.name}_{optimizer}"] = replace(s, name=f"{s.name}_{optimizer}", flags=flags, **twin)
    return out


STRATEGIES = table()
DEFAULT_STRATEGIES = [name for name, s in STRATEGIES.items() if s.default]


def run_strategy(
    ds_config: dict | None, model_parallel: str | None = None, fsdp: bool = False, fsdp_offload: bool = False
) -> Strategy:
    """A run's strategy, resolved once at start-up: the DeepSpeed trainer's from its filled `ds_config`
    (ZeRO stage, offloads) and layout name; the DDP trainer's (`ds_config` None) from --fsdp and
    --fsdp_offload."""
    if ds_config is None:
        name = ("fsdp2-offload" if fsdp_offload else "fsdp2") if fsdp else "ddp"
        return STRATEGIES[name]
    stage = zero_stage(ds_config)
    off = (offloads_optimizer(ds_config), offloads_params(ds_config))
    name = DEEPSPEED.run_name(model_parallel, stage)
    return Strategy(
        name, DEEPSPEED, stage=stage, offload=off[0], offload_params=off[1], model_parallel=model_parallel
    )
