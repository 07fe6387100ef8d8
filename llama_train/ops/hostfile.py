"""DeepSpeed hostfiles and .deepspeed_env files checked before a launch, every problem named by
its line (scripts/check_hostfile.py is the command line).

The hostfile format is DeepSpeed's: one `HOSTNAME slots=N` per line, `#` comments and blank lines
ignored. DeepSpeed's own parser accepts some lines it then misreads (`slots=8x` is 8, a host with
`slots=0` silently disappears) and stops at the first problem with the whole file in the message.
"""

import os
import re
import shutil
import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

# what pdsh, ssh and DeepSpeed's --include/--exclude syntax (host:slots@host) can all carry
HOSTNAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?$")
ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass
class Report:
    hosts: dict[str, int] = field(default_factory=dict)  # host -> slots, in file order
    problems: list[str] = field(default_factory=list)  # "FILE:LINE: message"
    lines: dict[str, int] = field(default_factory=dict)  # host -> its line number

    @property
    def ok(self) -> bool:
        return not self.problems


def _resolves(host: str) -> bool:
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError):
        return False
    return True


def check_hostfile(path: str, resolve: bool = False) -> Report:
    """Every problem in the hostfile at `path`, each naming its line."""
    report = Report()
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        report.problems.append(f"{path}: cannot read the hostfile: {e.strerror}")
        return report

    first_line: dict[str, int] = {}
    for lineno, raw in enumerate(lines, start=1):
        where = f"{path}:{lineno}"
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        host, *rest = line.split()
        if not HOSTNAME.match(host):
            report.problems.append(
                f"{where}: {host!r} is not a host name or IPv4 address (letters, digits, '.', '-', '_')"
            )
            continue
        if rest and rest[0] == "slots":
            report.problems.append(f"{where}: write 'slots=N' without spaces around '='")
            continue
        if not rest or not rest[0].startswith("slots="):
            report.problems.append(
                f"{where}: missing 'slots=N' after {host!r} (write '{host} slots=N', N = GPUs on that node)"
            )
            continue
        value = rest[0][len("slots=") :]
        if not value.isdigit() or int(value) < 1:
            report.problems.append(f"{where}: slots must be a whole number >= 1, got 'slots={value}'")
            continue
        if host in first_line:
            report.problems.append(
                f"{where}: duplicate host {host!r} (first listed on line {first_line[host]}); "
                "list each node once with all its slots"
            )
            continue
        if resolve and not _resolves(host):
            report.problems.append(
                f"{where}: unknown host {host!r}: the name does not resolve on this machine"
            )
        first_line[host] = lineno
        report.hosts[host] = int(value)
    report.lines = first_line

    if not report.hosts and not report.problems:
        report.problems.append(f"{path}: no hosts (every line is blank or a comment)")
    return report


def check_deepspeed_env(path: str) -> list[str]:
    """Problems in a .deepspeed_env file. DeepSpeed splits every line at its first '=' and exports it
    on every node: a blank line or one without '=' stops the launcher with a bare ValueError, and a
    commented '# X=1' is exported under the name '# X'."""
    try:
        with open(path) as f:
            lines = f.read().split("\n")
    except OSError as e:
        return [f"{path}: cannot read the file: {e.strerror}"]
    if lines and lines[-1] == "":
        lines.pop()  # the newline that ends the last line
    problems = []
    for lineno, line in enumerate(lines, start=1):
        key, sep, _ = line.partition("=")
        if not sep or not ENV_KEY.match(key.strip()):
            what = "a blank line" if not line.strip() else repr(line)
            problems.append(
                f"{path}:{lineno}: {what} is not KEY=VALUE (DeepSpeed reads every line, "
                "comments and blank lines included)"
            )
    return problems


SSH_TIMEOUT_S = 10  # per host, all hosts at once: a host that does not answer within it is unreachable
THIS_MACHINE = {"localhost", "127.0.0.1", "::1"}


def is_this_machine(host: str) -> bool:
    """`host` names the machine this runs on (localhost, a loopback address, its own host name)."""
    return host in THIS_MACHINE or host.startswith("127.") or host in (socket.gethostname(), socket.getfqdn())


def ssh_probe(host: str, port: int | None = None, timeout_s: int = SSH_TIMEOUT_S) -> str | None:
    """None when `ssh HOST hostname` runs without a prompt (what DeepSpeed's launcher and pdsh need),
    else why not: ssh's own last line. BatchMode: a password or host-key prompt fails instead of waiting."""
    if shutil.which("ssh") is None:
        return "no ssh client on this machine (apt-get install openssh-client)"
    port_args = ["-p", str(port)] if port else []
    cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={timeout_s}", *port_args, host, "hostname"]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout_s + 5, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        return f"no answer within {timeout_s + 5} s"
    if proc.returncode == 0:
        return None
    said = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    return said[-1] if said else f"ssh exited {proc.returncode}"


def ssh_problems(path: str, report: Report, hosts=None, port: int | None = None) -> list[str]:
    """One `FILE:LINE:` problem per host (of `hosts`, default all the report's) that ssh cannot reach
    without a password, naming the fix; the hosts are tried at once. DeepSpeed's launcher ssh-checks
    the first host even when it is the only one, and pdsh starts every rank over ssh."""
    hosts = list(report.hosts if hosts is None else hosts)
    with ThreadPoolExecutor(max_workers=min(32, max(1, len(hosts)))) as pool:
        found = dict(zip(hosts, pool.map(lambda h: ssh_probe(h, port), hosts)))
    return [
        f"{path}:{report.lines.get(host, 0)}: cannot ssh to {host!r} without a password ({why}): DeepSpeed "
        f"starts every host's ranks over ssh (pdsh); set up passwordless ssh (ssh-copy-id {host}; "
        f"apt-get install pdsh on this node), or for one machine list only `localhost slots=N`"
        for host, why in found.items()
        if why is not None
    ]


def _flag(words: list[str], name: str) -> str | None:
    """The value of `--name V` / `--name=V` among `words` (the last one given), else None."""
    found = None
    for i, word in enumerate(words):
        if word == name and i + 1 < len(words):
            found = words[i + 1]
        elif word.startswith(name + "="):
            found = word.split("=", 1)[1]
    return found


def active_hosts(
    hosts: list[str], include: str | None, exclude: str | None, num_nodes: str | None
) -> list[str]:
    """The hosts DeepSpeed's launcher will use, in order: --include/--exclude (`host[:slots]@...`;
    a host excluded with slots stays), then the first --num_nodes."""
    if include:
        named = [part.split(":")[0] for part in include.split("@")]
        hosts = [h for h in hosts if h in named]
    if exclude:
        whole = [part for part in exclude.split("@") if ":" not in part]
        hosts = [h for h in hosts if h not in whole]
    n = int(num_nodes) if num_nodes and num_nodes.lstrip("-").isdigit() else -1
    return hosts[:n] if n > 0 else hosts


def deepspeed_hostfile_words(launcher_words: list[str]) -> tuple[list[str], list[str]]:
    """(words to add to a `deepspeed --hostfile` launcher's own arguments, problems that stop the
    launch), for `launcher_words`: the launcher's arguments before the training script.

    - a hostfile whose hosts (after --include/--exclude/--num_nodes) are this machine alone: DeepSpeed
      still ssh-checks it, and asks it over ssh for the master address; its ranks start here without
      ssh, so both are skipped (`--no_ssh_check --master_addr 127.0.0.1`);
    - any other: every host is tried over ssh (pdsh starts each host's ranks over it), and each one
      that fails is one problem naming its line and the fix, instead of DeepSpeed's traceback.
    Nothing to do without --hostfile, with a hostfile that does not exist (DeepSpeed then launches
    here), with --no_ssh / --no_ssh_check / --force_multi, or a launcher other than pdsh."""
    path = _flag(launcher_words, "--hostfile")
    skip = {"--no_ssh", "--no_ssh_check", "--force_multi"} & set(launcher_words)
    if path is None or skip or (_flag(launcher_words, "--launcher") or "pdsh") != "pdsh":
        return [], []
    if not os.path.isfile(path):
        return [], []
    report = check_hostfile(path)
    if not report.ok:
        return [], report.problems
    hosts = active_hosts(
        list(report.hosts),
        _flag(launcher_words, "--include"),
        _flag(launcher_words, "--exclude"),
        _flag(launcher_words, "--num_nodes"),
    )
    if len(hosts) == 1 and is_this_machine(hosts[0]):
        master = [] if _flag(launcher_words, "--master_addr") else ["--master_addr", "127.0.0.1"]
        return ["--no_ssh_check", *master], []
    port = _flag(launcher_words, "--ssh_port")
    return [], ssh_problems(path, report, hosts, int(port) if port and port.isdigit() else None)
