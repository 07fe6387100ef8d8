"""Pure functions: "auto" filling of DeepSpeed configs, the LR schedule, flag validation, step plan."""

import glob
import json

import pytest

from llama_train.config import build_parser, parse_args
from llama_train.distributed.ds_config import (
    cli_values,
    fill_buckets,
    fill_ds_config,
    fill_speed,
    load_ds_config,
    offloads_optimizer,
    zero_stage,
)
from llama_train.errors import ConfigError
from llama_train.model import preset
from llama_train.optim.optimizers import lr_at
from llama_train.steps import StepPlan

VALUES = cli_values(
    micro_batch=4,
    accumulation=8,
    world_size=2,
    grad_clip=1.0,
    dtype="bfloat16",
    lr=2e-4,
    betas=(0.9, 0.95),
    eps=1e-8,
    weight_decay=0.1,
)


@pytest.mark.parametrize("path", sorted(glob.glob("ds_configs/*.json")))
def test_every_shipped_config_fills_completely(path):
    config = fill_buckets(fill_ds_config(load_ds_config(path), VALUES, source=path), preset("25m"))
    fill_speed(config, dp=2)
    assert config["train_batch_size"] == 64
    assert config["train_micro_batch_size_per_gpu"] == 4 and config["gradient_accumulation_steps"] == 8
    assert config["bf16"]["enabled"] is True and config["fp16"]["enabled"] is False
    assert config["optimizer"]["params"]["lr"] == 2e-4 and config["optimizer"]["params"]["betas"] == [
        0.9,
        0.95,
    ]
    assert '"auto"' not in json.dumps(config), (
        "an 'auto' was left for DeepSpeed, which does not understand it"
    )
    stage = int(path.split("zero")[1][0])
    assert zero_stage(config) == stage
    assert offloads_optimizer(config) == ("offload" in path)
    # offloaded optimizers must be DeepSpeedCPUAdam, so torch_adam only where nothing is offloaded
    assert config["optimizer"]["params"].get("torch_adam", False) == ("offload" not in path)
    assert config["optimizer"]["params"].get("fused", False) == ("offload" not in path)  # as train_ddp.py


def test_explicit_value_that_agrees_is_kept():
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": 1.0,
    }
    out = fill_ds_config(cfg, VALUES)
    assert out["gradient_accumulation_steps"] == 8 and out["train_batch_size"] == 64


def test_contradiction_names_key_and_both_values():
    cfg = {"train_micro_batch_size_per_gpu": 16, "gradient_clipping": 0.5, "bf16": {"enabled": False}}
    with pytest.raises(ConfigError) as e:
        fill_ds_config(cfg, VALUES, source="my.json")
    msg = str(e.value)
    assert '"train_micro_batch_size_per_gpu" is 16 in my.json but the command line gives 4' in msg
    assert '"gradient_clipping" is 0.5' in msg and '"bf16.enabled" is False' in msg  # all at once


def test_train_batch_size_must_match_world():
    with pytest.raises(
        ConfigError, match='"train_batch_size" is 48 in ds_config but the command line gives 64'
    ):
        fill_ds_config({"train_batch_size": 48}, VALUES)


def test_input_dict_not_mutated():
    cfg = {"train_batch_size": "auto", "bf16": {"enabled": "auto"}}
    fill_ds_config(cfg, VALUES)
    assert cfg == {"train_batch_size": "auto", "bf16": {"enabled": "auto"}}


def test_invalid_json_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "train_batch_size": 8,\n  "zero_optimization": {"stage": 2,}\n}\n')
    with pytest.raises(ConfigError, match=r"bad\.json:3:\d+: invalid JSON"):
        load_ds_config(str(bad))


def test_unknown_file_lists_shipped_configs():
    with pytest.raises(
        ConfigError, match=r"'ds_configs/zero9.json' not found; ds_configs/ has \[.*'zero2.json'"
    ):
        load_ds_config("ds_configs/zero9.json")


def test_lr_schedule_warmup_peak_and_floor():
    kw = dict(max_lr=1.0, min_lr=0.1, warmup_steps=10, total_steps=110)
    assert lr_at(0, **kw) == pytest.approx(0.1)
    assert lr_at(9, **kw) == pytest.approx(1.0)
    assert lr_at(60, **kw) == pytest.approx(0.55)  # half way down the cosine
    assert lr_at(109, **kw) == pytest.approx(0.1, abs=1e-3)
    assert lr_at(500, **kw) == 0.1
    lrs = [lr_at(s, **kw) for s in range(10, 110)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:])), "cosine phase must not increase"
    # warmup longer than the run still reaches the peak before the end
    assert max(lr_at(s, 1.0, 0.0, 100, 5) for s in range(5)) == pytest.approx(1.0)


def test_parser_accepts_reference_launch_and_reports_every_problem():
    parser = build_parser("t")
    args = parse_args(
        parser,
        "--epochs 3 --batch_size 24 --learning_rate 2e-4 --dtype bfloat16 --accumulation_steps 32 "
        "--grad_clip 1.0 --log_interval 100 --save_interval 10000 --dim 1024 --n_layers 32 --max_seq_len 1024 "
        "--use_flash_attn --profile --profile_interval 10".split(),
    )
    assert (args.dim, args.n_layers, args.accumulation_steps, args.min_lr) == (1024, 32, 32, 2e-5)
    with pytest.raises(ConfigError) as e:
        parse_args(parser, "--batch_size 0 --data_split 100 --dim 100 --n_heads 8".split())
    msg = str(e.value)
    assert (
        "--batch_size must be >= 1" in msg and "--data_split" in msg and "not divisible by n_heads=8" in msg
    )


def test_step_plan_and_too_little_data():
    # 130 sequences, global batch 4 x 3 x 1 = 12: 10 steps an epoch (the 10-sequence tail is dropped)
    plan = StepPlan.make(130, batch_size=4, accumulation=3, world=1, epochs=2, max_steps=-1)
    assert (plan.global_batch, plan.steps_per_epoch, plan.total_steps) == (12, 10, 20)
    assert StepPlan.make(130, 4, 3, 1, epochs=2, max_steps=7).total_steps == 7
    with pytest.raises(ValueError, match="fewer than one global batch of 48"):
        StepPlan.make(40, 4, 3, 4, 1, -1)


@pytest.mark.parametrize(
    ("zero", "message"),
    [
        ({"stage": 2, "offload_param": {"device": "cpu"}}, "offload_param needs ZeRO stage 3"),
        (
            {"stage": 0, "offload_optimizer": {"device": "cpu"}},
            "offload_optimizer needs ZeRO stage 1, 2 or 3",
        ),
    ],
)
def test_zero_stage_feature_mismatch_is_refused(zero, message):
    with pytest.raises(ConfigError, match=message):
        fill_ds_config({"zero_optimization": zero}, VALUES)


def test_n_heads_override_keeps_attention_kind():
    """--n_heads on a multi-head preset stays multi-head (n_kv_heads follows it); on a grouped-query
    preset the number of key/value groups stays what the preset says."""
    from llama_train.config import model_args

    mha = model_args(parse_args(build_parser("t"), ["--preset", "25m", "--n_heads", "4"]))
    assert (mha.n_heads, mha.kv_heads, mha.problems()) == (4, 4, [])
    gqa = model_args(parse_args(build_parser("t"), ["--preset", "1b", "--n_heads", "16"]))
    assert (gqa.n_heads, gqa.kv_heads, gqa.problems()) == (16, 4, [])
    with pytest.raises(ConfigError, match="n_heads=6 is not divisible by n_kv_heads=4"):
        parse_args(build_parser("t"), ["--preset", "1b", "--n_heads", "6", "--max_seq_len", "64"])


def test_strategy_records_agree_with_their_configs():
    """A DeepSpeed strategy's record says what its config does (ZeRO stage, offload), its engine's
    trainer is the one that reads it, and every twin keeps its record's facts."""
    from llama_train.distributed.strategies import DEEPSPEED, RECORDS, STRATEGIES

    for s in RECORDS:
        assert (s.trainer == "train_deepspeed.py") == (s.ds_config is not None) == (s.engine is DEEPSPEED)
        if s.ds_config:
            config = load_ds_config(s.ds_config)
            assert (zero_stage(config), offloads_optimizer(config)) == (s.stage, s.offload), s.name
    for name, twin in STRATEGIES.items():
        base = max((r for r in RECORDS if name.startswith(r.name)), key=lambda r: len(r.name))
        assert (twin.engine, twin.ds_config, twin.stage, twin.offload) == (
            base.engine,
            base.ds_config,
            base.stage,
            base.offload,
        )
        assert twin.flags[: len(base.flags)] == base.flags


def test_save_interval_auto_bounds_the_lost_work_and_the_share_of_saving():
    """Young/Daly's interval for a failure a day, at most the wall-clock bound, and never so short that
    saving takes over 2% of the run; `--save_interval` takes auto or a step count."""
    from llama_train.train.cadence import auto_interval

    steps, why = auto_interval(save_s=0.5, step_s=0.1, max_s=1800)  # sqrt(2 x 0.5 x 86400) = 294 s
    assert steps == 2939 and why.startswith("Young/Daly")
    assert auto_interval(save_s=20, step_s=1.0, max_s=1800)[0] == 1800  # 1,859 s: the bound wins
    steps, why = auto_interval(save_s=60, step_s=1.0, max_s=1800)  # 2% of 1,800 s is 36 s < 60
    assert steps == 3000 and "2%" in why
    parser = build_parser("t")
    assert parse_args(parser, []).save_interval == "auto"
    assert parse_args(parser, ["--save_interval", "0"]).save_interval == 0
    with pytest.raises(SystemExit):
        parse_args(parser, ["--save_interval", "-5"])
