"""llama_train/distributed/ds_compat.py patches DeepSpeed behaviours; these tests fail once the installed
DeepSpeed no longer has them, naming the workaround that can go (and prove the workarounds work)."""

import json

import pytest

from tests.trainer_utils import deepspeed_launcher, free_port, run_helper

pytestmark = pytest.mark.usefixtures("deepspeed_ops")  # tests/conftest.py


def probe(*launcher: str) -> dict:
    out = run_helper([*launcher, "tests/helpers/ds_probe.py"])
    (line,) = [line for line in out.splitlines() if line.startswith("PROBE ")]
    return json.loads(line[len("PROBE ") :])


@pytest.fixture(scope="module")
def engine_facts() -> dict:
    import sys

    return probe(sys.executable)


def test_fp32_engine_drops_grad_norm_and_the_patch_keeps_it(engine_facts):
    assert engine_facts["unpatched"]["grad_norm"] is None, (
        "DeepSpeed now reports the fp32 ZeRO-0 grad norm itself: drop ds_compat.keep_fp32_grad_norm"
    )
    norm = engine_facts["patched"]["grad_norm"]
    assert isinstance(norm, float) and norm > 0


def test_one_process_engine_runs_identity_allreduce_and_the_patch_skips_it(engine_facts):
    assert engine_facts["unpatched"]["backward_allreduce"] is True, (
        "DeepSpeed now skips the 1-process gradient all-reduce itself: drop ds_compat.skip_identity_allreduce"
    )
    assert engine_facts["patched"]["backward_allreduce"] is False


def test_bf16_zero2_overflow_scan_is_skipped_and_a_nan_step_still_is(engine_facts):
    """ds_compat.skip_bf16_overflow_scan: the scan's all-reduce goes, the NaN step is still skipped."""
    unpatched, patched = engine_facts["bf16_nan"]["unpatched"], engine_facts["bf16_nan"]["patched"]
    assert engine_facts["bf16_nan"]["patched"]["norm_check_reads_flag"], (
        "DeepSpeed's ZeRO-1/2 step no longer skips a non-finite bf16 norm through check_grad_overflow: "
        "revisit ds_compat.skip_bf16_overflow_scan"
    )
    assert unpatched["skipped"] == patched["skipped"] == 1
    assert patched["step_all_reduces"] < unpatched["step_all_reduces"], (
        "DeepSpeed no longer scans bf16 gradients for overflow: drop ds_compat.skip_bf16_overflow_scan"
    )


@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_zero_steps_read_the_host_and_ours_decide_on_the_device(engine_facts, stage):
    """ds_compat.skip_nonfinite_on_device: DeepSpeed's bf16 ZeRO-1 (BF16_Optimizer) and ZeRO-2 steps read
    the gradient norm on the host (2 and 3 times a step: a sync each on a GPU); patched, none, and a NaN
    step is still skipped alike: weights and AdamW's step count untouched, the LR held, the skip counted."""
    unpatched, patched = (engine_facts["device_skip"][f"zero{stage}"][k] for k in ("unpatched", "patched"))
    assert min(unpatched["host_reads"]) > 0, (
        f"DeepSpeed's bf16 ZeRO-{stage} step no longer reads the norm on the host: drop "
        "ds_compat.skip_nonfinite_on_device"
    )
    assert patched["installed"] and patched["host_reads"] == [0, 0, 0], patched
    for facts in (unpatched, patched):
        assert facts["skipped"] == 1 and facts["nan_step_left_weights"] and facts["adam_steps"] == [2.0], (
            facts
        )
        assert facts["lrs"][1] == facts["lrs"][2] < facts["lrs"][0], facts  # held through the skipped step


@pytest.fixture(scope="module")
def two_rank_facts() -> dict:
    return probe(*deepspeed_launcher(2, free_port()))


def test_shm_buffer_stays_linked_until_we_release_it(two_rank_facts):
    facts = two_rank_facts
    assert facts["shm_buffer_linked_after_init"], (
        "DeepSpeed no longer leaves its shm allreduce buffer in /dev/shm: drop ds_compat.release_deepspeed_shm"
    )
    assert facts["released"]


def test_zero3_full_setter_fails_for_uneven_partitions_and_ours_sets_them(two_rank_facts):
    facts = two_rank_facts["zero3_uneven"]
    assert facts["deepspeed_set_fails"], (
        "DeepSpeed's safe_set_full_fp32_param now sets a ZeRO-3 parameter whose size does not divide by the "
        "world size: drop ds_compat.zero3_set_full"
    )
    assert facts["set"]


def test_zero2_second_group_is_unlinked_after_a_step_and_relinking_fixes_it(engine_facts):
    facts = engine_facts["zero2_links"]
    assert facts["second_group_unlinked"], (
        "safe_get_full_optimizer_state now reads every AdamW group after a ZeRO-2 step: drop "
        "ds_compat.relink_hp_optimizer_state"
    )
    assert facts["relinked_reads"]


def test_zero0_bf16_master_weights_are_out_of_the_public_apis_reach_and_we_find_them(engine_facts):
    facts = engine_facts["zero0_bf16"]
    assert not facts["public_api_finds_master"], (
        "deepspeed.utils.safe_get_full_fp32_param now reaches ZeRO-0's fp32 master: drop ds_compat.zero0_fp32_master"
    )
    assert facts["found_all"] and facts["rounds_to_module"] and facts["more_precise"]


def test_autotp_batch_arithmetic_counts_tensor_parallel_ranks(two_rank_facts):
    assert two_rank_facts["autotp_batch_counts_tp_ranks"], (
        "DeepSpeedConfig now counts only data-parallel ranks under AutoTP: ds_compat.batch_world can return layout.dp"
    )


def test_pipeline_clip_norm_misses_later_stages_and_the_view_counts_them(two_rank_facts):
    norms = two_rank_facts["pipeline_clip_norms"]
    assert norms["deepspeed"] < 0.99 * norms["true"], (
        "clip_grad_norm_ now counts every pipeline stage: drop ds_compat.StageNorms"
    )
    assert norms["patched"] == pytest.approx(norms["true"], rel=1e-6)


def test_zero_on_cpu_blocks_and_gathers_slowly_and_ours_computes_the_same_weights(two_rank_facts):
    """ds_cpu: DeepSpeed's ZeRO-1/2 all-reduce every bucket blocking on a CPU, overlap_comm or not, and
    gather the updated parameters with all_gather_into_tensor; ours launch the all-reduces
    asynchronously and gather by broadcasts, and end 3 accumulated steps with DeepSpeed's weights, bit
    for bit."""
    facts = two_rank_facts["zero_overlap"]
    assert facts["deepspeed_async"] == 0, (
        "DeepSpeed's overlap_comm now issues asynchronous ZeRO-1/2 all-reduces on a CPU: revisit "
        "llama_train/distributed/ds_cpu.py: overlap_reductions"
    )
    assert facts["deepspeed_gathers"] == {"broadcast": 0, "all_gather_into_tensor": 3}, (
        "DeepSpeed's ZeRO-1/2 no longer gather the updated parameters with one all_gather_into_tensor a "
        "step: revisit llama_train/distributed/ds_cpu.py: gather_by_broadcasts"
    )
    for name in ("zero1", "zero2", "zero2_small"):
        run = facts[name]
        assert run["equal"], f"{name}: weights differ from DeepSpeed's own path by {run['max_diff']}"
        assert run["blocking_async"] == 0
        assert run["launched"] > 0 and run["async"] == run["launched"], run
        assert run["gathers"] == {
            "broadcast": 3 * 2,
            "all_gather_into_tensor": 0,
        }  # a broadcast a rank, a step
    # ZeRO-1 reduces once per optimizer step, ZeRO-2 every micro-batch: 3 steps of 2 micro-batches
    assert facts["zero2"]["launched"] == 2 * facts["zero1"]["launched"]
    # the embeddings exceed a 20,000-element bucket: DeepSpeed reduces them itself, between ours
    assert facts["zero2"]["handed_back"] == 0 and facts["zero2_small"]["handed_back"] > 0
