"""Check a DeepSpeed hostfile (and optionally a .deepspeed_env) before launching.

    python scripts/check_hostfile.py hostfile                  # format only
    python scripts/check_hostfile.py hostfile --resolve        # also: every host name resolves here
    python scripts/check_hostfile.py hostfile --ssh            # also: ssh reaches every host, no prompt
    python scripts/check_hostfile.py hostfile --deepspeed_env .deepspeed_env

Exit status 0 when the file is usable, 2 with one `FILE:LINE: problem` line per problem
otherwise. The format is DeepSpeed's: one `HOSTNAME slots=N` per line, `#` comments and blank
lines ignored; llama_train/ops/hostfile.py says what DeepSpeed's own parser misreads.

`--resolve` is opt-in because cluster host names often resolve only on the cluster (run it
there, or on the node you launch from). `--ssh` runs `ssh -o BatchMode=yes HOST hostname` for every
host, as DeepSpeed's launcher and pdsh will, except for a hostfile naming only this machine
(`localhost slots=N`): `python -m llama_train.launch deepspeed --hostfile ...` starts its ranks here
without ssh (plain `deepspeed` needs `--no_ssh_check --master_addr 127.0.0.1` for that).
"""

import argparse
import sys

from llama_train.ops.hostfile import check_deepspeed_env, check_hostfile, is_this_machine, ssh_problems


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("hostfile", help="DeepSpeed hostfile: one 'HOSTNAME slots=N' per line")
    p.add_argument("--resolve", action="store_true", help="also require every host name to resolve here")
    p.add_argument(
        "--ssh",
        action="store_true",
        help="also require passwordless ssh to every host (not needed for a hostfile of localhost alone)",
    )
    p.add_argument("--deepspeed_env", metavar="FILE", help="also check this .deepspeed_env file")
    args = p.parse_args(argv)

    report = check_hostfile(args.hostfile, resolve=args.resolve)
    problems = report.problems + (check_deepspeed_env(args.deepspeed_env) if args.deepspeed_env else [])
    local = len(report.hosts) == 1 and is_this_machine(next(iter(report.hosts)))
    if args.ssh and report.ok and not local:
        problems += ssh_problems(args.hostfile, report)
    if problems:
        print("\n".join(problems), file=sys.stderr)
        if len(problems) > 1:  # one problem is one line, as every script's error
            print(f"{len(problems)} problems; not launching", file=sys.stderr)
        return 2
    hosts = ", ".join(f"{h} slots={n}" for h, n in report.hosts.items())
    print(f"{args.hostfile}: {len(report.hosts)} host(s), {sum(report.hosts.values())} slot(s): {hosts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
