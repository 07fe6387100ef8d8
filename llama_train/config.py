"""The command line both trainers share, validated in one place.

One parser for `train_deepspeed.py` and `train_ddp.py` so the two accept the same flags and
a run can be repeated under the other strategy by changing only the launcher. Every default
carries its reason. `parse_args` returns the namespace after `validate`, which reports every
problem at once.
"""

import argparse
import os

from llama_train.cli import HelpFormatter
from llama_train.console import quiet_console
from llama_train.distributed.fsdp import fsdp_problems
from llama_train.errors import ConfigError, DataSourceError
from llama_train.model import PRESETS, ModelArgs, preset
from llama_train.optim.adamw import ADAMW
from llama_train.optim.registry import OPTIMIZERS
from llama_train.telemetry.reporting import watch_problems
from utils.data import parse_mixture, task_problems

DTYPES = ("auto", "float32", "bfloat16", "float16")
# --probe_interval: one step in 10 is measured (timing.StepProbe); a probed step costs at most a few
# percent more than another (two device syncs, hooks, one small all-gather), so under 1% of the run
PROBE_INTERVAL = 10


def build_parser(description: str, deepspeed: bool = False) -> argparse.ArgumentParser:
    """Every flag of both trainers, group by group (one add_*_flags function each); `deepspeed` adds
    the DeepSpeed trainer's own."""
    p = argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)
    add_model_flags(p)
    add_data_flags(p)
    add_optimization_flags(p)
    add_optimizer_flags(p)
    add_logging_flags(p)
    add_checkpoint_flags(p)
    add_speed_flags(p)
    add_init_flags(p)
    add_distributed_flags(p)
    add_watch_flags(p)
    if deepspeed:
        add_deepspeed_flags(p)
    else:
        add_fsdp_flags(p)
    return p


def add_model_flags(p: argparse.ArgumentParser):
    """The model: a preset and the fields a flag may override (model_args applies them)."""
    g = p.add_argument_group("model (a preset, then per-field overrides)")
    g.add_argument(
        "--preset", default="25m", choices=sorted(PRESETS), help="named model size (llama_train/model.py)"
    )
    g.add_argument("--dim", type=int, help="hidden size (overrides the preset)")
    g.add_argument("--n_layers", type=int, help="number of transformer blocks")
    g.add_argument("--n_heads", type=int, help="attention heads; dim must divide by it")
    g.add_argument(
        "--n_kv_heads", type=int, help="key/value heads for grouped-query attention (default: n_heads)"
    )
    g.add_argument("--vocab_size", type=int, help="embedding rows; must be >= the tokenizer's vocab")
    g.add_argument(
        "--max_seq_len", type=int, default=256, help="tokens per training sequence (context length)"
    )
    g.add_argument("--tie_embeddings", action="store_true", help="share input embedding and output weights")
    g.add_argument(
        "--use_flash_attn",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="attention through torch SDPA (FlashAttention kernels on GPU); --no-use_flash_attn = explicit math",
    )
    g.add_argument(
        "--gradient_checkpointing", action="store_true", help="recompute blocks in backward to save memory"
    )
    g.add_argument(
        "--checkpoint_every",
        type=int,
        help="with --gradient_checkpointing: recompute every k-th block only (default 1: every block; 2: "
        "every other block, about half the activation memory saved for half the recomputation)",
    )
    g.add_argument(
        "--loss_chunk_tokens",
        type=int,
        help="the training loss head computes logits and their gradient this many tokens at a time, never "
        "the full (tokens, vocab) fp32 logits (default 2048; 0: full logits, fastest, most memory)",
    )


def add_data_flags(p: argparse.ArgumentParser):
    """Where the text comes from, how it is split, tokenized and cached."""
    g = p.add_argument_group("data")
    g.add_argument(
        "--data_path",
        nargs="+",
        default=["builtin"],
        help="sources: builtin, files/dirs/globs (.txt .jsonl .json .parquet), hf:NAME[:CONFIG][@ROWS][#COLUMN] "
        "(a Hub dataset's train split, its first ROWS rows, its COLUMN field: text by default), concatenated "
        "in order; or a weighted mixture WEIGHT SRC WEIGHT SRC ... (e.g. 0.7 builtin 0.3 code.jsonl: 70%% of "
        "the training tokens from builtin), sampled by --seed",
    )
    g.add_argument("--data_split", default="98,2", help="train,eval weights; documents are split, not tokens")
    g.add_argument(
        "--data_output_path", default="data_cache", help="cache for tokenized data and trained tokenizers"
    )
    g.add_argument(
        "--tokenizer", help="tokenizer dir or sentencepiece .model (default: train one on --data_path)"
    )
    g.add_argument("--seed", type=int, default=1234, help="seeds init, data split and shuffling")
    g.add_argument(
        "--document_mask",
        action="store_true",
        help="attention and rotary positions confined to each document packed into a row (a document starts "
        "at the EOS before it), as Llama 3 trains: on GPU a FlexAttention block mask, on CPU an exact SDPA mask. "
        "Off: a row is one causal sequence across its documents. docs/data.md 'Document masking (`--document_mask`)'",
    )
    g.add_argument(
        "--bos_aligned_rows",
        action="store_true",
        help="with --document_mask: every row is BOS + the stream from a document's first token; the rest of a "
        "document cut at a row's end is not trained on (the start-up line says what share). Needs a tokenizer "
        "with a BOS token",
    )


def add_optimization_flags(p: argparse.ArgumentParser):
    """Steps, batch, the LR schedule, AdamW, clipping, precision."""
    g = p.add_argument_group("optimisation")
    g.add_argument("--epochs", type=int, default=1, help="passes over the train split")
    g.add_argument(
        "--max_steps", type=int, default=-1, help="stop after this many optimizer steps (-1: run all epochs)"
    )
    g.add_argument(
        "--batch_size",
        type=int,
        default=8,
        help="micro batch per device; global = this x accumulation x world",
    )
    g.add_argument("--accumulation_steps", type=int, default=1, help="micro batches per optimizer step")
    g.add_argument(
        "--global_batch_size",
        type=int,
        help="sequences per optimizer step; if given, accumulation = this / (batch_size x world). Keep it when "
        "resuming on another world size: the run then trains on exactly the sequences it would have",
    )
    g.add_argument("--learning_rate", type=float, default=3e-4, help="peak LR after warmup")
    g.add_argument("--min_lr", type=float, help="LR at the end of the cosine (default: learning_rate / 10)")
    g.add_argument(
        "--warmup_steps", type=int, default=100, help="linear warmup steps (capped at the run's length)"
    )
    g.add_argument("--weight_decay", type=float, default=0.1, help="AdamW decoupled weight decay on matrices")
    g.add_argument(
        "--decay_all_params", action="store_true", help="also decay norms and embeddings (default: not)"
    )
    g.add_argument("--beta1", type=float, default=0.9, help="AdamW beta1")
    g.add_argument("--beta2", type=float, default=0.95, help="AdamW beta2 (0.95 as LLaMA)")
    g.add_argument("--adam_eps", type=float, default=1e-8, help="AdamW epsilon")
    g.add_argument(
        "--grad_clip",
        type=float,
        help="clip the global grad norm to this (0: no clipping). Default "
        + ", ".join(
            f"{s.grad_clip:g} with {s.name}" + f" ({s.grad_clip_why})" * bool(s.grad_clip_why)
            for s in OPTIMIZERS.values()
        ),
    )
    g.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="auto: bf16 on GPUs that have it, else fp16 on GPU, fp32 on CPU",
    )


def add_optimizer_flags(p: argparse.ArgumentParser):
    """Which optimizer (one record each: llama_train/optim/registry.py) and LR schedule
    (llama_train/optim/optimizers.py; docs/optimizers.md), and each optimizer's own flags."""
    g = p.add_argument_group("optimizer and LR schedule (docs/optimizers.md)")
    g.add_argument(
        "--optimizer",
        default="adamw",
        help=" | ".join(OPTIMIZERS)
        + ". "
        + " ".join(f"{s.name}: {s.help}" for s in OPTIMIZERS.values() if s.help)
        + ' ds_configs say "optimizer": {"type": "auto"}; one naming another optimizer is refused',
    )
    for spec in OPTIMIZERS.values():
        spec.add_flags(g)
    g.add_argument(
        "--lr_schedule",
        default="cosine",
        help="cosine | wsd. cosine: warmup, then cosine to --min_lr at the last step. wsd: warmup, flat at the "
        "peak, then linear to --min_lr over the last --decay_fraction of the run (warmup-stable-decay): a "
        "checkpoint of the flat phase can be branched into a finished model (docs/optimizers.md)",
    )
    g.add_argument(
        "--decay_fraction",
        type=float,
        default=0.2,
        help="wsd: the share of the run's steps spent decaying (0.2: the last 20%%)",
    )
    g.add_argument(
        "--decay_steps",
        type=int,
        default=0,
        help="wsd: decay over exactly this many last steps instead (0: from --decay_fraction). Branching: "
        "--resume a stable-phase checkpoint at step S with --max_steps S+N --decay_steps N (docs/optimizers.md)",
    )


def add_logging_flags(p: argparse.ArgumentParser):
    """What a run writes besides its checkpoints: metrics, evaluations, the export, profiles."""
    g = p.add_argument_group("logging, evaluation, export")
    g.add_argument("--output_dir", default="outputs/run", help="metrics.jsonl, checkpoints/, hf/ go here")
    g.add_argument(
        "--log_interval", type=int, default=10, help="optimizer steps between log lines / metrics records"
    )
    g.add_argument(
        "--eval_interval",
        type=int,
        default=0,
        help="optimizer steps between evaluations (0: only at the end)",
    )
    g.add_argument(
        "--eval_batches", type=int, default=50, help="max eval batches per rank per evaluation (-1: all)"
    )
    g.add_argument(
        "--eval_tasks",
        help="downstream tasks scored at every evaluation, as lm-evaluation-harness scores them (per-choice "
        "log-likelihood: acc, acc_norm; cloze: acc, ppl): a comma-separated list of builtin (the next words of "
        "held-out built-in text among spans of other documents; no download) and task JSONL files (ours, or "
        "HellaSwag, ARC, PIQA, LAMBADA as published). With it, an evaluation also runs at step 0. "
        "docs/evaluation.md",
    )
    g.add_argument(
        "--eval_task_limit",
        type=int,
        default=-1,
        help="score only the first N items of each task (lm-eval's --limit; -1: all)",
    )
    g.add_argument("--no_export", action="store_true", help="skip the final export to <output_dir>/hf")
    g.add_argument(
        "--profile",
        action="store_true",
        help="DeepSpeed's flops profile and a torch.profiler trace (gzipped, one per rank) of step --profile_interval",
    )
    g.add_argument("--profile_interval", type=int, default=10, help="optimizer step at which to profile")
    g.add_argument(
        "--probe_interval",
        type=int,
        default=PROBE_INTERVAL,
        help="measure one optimizer step in this many (and the last): its time split (`timing` record) and "
        "bytes moved (`comm` record). A probed step is left out of step time, tok/s and MFU (default: "
        "%(default)s, probing costs well under 1%% of the run; 0: never; docs/monitoring.md)",
    )


def parse_save_interval(text: str) -> int | str:
    """--save_interval's type: `auto` (llama_train/train/cadence.py), or a step count >= 0."""
    if text == "auto":
        return text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(
            f"must be auto or a step count >= 0 (0: only at the end), got {text!r}"
        )
    return int(text)


def add_checkpoint_flags(p: argparse.ArgumentParser):
    """When checkpoints are written and kept, what --resume continues, when a run stops early."""
    g = p.add_argument_group("checkpoints, resuming, stopping")
    g.add_argument(
        "--save_interval",
        type=parse_save_interval,
        default="auto",
        help="optimizer steps between checkpoints; 0: only at the end; auto (the default): decided by the run "
        "from the step time and the measured cost of a save, so that saving takes at most 2%% of the run and "
        "at most --save_max_minutes of training pass between checkpoints, printed at start-up and after each "
        "save with its reason (`save_plan` records in metrics.jsonl; docs/checkpoints.md#how-often-to-save)",
    )
    g.add_argument(
        "--save_max_minutes",
        type=float,
        default=30.0,
        help="with --save_interval auto: at most this many minutes of training between checkpoints, the work "
        "a crash can lose (unless a save costs over 2%% of that: then the interval is the 2%%'s)",
    )
    g.add_argument(
        "--no_final_checkpoint",
        action="store_true",
        help="no checkpoint after the last step (--save_interval's and a stop's are still written): for "
        "benchmarks and throwaway runs, where writing and hashing it (about 15 GB at 1b) is time measured for nothing",
    )
    g.add_argument(
        "--keep_last",
        type=int,
        default=3,
        help="checkpoints to keep (the newest complete one is never deleted)",
    )
    g.add_argument(
        "--resume",
        default="none",
        help="none | auto (newest complete checkpoint in output_dir; none yet: a fresh start, said so) | PATH "
        "(a checkpoint dir, or a run's output_dir). It may come from another world size, batch size or "
        "strategy (DDP <-> ZeRO-0/1/2/3, offload, dtype): weights, AdamW moments and step, LR schedule and "
        "data position carry over, converted when needed. A changed global batch continues at the same "
        "consumed-sample count, while the LR schedule stays in optimizer steps. The model, sequence length, "
        "data, split and seed must stay. Conversions and DDP checkpoints are read without unpickling code "
        "(weights_only); a same-layout DeepSpeed resume uses DeepSpeed's own loader, which unpickles its "
        "files fully (after every file's sha256 is checked): resume only checkpoints from a trusted source",
    )
    g.add_argument(
        "--start_over",
        action="store_true",
        help="start a new run in an --output_dir that holds an earlier one (metrics.jsonl, ledger.jsonl or "
        "checkpoints/): the earlier run is first moved to <output_dir>.old-<UTC time>, nothing deleted. "
        "Without it such a start is refused (continue it with --resume auto), so two runs' records never mix",
    )
    g.add_argument(
        "--allow_data_change",
        action="store_true",
        help="resume although the data differs from the checkpoint's (mixture weights, --data_path content, "
        "sequence count): a deliberate re-mix. The run continues at the checkpoint's consumed-sample count "
        "in the new data's order, so some sequences are seen twice or never and the eval split may move; "
        "a changed tokenizer is still refused (docs/reliability.md)",
    )
    g.add_argument(
        "--stop_after_steps",
        type=int,
        default=-1,
        help="save a checkpoint and exit 0 after this optimizer step, as on preemption; the LR "
        "schedule still spans the whole run, so --resume auto continues the same curve",
    )
    g.add_argument(
        "--max_nonfinite_steps",
        type=int,
        default=5,
        help="stop after this many optimizer steps in a row with inf/NaN gradients (each is skipped)",
    )
    g.add_argument(
        "--hash_checkpoints",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="sha256 of every checkpoint file on save, checked on resume, each file by one rank, in threads "
        "(measured against the time to write: docs/checkpoints.md 'Checkpoint hashing at scale'); "
        "--no-hash_checkpoints checks sizes only",
    )
    g.add_argument(
        "--async_save",
        action="store_true",
        help="write checkpoints in a background thread while training goes on: the step only copies the state "
        "to host memory (one more copy of the model state in RAM while a save is in flight); at most one save "
        "in flight, `latest` moves only once every rank's files are written and hashed. docs/checkpoints.md",
    )


def add_speed_flags(p: argparse.ArgumentParser):
    """Speed-ups that leave the model and its numbers unchanged."""
    g = p.add_argument_group("speed")
    g.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile each transformer block and the loss head's softmax (fuses the element-wise work "
        "around the matmuls). Off by default: the first step pays the compile (a cold inductor cache: tens of "
        "seconds on CPU, reported once and left out of tok/s and MFU), and it does not work with ZeRO-3. "
        "docs/performance.md",
    )


def add_init_flags(p: argparse.ArgumentParser):
    """--init_from: a new run from existing weights."""
    g = p.add_argument_group("starting from existing weights")
    g.add_argument(
        "--init_from",
        help="start a new run (fresh optimizer and LR schedule, step 0) from these weights: an HF directory (ours, "
        "an export, or any LlamaForCausalLM whose shape matches the flags), a .safetensors / .pt state dict, one "
        "of our checkpoints (any strategy) or a run's output_dir. Mismatched shapes are named parameter by "
        "parameter. Read without unpickling code (safetensors, torch.load weights_only). Without --tokenizer, "
        "its tokenizer is used. An evaluation at step 0 shows where the run starts. With --resume and a "
        "checkpoint to continue, the checkpoint wins (a requeued job continues)",
    )


def add_distributed_flags(p: argparse.ArgumentParser):
    """What the launcher sets, and DDP's own knobs."""
    g = p.add_argument_group("distributed")
    g.add_argument(
        "--local_rank",
        type=int,
        default=int(os.environ.get("LOCAL_RANK", -1)),
        help="set by the launcher (deepspeed / torchrun); -1 = not distributed",
    )
    g.add_argument(
        "--find_unused_parameters",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="DDP only: tolerate parameters that get no gradient (a frozen or unused branch). Off by default, as "
        "in PyTorch and as a GPU user wants it: every parameter of this model gets a gradient, and the search "
        "walks the autograd graph on the CPU after every forward, time the CPU does not spend queueing the "
        "GPU's kernels (on 2 CPU ranks, 25m, its cost was within noise: docs/configuration.md). A model with an "
        "unused parameter then stops with DDP's error, which names this flag",
    )
    g.add_argument(
        "--dist_timeout_minutes",
        type=float,
        default=30.0,
        help="how long a collective may wait for the other ranks before the job fails (both trainers; "
        "DeepSpeed's own default is 10, torch's 30). It also covers a rank waiting while another writes a "
        "checkpoint, and across nodes a node that finished its data cache waiting in the first collective for "
        "one still building it (within a node the wait is on files): keep it above those. docs/long-runs.md",
    )
    g.add_argument(
        "--watchdog_s",
        type=float,
        default=0.0,
        help="when no optimizer step (with its eval and checkpoint) has completed for this many seconds, every "
        "rank writes its Python stacks and last collective to <output_dir>/hang/, rank 0 names the stalled "
        "rank(s), and the job exits 75 so a scheduler requeues it (--resume auto continues). Armed from the "
        "first step on; keep it above the slowest save or eval. 0 = off (default). docs/long-runs.md",
    )


def add_watch_flags(p: argparse.ArgumentParser):
    """Watching a run: loggers (llama_train/telemetry/reporting.py), the loss-spike guard (llama_train/train/guards.py:
    SpikeGuard), the console."""
    g = p.add_argument_group("watching a run: loggers, loss-spike guard, console")
    g.add_argument(
        "--report_to",
        default="none",
        help="where scalars go besides metrics.jsonl (always written): none, or a comma-separated list of "
        "tensorboard (<output_dir>/tensorboard), wandb (W&B; WANDB_MODE=offline works without network), "
        "csv (<output_dir>/metrics.csv). Default none: the extras are optional installs",
    )
    g.add_argument(
        "--wandb_project", default="llama-train", help="W&B project (the run is named after --output_dir)"
    )
    g.add_argument(
        "--skip_loss_zscore",
        type=float,
        default=0.0,
        help="skip an optimizer update whose loss (mean over micro-batches and ranks) is this many standard "
        "deviations above the last --spike_window steps' (llm.c's -sl; e.g. 5). Default 0 = off: when on, "
        "each step waits for its loss on the host once",
    )
    g.add_argument(
        "--skip_grad_zscore",
        type=float,
        default=0.0,
        help="the same for the global gradient norm before clipping (llm.c's -sg; e.g. 5). Default 0 = off",
    )
    g.add_argument(
        "--spike_window",
        type=int,
        default=100,
        help="steps of history the z-scores use; the guard acts once it holds that many (llm.c: 128)",
    )
    g.add_argument(
        "--straggler_factor",
        type=float,
        default=1.5,
        help="name a rank (once, with its host: a note on the log line and a `straggler` record in "
        "metrics.jsonl) whose own work (data + forward + backward + optimizer time, no waiting) is this many "
        "times the median rank's on --straggler_patience of the last 2 x patience log steps. 0 = off. "
        "docs/long-runs.md",
    )
    g.add_argument(
        "--straggler_patience",
        type=int,
        default=3,
        help="log steps (of the last twice as many) a rank must be slow on before --straggler_factor names it",
    )
    g.add_argument(
        "--verbose",
        action="store_true",
        help="show DeepSpeed's INFO lines and the library warnings that are hidden by default",
    )


def add_deepspeed_flags(p: argparse.ArgumentParser):
    """The DeepSpeed trainer's own: its config and model parallelism."""
    g = p.add_argument_group("deepspeed")
    g.add_argument(
        "--deepspeed_config",
        default="ds_configs/zero2.json",
        help='engine knobs (ZeRO stage, offload, buckets); its "auto" values are filled from the flags; '
        '"tensor_parallel": {"autotp_size": N} splits heads and SwiGLU units over N ranks (ds_configs/tp2_zero1.json)',
    )
    g.add_argument(
        "--sequence_parallel_size",
        type=int,
        default=1,
        help="Ulysses sequence parallel: every sequence split over this many ranks, attention all-to-all over "
        "them. For contexts whose activations do not fit one device; 1 (off) because at short contexts the "
        "all-to-alls cost more than they save. Heads and --max_seq_len must divide by it. docs/parallelism.md 'Sequence parallel (Ulysses)'",
    )
    g.add_argument(
        "--pipeline_parallel_size",
        type=int,
        default=1,
        help="pipeline stages: the layers split over this many ranks, micro-batches (--accumulation_steps) "
        "flow through them. For models whose layers do not fit one device; 1 (off) because a pipeline idles "
        "while it fills and drains. ZeRO stage 0 or 1 only. docs/parallelism.md 'Pipeline parallel'",
    )


def add_fsdp_flags(p: argparse.ArgumentParser):
    """The DDP trainer's own: FSDP2 instead of DDP (llama_train/distributed/fsdp.py)."""
    g = p.add_argument_group("FSDP2 (train_ddp.py --fsdp; llama_train/distributed/fsdp.py)")
    g.add_argument(
        "--fsdp",
        action="store_true",
        help="FSDP2 (torch's fully_shard) instead of DDP: parameters, gradients and AdamW state sharded over "
        "the ranks like ZeRO-3 (per transformer block, then the root); bf16/fp16 through a mixed-precision "
        "policy (fp32 shards, fp32 gradient reduction). Checkpoints are the DDP trainer's files, so runs "
        "move between DDP, FSDP2 and every ZeRO stage. docs/fsdp.md",
    )
    g.add_argument(
        "--fsdp_offload",
        action="store_true",
        help="with --fsdp: keep the sharded parameters, gradients and AdamW state in host memory "
        "(CPUOffloadPolicy); the optimizer step runs on the CPU",
    )


def model_args(args: argparse.Namespace) -> ModelArgs:
    """The preset with every model flag the user gave applied on top: derived once, at the top of each
    trainer's main, and passed down (validate builds one too, to check it)."""
    return preset(
        args.preset,
        dim=args.dim,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        n_kv_heads=args.n_kv_heads,
        vocab_size=args.vocab_size,
        max_seq_len=args.max_seq_len,
        use_flash_attn=args.use_flash_attn,
        gradient_checkpointing=args.gradient_checkpointing,
        checkpoint_every=args.checkpoint_every,
        loss_chunk_tokens=args.loss_chunk_tokens,
        tie_embeddings=args.tie_embeddings or None,
    )


def validate(args: argparse.Namespace) -> list[str]:
    """Every problem with the flags, as one list (empty when the run can start)."""
    problems = []
    positive = ("epochs", "batch_size", "accumulation_steps", "log_interval", "max_seq_len", "keep_last")
    problems += [f"--{k} must be >= 1, got {getattr(args, k)}" for k in positive if getattr(args, k) < 1]
    nonneg = (
        "learning_rate", "weight_decay", "grad_clip", "warmup_steps", "eval_interval", "probe_interval",
    )  # fmt: skip
    problems += [f"--{k} must be >= 0, got {getattr(args, k)}" for k in nonneg if getattr(args, k) < 0]
    if args.min_lr is not None and not 0 <= args.min_lr <= args.learning_rate:
        problems.append(f"--min_lr must be in [0, learning_rate={args.learning_rate}], got {args.min_lr}")
    problems += optimizer_problems(args)
    if args.max_steps == 0 or args.max_steps < -1:
        problems.append(f"--max_steps must be -1 (all epochs) or >= 1, got {args.max_steps}")
    problems += data_problems(args)
    problems += eval_task_problems(args)
    if args.dist_timeout_minutes <= 0:
        problems.append(f"--dist_timeout_minutes must be > 0, got {args.dist_timeout_minutes}")
    if args.straggler_factor != 0 and args.straggler_factor <= 1 or args.straggler_patience < 1:
        problems.append(
            f"--straggler_factor must be 0 (off) or > 1 and --straggler_patience >= 1, got "
            f"{args.straggler_factor} and {args.straggler_patience}"
        )
    if args.watchdog_s < 0:
        problems.append(f"--watchdog_s must be >= 0 (0 = off), got {args.watchdog_s}")
    if args.save_max_minutes <= 0:
        problems.append(f"--save_max_minutes must be > 0, got {args.save_max_minutes}")
    if args.start_over and args.resume == "auto":
        problems.append(
            "--start_over moves the run in --output_dir aside and --resume auto continues it: give one"
        )
    problems += watch_problems(args)
    problems += fsdp_problems(args)
    problems += model_problems(args)
    if args.local_rank != -1 and "WORLD_SIZE" not in os.environ:
        problems.append(
            f"--local_rank {args.local_rank} given but no launcher environment (WORLD_SIZE unset): "
            "start with `torchrun --nproc_per_node N` or `deepspeed --num_gpus N`, "
            "or drop --local_rank for a single process"
        )
    return problems


def data_problems(args: argparse.Namespace) -> list[str]:
    """--data_split, --data_path (its mixture's syntax) and the row layout flags."""
    problems = []
    parts = args.data_split.split(",")
    try:
        weights = [float(w) for w in parts]
        if len(weights) != 2 or weights[0] <= 0 or weights[1] <= 0:
            raise ValueError
    except ValueError:
        problems.append(
            f"--data_split must be two positive weights (train,eval) like '98,2', got {args.data_split!r}"
        )
    try:
        parse_mixture(args.data_path)
    except DataSourceError as e:
        problems.append(f"--data_path: {e}")
    if args.bos_aligned_rows and not args.document_mask:
        problems.append(
            "--bos_aligned_rows needs --document_mask (rows start at a document only to be masked by it)"
        )
    return problems


def eval_task_problems(args: argparse.Namespace) -> list[str]:
    """--eval_tasks: every task file read and checked now (utils.data.task_problems), and the layouts
    whose forward does not give a whole sequence's logits on each rank refused."""
    if not args.eval_tasks:
        return []
    problems = task_problems(args.eval_tasks)
    for flag in ("pipeline_parallel_size", "sequence_parallel_size"):
        if getattr(args, flag, 1) > 1:
            problems.append(
                f"--eval_tasks is not supported with --{flag} {getattr(args, flag)} (a rank sees a stage or a "
                "slice of each sequence, not its logits): score the run's export instead (docs/evaluation.md)"
            )
    if args.eval_task_limit == 0 or args.eval_task_limit < -1:
        problems.append(f"--eval_task_limit must be -1 (all) or >= 1, got {args.eval_task_limit}")
    return problems


def model_problems(args: argparse.Namespace) -> list[str]:
    """The model's shape (preset and overrides), its sequence length and activation checkpointing."""
    problems = []
    if args.checkpoint_every is not None and not args.gradient_checkpointing:
        problems.append(
            f"--checkpoint_every {args.checkpoint_every} needs --gradient_checkpointing (which blocks it recomputes)"
        )
    problems += [f"model: {p}" for p in model_args(args).problems()]
    supported = PRESETS[args.preset].max_seq_len
    if args.max_seq_len > supported:
        bigger = [n for n, a in PRESETS.items() if a.max_seq_len >= args.max_seq_len]
        problems.append(
            f"--max_seq_len {args.max_seq_len} is above the {args.preset!r} preset's {supported}; "
            f"use a shorter sequence or a preset that supports it ({', '.join(bigger) or 'none'})"
        )
    return problems


def optimizer_problems(args: argparse.Namespace) -> list[str]:
    """--optimizer, --lr_schedule and their numbers; each optimizer's own (its record's `problems`)."""
    from llama_train.optim.optimizers import SCHEDULES

    problems = []
    if args.optimizer not in OPTIMIZERS:
        problems.append(f"--optimizer {args.optimizer!r} is unknown; choose one of {', '.join(OPTIMIZERS)}")
    if args.lr_schedule not in SCHEDULES:
        problems.append(
            f"--lr_schedule {args.lr_schedule!r} is unknown; choose one of {', '.join(SCHEDULES)}"
        )
    if not 0 < args.decay_fraction <= 1 or args.decay_steps < 0:
        problems.append(
            f"--decay_fraction must be in (0, 1] and --decay_steps >= 0, got {args.decay_fraction}, {args.decay_steps}"
        )
    return problems + [p for spec in OPTIMIZERS.values() for p in spec.problems(args)]


def derive_accumulation(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """The flags with accumulation_steps derived from --global_batch_size (it must divide evenly) over
    `world_size` data-parallel replicas, known once the layout is: a new namespace, so the trainer's
    main shows the one place the flags change after parsing."""
    if args.global_batch_size is None:
        return args
    per_step = args.batch_size * world_size
    if args.global_batch_size % per_step:
        raise ConfigError(
            f"--global_batch_size {args.global_batch_size} is not divisible by --batch_size {args.batch_size} "
            f"x {world_size} ranks = {per_step}; choose a multiple of {per_step}"
        )
    return argparse.Namespace(**{**vars(args), "accumulation_steps": args.global_batch_size // per_step})


def parse_args(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """The flags, validated. Two defaults are filled here, at parse time, because they are functions of
    other flags and are recorded with the run: --min_lr (learning_rate / 10), --grad_clip (by --optimizer)."""
    args = parser.parse_args(argv)
    if args.min_lr is None:
        args.min_lr = args.learning_rate / 10
    if args.grad_clip is None:  # the optimizer's record says which, and why (grad_clip_why)
        args.grad_clip = OPTIMIZERS.get(args.optimizer, ADAMW).grad_clip
    if problems := validate(args):
        raise ConfigError("invalid arguments:\n  - " + "\n  - ".join(problems))
    quiet_console(args.verbose)  # library noise hidden by name unless --verbose (llama_train/console.py)
    return args
