"""llama_train/ds_compat.py patches DeepSpeed behaviours; these tests fail once the installed
DeepSpeed no longer has them, naming the workaround that can go (and prove the workarounds work)."""

import json

import pytest

from tests.trainer_utils import BIN, free_port, run_helper

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


def test_shm_buffer_stays_linked_until_we_release_it():
    facts = probe(str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()))
    assert facts["shm_buffer_linked_after_init"], (
        "DeepSpeed no longer leaves its shm allreduce buffer in /dev/shm: drop ds_compat.release_deepspeed_shm"
    )
    assert facts["released"]
