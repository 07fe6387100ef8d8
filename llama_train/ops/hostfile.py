"""DeepSpeed hostfiles and .deepspeed_env files checked before a launch, every problem named by
its line (scripts/check_hostfile.py is the command line).

The hostfile format is DeepSpeed's: one `HOSTNAME slots=N` per line, `#` comments and blank lines
ignored. DeepSpeed's own parser accepts some lines it then misreads (`slots=8x` is 8, a host with
`slots=0` silently disappears) and stops at the first problem with the whole file in the message.
"""

import re
import socket
from dataclasses import dataclass, field

# what pdsh, ssh and DeepSpeed's --include/--exclude syntax (host:slots@host) can all carry
HOSTNAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?$")
ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass
class Report:
    hosts: dict[str, int] = field(default_factory=dict)  # host -> slots, in file order
    problems: list[str] = field(default_factory=list)  # "FILE:LINE: message"

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
