"""Real multi-node launches, on one machine: `deepspeed --hostfile` over ssh + pdsh and
`torchrun --nnodes 2`, across two hosts simulated by scripts/multinode_sim.sh (network
namespaces joined by a veth pair, one sshd each, shared filesystem).

The hostfile validator's tests are fast and need nothing. The simulated-host tests need root,
network namespaces and openssh-server + pdsh (installed here through the script when missing);
where the machine cannot provide them they skip with the reason. Every two-host run is compared
step by step with a single-machine run of 2 local ranks and the same flags.
"""

import hashlib
import json
import os
import pwd
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from llama_train.ops.hostfile import check_deepspeed_env, check_hostfile
from tests.trainer_utils import (
    BASE_FLAGS,
    ROOT,
    assert_close_curves,
    env,
    launch,
    losses,
    read_metrics,
)

pytestmark = pytest.mark.usefixtures("deepspeed_ops")  # tests/conftest.py

SIM = ROOT / "scripts" / "multinode_sim.sh"
STEPS = 6  # > BASE_FLAGS' 5 warmup steps, so a run twice as long warms up the same way
# min_lr = BASE_FLAGS' learning rate: constant after warmup, so the first STEPS steps of a
# 2*STEPS run are those of a STEPS run (the cosine otherwise depends on --max_steps)
CONST_LR = ["--min_lr", "3e-3"]

# --- the hostfile validator (fast, no hosts needed) ---------------------------------------------


VALID = {
    "plain": "node1 slots=8\nnode2 slots=8\n",
    "comments, blank lines, trailing text": "# cluster\n\nnode1 slots=4  # rack 1\n  node2 slots=2 max_slots=2\n",
    "addresses": "10.0.0.1 slots=1\n10.0.0.2 slots=1",
}


@pytest.mark.parametrize("text", VALID.values(), ids=VALID.keys())
def test_valid_hostfiles_read_as_deepspeed_reads_them(tmp_path, text):
    from deepspeed.launcher.runner import _parse_hostfile

    path = tmp_path / "hostfile"
    path.write_text(text)
    report = check_hostfile(str(path))
    assert report.ok, report.problems
    assert report.hosts == dict(_parse_hostfile(text.splitlines(keepends=True)))


BAD = {
    "missing slots": ("node1 slots=2\nnode2\n", 2, "missing 'slots=N' after 'node2'"),
    "duplicate host": (
        "node1 slots=2\n# x\nnode1 slots=2\n",
        3,
        "duplicate host 'node1' (first listed on line 1)",
    ),
    "zero slots": ("node1 slots=0\n", 1, "slots must be a whole number >= 1, got 'slots=0'"),
    "slots not a number": ("node1 slots=8x\n", 1, "got 'slots=8x'"),  # DeepSpeed reads 8
    "spaces around =": ("node1 slots = 8\n", 1, "without spaces"),
    "include syntax": ("node1:0,1 slots=2\n", 1, "'node1:0,1' is not a host name"),
    "no hosts at all": ("# only a comment\n\n", None, "no hosts"),
}


@pytest.mark.parametrize("text,line,message", BAD.values(), ids=BAD.keys())
def test_problems_name_file_and_line(tmp_path, text, line, message):
    path = tmp_path / "hostfile"
    path.write_text(text)
    report = check_hostfile(str(path))
    assert len(report.problems) == 1, report.problems
    where = f"{path}:{line}: " if line else f"{path}: "
    assert report.problems[0].startswith(where) and message in report.problems[0], report.problems


def test_every_problem_is_reported_not_just_the_first(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("a slots=1\nb\na slots=1\nc slots=x\n")
    problems = check_hostfile(str(path)).problems
    assert [p.split(": ")[0] for p in problems] == [f"{path}:2", f"{path}:3", f"{path}:4"]


def test_unknown_host_is_checked_only_with_resolve(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("localhost slots=1\nllt-no-such-host.invalid slots=1\n")  # .invalid never resolves
    assert check_hostfile(str(path)).ok  # names that resolve only on the cluster
    (problem,) = check_hostfile(str(path), resolve=True).problems
    assert problem.startswith(f"{path}:2: unknown host 'llt-no-such-host.invalid'")


def test_deepspeed_env_lines_must_all_be_key_value(tmp_path):
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.write_text("GLOO_SOCKET_IFNAME=eth1\nNCCL_IB_DISABLE=1\nPATH=/opt/venv/bin:/usr/bin\n")
    bad.write_text("NCCL_SOCKET_IFNAME=eth1\n\n# comment\n")  # DeepSpeed dies on both lines
    assert check_deepspeed_env(str(good)) == []
    assert [p.split(": ")[0] for p in check_deepspeed_env(str(bad))] == [
        f"{bad}:2",
        f"{bad}:3",
    ]


def run_cli(*args) -> subprocess.CompletedProcess:
    script = ROOT / "scripts" / "check_hostfile.py"
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=60)


def test_cli_exit_status_and_messages(tmp_path):
    ok = run_cli(str(ROOT / "hostfile"), "--resolve")  # the repo's example hostfile (localhost)
    assert ok.returncode == 0 and "1 host(s), 2 slot(s)" in ok.stdout, ok.stderr
    bad = tmp_path / "hostfile"
    bad.write_text("node1 slots=1\nnode1 slots=1\n")
    proc = run_cli(str(bad))
    assert proc.returncode == 2 and f"{bad}:2: duplicate host 'node1'" in proc.stderr
    assert run_cli(str(tmp_path / "missing")).returncode == 2


def readme_hostfile_command() -> list[str]:
    """The README's `python -m llama_train.launch deepspeed --hostfile hostfile ...` line, as written."""
    from tests.test_docs import commands

    front = ["python", "-m", "llama_train.launch", "deepspeed", "--hostfile", "hostfile"]
    words = next(w for w in commands(ROOT / "README.md") if w[:6] == front)
    return [sys.executable, *words[1:]]


def test_the_readmes_hostfile_command_trains_here_without_ssh(tmp_path, shared_data):
    """The shipped hostfile names this machine alone, and DeepSpeed ssh-checks even that one host: the
    front launches it here without ssh, on a machine that has none to itself (this one's tests)."""
    from llama_train.distributed.dist import free_port

    cmd = readme_hostfile_command()  # a port of its own: other runs on this machine take DeepSpeed's 29500
    cmd = [*cmd[:6], "--master_port", str(free_port()), *cmd[6:], *BASE_FLAGS, "--max_steps", "4"]
    cmd += ["--no_export", "--output_dir", str(tmp_path / "out"), "--data_output_path", str(shared_data)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    records = read_metrics(tmp_path / "out")
    assert [r["step"] for r in records if r["event"] == "train"] == [1, 2, 3, 4]
    assert next(r for r in records if r["event"] == "config")["world_size"] == 2
    # --save_interval auto's plan, agreed by the two ranks' all-reduce at step 3
    assert [r["step"] for r in records if r["event"] == "save_plan"] == [3]


def test_a_host_ssh_cannot_reach_is_one_error_line_before_any_launch(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two nodes\nllt-no-such-host.invalid slots=2\n")
    front = subprocess.run(
        [
            sys.executable,
            "-m",
            "llama_train.launch",
            "deepspeed",
            "--hostfile",
            str(hostfile),
            "train_deepspeed.py",
            "--output_dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    checker = run_cli(str(hostfile), "--ssh")
    for proc in (front, checker):
        (line,) = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr
        assert f"{hostfile}:2: cannot ssh to 'llt-no-such-host.invalid'" in line and "ssh-copy-id" in line
    assert front.stderr.startswith("[llama_train.launch] error: ")
    assert run_cli(str(ROOT / "hostfile"), "--ssh").returncode == 0  # this machine alone: no ssh needed


def test_sim_checks_the_hostfile_before_setting_anything_up(tmp_path):
    bad = tmp_path / "hostfile"
    bad.write_text("node1\n")
    e = {**env(), "LLT_SIM_DIR": str(tmp_path / "sim"), "LLT_SIM_HOSTFILE": str(bad), "PY": sys.executable}
    proc = subprocess.run(
        ["bash", str(SIM), "deepspeed", "train_deepspeed.py"],
        env=e,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert f"{bad}:1: missing 'slots=N'" in proc.stderr and "not launching" in proc.stderr
    assert not (tmp_path / "sim").exists()


# --- two simulated hosts -----------------------------------------------------------------------


def sim_id(sim_dir) -> str:
    """The script's name for the simulation that keeps its state in `sim_dir`."""
    return hashlib.sha1(os.path.realpath(sim_dir).encode()).hexdigest()[:6]


def outside_state(sim_dir) -> dict:
    """What the simulation in `sim_dir` may touch outside that directory, to check it restores it."""
    home = Path(pwd.getpwuid(os.getuid()).pw_dir)
    config = home / ".ssh" / "config"
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    processes = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(sim_dir).encode() in cmdline.read_bytes():
                processes.append(cmdline.parent.name)
        except OSError:  # gone meanwhile
            pass
    return {
        "~/.ssh": (home / ".ssh").is_dir(),
        "~/.ssh/config": config.read_bytes() if config.exists() else None,
        "~/.ssh/authorized_keys": (home / ".ssh" / "authorized_keys").exists(),
        "/run/sshd": Path("/run/sshd").is_dir(),
        "namespaces": [ns for ns in namespaces.split() if ns.startswith(f"llt-{sim_id(sim_dir)}-")],
        "processes": processes,  # its sshds and anything they started
        "./.deepspeed_env": (ROOT / ".deepspeed_env").exists(),
        "state dir": Path(sim_dir).exists(),
    }


def sim_env(sim_dir) -> dict:
    return {**env(), "LLT_SIM_DIR": str(sim_dir), "PY": sys.executable}


def sim(sim_dir, *args, timeout=300, check=True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        ["bash", str(SIM), *args],
        cwd=ROOT,
        env=sim_env(sim_dir),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"multinode_sim.sh {' '.join(args)} failed ({proc.returncode}):\n"
            f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


@pytest.fixture(scope="module")
def can_simulate(tmp_path_factory):
    """Skips (with the reason) where this machine cannot simulate hosts."""
    if os.geteuid() != 0:
        pytest.skip("simulated hosts need root (network namespaces, sshd)")
    probe_dir = tmp_path_factory.mktemp("probe") / "sim"
    if os.environ.get("LLAMA_TRAIN_TEST_NO_INSTALL"):  # README: no apt-get from `make test` then
        install = subprocess.CompletedProcess([], 0)
    else:
        install = sim(probe_dir, "install", timeout=600, check=False)
    if install.returncode != 0:
        pytest.skip(f"cannot install openssh-server/pdsh: {install.stderr.strip()[-500:]}")
    check = sim(probe_dir, "check", check=False)
    if check.returncode != 0:
        pytest.skip(f"cannot simulate hosts here: {(check.stdout + check.stderr).strip()}")


@pytest.fixture(scope="module")
def hosts(can_simulate, tmp_path_factory):
    """Two hosts, up for the whole module; torn down (and checked) even when a test fails."""
    sim_dir = tmp_path_factory.mktemp("hosts") / "sim"
    before = outside_state(sim_dir)
    try:
        sim(sim_dir, "up", timeout=120)
        info = dict(line.split("=", 1) for line in sim(sim_dir, "env").stdout.split())
        yield {"dir": sim_dir, **info}
    finally:
        sim(sim_dir, "down", timeout=120, check=False)
    after = outside_state(sim_dir)
    assert after == before, f"multinode_sim.sh down left changes behind:\n{before}\n{after}"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A small corpus (Python's pydoc topics, ~0.5 MB) and the module's tokenizer + token cache:
    building the cache for the default `builtin` corpus would cost a minute."""
    from pydoc_data.topics import topics

    path = tmp_path_factory.mktemp("data")
    with open(path / "corpus.jsonl", "w") as f:
        f.writelines(json.dumps({"text": topics[k]}) + "\n" for k in sorted(topics))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_dir):
    """Lazily launched runs, keyed by name, each paid for once. `where` is "local" (one machine,
    2 local ranks, tests.trainer_utils.launch) or the `hosts` fixture (one rank on each host)."""
    cache = {}

    def get(name: str, kind: str, flags: list[str], where="local"):
        if name not in cache:
            out = tmp_path_factory.mktemp(name)
            flags = ["--data_path", str(data_dir / "corpus.jsonl"), *flags]
            if where == "local":
                proc = launch(kind, flags, out, data_dir)
            else:
                common = [*BASE_FLAGS, "--data_output_path", str(data_dir), "--output_dir", str(out), *flags]
                script = "train_deepspeed.py" if kind == "deepspeed" else "train_ddp.py"
                proc = sim(where["dir"], "deepspeed" if kind == "deepspeed" else "torchrun", script, *common)
            cache[name] = (out, proc.stdout + proc.stderr)
        return cache[name]

    return get


def flags(kind: str, steps: int = STEPS) -> list[str]:
    config = ["--deepspeed_config", f"ds_configs/{kind}.json"] if kind.startswith("zero") else []
    return [*config, "--max_steps", str(steps), *CONST_LR, "--save_interval", str(STEPS)]


@pytest.fixture(scope="module")
def reference(runs) -> list[float]:
    """The one-machine curve every two-host run is held to: 2 local ranks, ZeRO-2, 2*STEPS steps.
    Its first STEPS steps are those of a STEPS-step run with the same flags (constant LR after
    warmup), and ZeRO-3 and DDP log ZeRO-2's losses on one machine (the trainers' contract,
    tests/test_trainers.py), so one reference serves all: a two-host run that differs from it
    differs from its own one-machine twin. Run first, it also builds the shared token cache."""
    out, _ = runs("local-zero2", "deepspeed", flags("zero2", 2 * STEPS))
    return losses(out)


def assert_world_of_two(out, steps: int = STEPS):
    records = read_metrics(out)
    assert records[0]["event"] == "config" and records[0]["world_size"] == 2, records[0]
    assert [r["step"] for r in records if r["event"] == "train"] == list(range(1, steps + 1))


def test_deepspeed_hostfile_over_ssh_matches_one_machine(hosts, reference, runs):
    """ZeRO-2 (its run also serves the resume below). The stage is the engine's business, not the
    launcher's: ZeRO-3 takes the same hostfile, ssh and pdsh path, and its 2-rank curve is ZeRO-0's
    (tests/test_trainers.py::test_zero_stages_give_zero0_losses), so it is not launched again here."""
    out, log = runs("hosts-zero2", "deepspeed", flags("zero2"), where=hosts)
    assert_world_of_two(out)
    # each rank ran on its own host, started over ssh: pdsh prefixes lines with the host they came from
    for k in (0, 1):
        assert f"{hosts[f'SIM_ADDR{k}']}: " in log and f"node_rank={k}" in log, log[-3000:]
    # and .deepspeed_env reached the remote host (DeepSpeed's launch.py logs the NCCL_* it sees)
    seen = f"1 NCCL_SOCKET_IFNAME={hosts['SIM_IFNAME']}"  # "1": node rank
    assert any(line.startswith(f"{hosts['SIM_ADDR1']}: ") and seen in line for line in log.splitlines())
    assert_close_curves(losses(out), reference[:STEPS])


def test_torchrun_nnodes_2_matches_one_machine(hosts, reference, runs):
    out, log = runs("hosts-ddp", "ddp", flags("ddp"), where=hosts)
    assert_world_of_two(out)
    assert "[host1] " in log
    assert_close_curves(losses(out), reference[:STEPS])


def test_two_host_checkpoint_resumes_on_one_machine(hosts, reference, runs, data_dir, tmp_path):
    """Steps 1..N on two hosts (1 rank each), then N+1..2N on one machine (2 local ranks) from
    the same --output_dir: the reference's second half."""
    out, _ = runs("hosts-zero2", "deepspeed", flags("zero2"), where=hosts)
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{STEPS:08d}"
    resumed = shutil.copytree(out, tmp_path / "resumed")  # the cached two-host run stays as it was
    more = ["--data_path", str(data_dir / "corpus.jsonl"), *flags("zero2", 2 * STEPS), "--resume", "auto"]
    proc = launch("deepspeed", more, resumed, data_dir)
    assert f"at step {STEPS}" in proc.stdout + proc.stderr
    records = [r for r in read_metrics(resumed) if r["event"] == "train"]
    assert [r["step"] for r in records] == list(range(1, 2 * STEPS + 1))
    assert_close_curves([r["loss"] for r in records[STEPS:]], reference[STEPS:])


# --- bytes on the wire, counted by the kernel; a shaped link ----------------------------------------

SHAPED = "20mbit"  # the debug preset moves ~0.7 MB a step (DDP): ~0.3 s of link a step, >10x its compute


def last_comm(out) -> dict:
    return [r for r in read_metrics(out) if r["event"] == "comm"][-1]


def unprobed_step_s(out) -> float:
    """The median step time of the steps after the first, the probed last one left out."""
    train = [r for r in read_metrics(out) if r["event"] == "train"][1:-1]
    return statistics.median(r["step_time_s"] for r in train)


@pytest.fixture(scope="module")
def wire_runs(hosts, runs):
    """DDP, ZeRO-2 and ZeRO-3 across the two hosts (ZeRO-2's and DDP's are the runs above), then DDP and
    ZeRO-2 again with both hosts' links shaped to SHAPED. Each run's last step is probed: its comm record
    has the bytes each rank's interface sent during that step, as the kernel counts them."""
    out = {
        name: runs(f"hosts-{name}", *launch_of(name), where=hosts)[0] for name in ("ddp", "zero2", "zero3")
    }
    sim(hosts["dir"], "shape", SHAPED)
    try:
        for name in ("ddp", "zero2"):
            out[f"shaped-{name}"] = runs(f"shaped-{name}", *launch_of(name), where=hosts)[0]
    finally:
        sim(hosts["dir"], "shape", "off")
    return out


def launch_of(name: str) -> tuple[str, list[str]]:
    return ("ddp" if name == "ddp" else "deepspeed"), flags(name)


def test_comm_record_counts_the_bytes_the_kernel_sees_on_the_wire(wire_runs, hosts):
    """Per rank and step, the comm record's wire bytes (comm.wire_factor: a 2-rank ring all-reduce sends
    its tensor once, gloo's reduce-scatter is an all-reduce) within 10% of what each simulated host's
    interface sent (/sys/class/net/IF/statistics/tx_bytes, read by the probe around the step). Before:
    the record counted the paper's 2 Psi for DDP (twice the wire's) and 2 Psi for ZeRO-3, whose wire
    carries 1.5x DDP's. The paper's count stays beside it (bytes_total)."""
    psi = 4 * read_metrics(wire_runs["ddp"])[0]["num_params"]  # fp32 bytes
    for name, wire_psi in (("ddp", 1.0), ("zero2", 1.5), ("zero3", 1.5)):
        comm = last_comm(wire_runs[name])
        assert comm["link_interface"] == hosts["SIM_IFNAME"], comm
        for rank in (0, 1):
            kernel, wire = comm["link_tx_bytes"][rank], comm["wire_bytes_total"][rank]
            assert wire == pytest.approx(wire_psi * psi, rel=0.02), (name, rank, wire, psi)
            assert kernel == pytest.approx(wire, rel=0.10), (name, rank, kernel, wire)
    assert last_comm(wire_runs["ddp"])["bytes_total"][0] == 2 * psi  # the paper's all-reduce: 2 Psi


def test_a_shaped_link_slows_the_strategy_that_moves_more_bytes_more(wire_runs):
    """At SHAPED, ZeRO-2 (1.5x DDP's bytes on the wire: the same gradient all-reduce, beside backward as
    DDP's, then the updated parameters broadcast after the step, which nothing hides) loses more time a
    step than DDP does, by at least a third of the extra bytes' time at the link rate. (ZeRO-3 also sends
    1.5x, but prefetches its gathers on gloo's threads beside compute: docs/cluster.md.)"""
    slower = {name: unprobed_step_s(wire_runs[f"shaped-{name}"]) - unprobed_step_s(wire_runs[name])
              for name in ("ddp", "zero2")}  # fmt: skip
    extra = (
        last_comm(wire_runs["zero2"])["wire_bytes_total"][0]
        - last_comm(wire_runs["ddp"])["wire_bytes_total"][0]
    )
    assert slower["zero2"] - slower["ddp"] > extra * 8 / 20e6 / 3, slower


# --- bad input: a clear error: line, and nothing left behind ----------------------------------------


@pytest.mark.parametrize(
    "setting, message",
    [
        ({"LLT_SIM_RATE": "fast"}, "error: link rate 'fast' (burst 256kb, latency 50ms) refused: tc says: "),
        ({"LLT_SIM_RATE": "1gbit", "LLT_SIM_BURST": "1kb"}, "error: LLT_SIM_BURST=1kb is below 64kb"),
        ({"LLT_SIM_HOSTS": "300"}, "error: LLT_SIM_HOSTS=300: one /24 holds at most 253 hosts"),
        ({"LLT_SIM_HOSTS": "250"}, "error: LLT_SIM_HOSTS=250: this machine cannot hold 250 hosts"),
        ({"LLT_SIM_HOSTS": "1"}, "error: LLT_SIM_HOSTS=1: the simulation needs a whole number of hosts >= 2"),
    ],
)
def test_bad_simulations_are_refused_in_one_line_and_leave_nothing(can_simulate, tmp_path, setting, message):
    available = int(
        next(line.split()[1] for line in open("/proc/meminfo") if line.startswith("MemAvailable:"))
    )
    if setting.get("LLT_SIM_HOSTS") == "250" and available > 250 * 512 * 1024:
        pytest.skip("this machine can hold 250 hosts")
    sim_dir = tmp_path / "sim"
    before = outside_state(sim_dir)
    proc = subprocess.run(
        ["bash", str(SIM), "up"],
        env={**sim_env(sim_dir), **setting},
        capture_output=True,
        text=True,
        timeout=120,
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode != 0 and len(errors) == 1 and errors[0].startswith(message), proc.stderr
    assert outside_state(sim_dir) == before


def test_a_simulation_left_up_by_a_crash_is_named_and_taken_down(can_simulate, tmp_path):
    """A command that brought the hosts up is killed (SIGKILL: no trap runs): its namespaces, sshds and
    ssh config block stay. The next command says so in one error: line and takes all of it down."""
    sim_dir = tmp_path / "sim"
    before = outside_state(sim_dir)
    crashed = subprocess.Popen(["bash", str(SIM), "exec", "0", "sleep", "300"], env=sim_env(sim_dir),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 60
    while not (sim_dir / "hosts.env").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1)  # `up` done: its hosts are waiting for ssh
    crashed.send_signal(signal.SIGKILL)
    crashed.wait()
    assert outside_state(sim_dir)["namespaces"], "the crash should have left the hosts up"
    proc = sim(sim_dir, "exec", "1", "true", check=False)
    assert proc.returncode != 0, proc.stderr
    (error,) = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert f"left up by process {crashed.pid}, which is gone" in error and "taking it down" in error
    assert outside_state(sim_dir) == before


def test_sim_tears_down_when_the_command_fails(can_simulate, tmp_path):
    """Without a prior `up`, a command brings the hosts up and down around itself; its trap
    undoes everything when the command fails and when `up` itself fails halfway."""
    before = outside_state(tmp_path / "sim")
    proc = sim(tmp_path / "sim", "exec", "1", "sh", "-c", "hostname -I; exit 7", check=False)
    assert proc.returncode == 7, proc.stderr
    assert proc.stdout.split()[0].endswith(".2")  # it ran on host 1
    assert outside_state(tmp_path / "sim") == before

    before = outside_state(tmp_path / "sim2")
    e = {**sim_env(tmp_path / "sim2"), "LLT_SIM_IFNAME": "an-interface-name-too-long"}
    proc = subprocess.run(["bash", str(SIM), "up"], env=e, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "up failed, tearing down" in proc.stderr, proc.stderr
    assert outside_state(tmp_path / "sim2") == before


def stop_at_step_3(cmd: list[str], e: dict, steps: int) -> tuple[subprocess.Popen, str]:
    """Starts `cmd`, sends one SIGTERM to host 0's front after step 3's log line; its output."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = []
    for line in proc.stdout:
        output.append(line)
        if f"step      3/{steps}" in line:
            break
    else:
        raise AssertionError("".join(output)[-3000:])
    (front,) = [  # with a front per host: host 0's, the rendezvous's (--node_rank 0)
        p
        for p in psutil.Process(proc.pid).children(recursive=True)
        if "llama_train.launch" in p.cmdline() and "--node_rank 1" not in " ".join(p.cmdline())
    ]
    front.send_signal(signal.SIGTERM)
    return proc, "".join(output) + proc.communicate(timeout=180)[0]


def left_running(out) -> list:
    """Processes of the run in `out` still running, after up to 60 s: on either host (the namespaces
    share this machine's process table)."""

    def left():
        return [
            p.info["cmdline"]
            for p in psutil.process_iter(["cmdline"])
            if str(out) in " ".join(p.info["cmdline"] or [])
        ]

    deadline = time.monotonic() + 60
    while left() and time.monotonic() < deadline:
        time.sleep(1)
    return left()


FRONTS = {  # the command's word, LLT_SIM_FRONT
    "deepspeed": ("deepspeed", "1"),
    "torchrun": ("torchrun", "1"),
    "torchrun-front-per-host": ("torchrun", "all"),
}


@pytest.mark.parametrize("kind,fronts", FRONTS.values(), ids=FRONTS.keys())
def test_sigterm_to_the_front_stops_the_ranks_on_both_hosts(hosts, data_dir, tmp_path, kind, fronts):
    """`python -m llama_train.launch deepspeed --hostfile ...` on host 0, every rank started over pdsh
    (which exports none of the front's environment), or the front before host 0's torchrun --nnodes 2,
    or a front before each host's torchrun on the shared --output_dir: one SIGTERM to host 0's front,
    and both ranks finish their step, one checkpoint is saved, every front exits 0, nothing is left
    running on either host. (Five such stops with a front per host, each resumed with --resume auto:
    docs/benchmarks/2026-12-06-cpu-xeon-2core-front-per-host/run.sh.) Before issue 25, deepspeed: the
    stop file was an environment variable no rank received; the run trained on to its last step. Before
    issue 47, a front per host: a front that found the stop file already removed exited 1."""
    out, steps = tmp_path / "run", 400
    common = [*BASE_FLAGS, "--data_output_path", str(data_dir), "--output_dir", str(out)]
    common += ["--data_path", str(data_dir / "corpus.jsonl"), "--max_steps", str(steps), "--no_export"]
    cmd = ["bash", str(SIM), "torchrun", "train_ddp.py"]
    if kind == "deepspeed":
        cmd = [
            "bash",
            str(SIM),
            "deepspeed",
            "train_deepspeed.py",
            "--deepspeed_config",
            "ds_configs/zero2.json",
        ]
    e = {**sim_env(hosts["dir"]), "LLT_SIM_FRONT": fronts}
    proc, output = stop_at_step_3(cmd + common, e, steps)
    assert proc.returncode == 0, output[-4000:]
    assert "stopped after step" in output and "the launcher was signalled" in output, output[-3000:]
    for k in (0, 1):  # a rank on each host heard it (pdsh and the script prefix each host's lines)
        host = f"{hosts[f'SIM_ADDR{k}']}: " if kind == "deepspeed" else f"[host{k}] "
        assert f"{host}[rank {k}] the launcher was signalled" in output, output[-3000:]
        assert kind == "deepspeed" or f"multinode_sim: host {k} exited 0" in output, output[-3000:]
    assert "Traceback" not in output, output[-4000:]
    last = [r["step"] for r in read_metrics(out) if r["event"] == "train"][-1]
    assert 3 <= last < steps and (out / "checkpoints" / "latest").read_text().strip() == f"step_{last:08d}"
    assert not (out / "llama_train.stop").exists()  # the fronts clean up after themselves
    assert not left_running(out)
