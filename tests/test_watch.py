"""Pure parts of watching a run (issue 17): the spike guard's statistics and its resume, flag
checks for --report_to, DeepSpeed monitor blocks and DeepSpeed's own config validation, --help."""

import json
import statistics

import pytest

from llama_train.config import build_parser
from llama_train.distributed.ds_config import refuse_monitors, validate_with_deepspeed
from llama_train.errors import ConfigError
from llama_train.telemetry.reporting import watch_problems
from llama_train.train.guards import SpikeGuard, zscore


def feed(guard: SpikeGuard, losses, norms=None) -> list[bool]:
    out = []
    for i, loss in enumerate(losses):
        guard.observe(i + 1, loss, "cpu")
        out.append(guard.should_skip(None if norms is None else norms[i]))
    return out


def test_zscore_is_the_population_zscore_of_a_full_window():
    past = [1.0, 1.2, 0.9, 1.1]
    z, mean, std = zscore(2.0, past, 4)
    assert (mean, std) == (statistics.fmean(past), statistics.pstdev(past))
    assert z == pytest.approx((2.0 - mean) / std)
    assert zscore(2.0, past[:3], 4) is None  # not full yet: no verdict


def test_spike_guard_skips_upward_outliers_only_and_keeps_them_out_of_the_window():
    guard = SpikeGuard(loss_z=3, grad_z=0, window=4)
    assert feed(guard, [5.0, 4.9, 5.1, 5.0]) == [False] * 4  # filling the window
    assert feed(guard, [50.0, 4.0, 5.05]) == [True, False, False]  # a spike; a drop is no spike
    assert guard.state["losses"] == [5.1, 5.0, 4.0, 5.05] and guard.skipped == 1


def test_spike_guard_on_the_grad_norm_and_its_resume():
    guard = SpikeGuard(loss_z=0, grad_z=5, window=3)
    assert feed(guard, [1.0] * 5, norms=[1.0, 1.1, 0.9, 30.0, 1.0]) == [False, False, False, True, False]
    saved = json.loads(json.dumps({"spike_guard": guard.state}))  # as trainer_state.json keeps it
    resumed = SpikeGuard(loss_z=0, grad_z=5, window=3)
    resumed.restore_state(saved)
    assert resumed.state == guard.state and feed(resumed, [1.0], norms=[30.0]) == [True]
    assert SpikeGuard(0, 0, 3).should_skip(1e9) is False  # off by default


def args_for(*argv):
    return build_parser("t", deepspeed=True).parse_args(list(argv))


def test_report_to_problems(monkeypatch):
    assert watch_problems(args_for("--report_to", "tensorboard,csv")) == []
    assert "use none or a comma-separated list" in watch_problems(args_for("--report_to", "tensorbord"))[0]
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    assert watch_problems(args_for("--report_to", "wandb")) == [
        "--report_to wandb needs the wandb package: .venv/bin/pip install -e '.[wandb]' (in the checkout)"
    ]


@pytest.mark.parametrize(
    "block, flag", [("tensorboard", "tensorboard"), ("wandb", "wandb"), ("csv_monitor", "csv")]
)
def test_deepspeed_monitor_blocks_are_refused_with_the_flag_to_use(block, flag):
    refuse_monitors({block: {"enabled": False}}, "my.json")  # a disabled block is harmless
    with pytest.raises(ConfigError, match=f'my.json: "{block}" is enabled.*pass --report_to {flag} instead'):
        refuse_monitors({block: {"enabled": True, "output_path": "x"}}, "my.json")


def test_deepspeed_validation_names_the_key_of_a_nested_error():
    base = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}
    validate_with_deepspeed({**base, "zero_optimization": {"stage": 2}}, "ok.json", 1)
    with pytest.raises(ConfigError) as e:
        validate_with_deepspeed(
            {**base, "zero_optimization": {"stage": 2, "reduce_bucket_size": "big"}}, "c.json", 1
        )
    assert str(e.value).startswith(
        "c.json: \"zero_optimization.reduce_bucket_size\" = 'big' is rejected by DeepSpeed"
    )


def test_help_shows_each_default_once():
    text = build_parser("t", deepspeed=True).format_help()
    assert "(default: None)" not in text and "(default: False)" not in text
    for block in text.split("\n  --")[1:]:  # one option each
        assert block.count("(default:") <= 1, block
    flat = " ".join(text.split())
    assert "(default: n_heads)" in flat and "(default: n_heads) (default" not in flat
    assert (
        "passes over the train split (default: 1)" in flat
    )  # argparse's own default stays where the text has none


def test_a_first_deepspeed_run_says_it_builds_the_cpu_ops(tmp_path, monkeypatch, capsys):
    from llama_train.distributed.ds_compat import announce_op_builds

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # nothing built here yet
    assert announce_op_builds() == ["deepspeed_shm_comm"]
    assert (
        f"building DeepSpeed's CPU ops once (deepspeed_shm_comm: ~90 s, cached in {tmp_path})"
        in capsys.readouterr().err
    )
    (tmp_path / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").write_bytes(b"")
    assert announce_op_builds() == [] and capsys.readouterr().err == ""
