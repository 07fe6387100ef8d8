"""How the trainers and scripts start and end: a user error is one line and exit 2, a finished run
exits 0, and `--help` shows each default once."""

import argparse
import logging
import os
import sys

from llama_train.console import quiet_console
from llama_train.errors import UserError


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's "(default: X)", except where the help text already says its default or there is
    none to show (None, False, a store_true flag): `--help` then printed some defaults twice."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text.lower() or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def user_error(e: UserError) -> int:
    """One `error:` line, written whole: print() writes the text and its newline separately, so with
    unbuffered stderr two ranks stopping together interleaved their lines ("...resume from iterror: ...")."""
    sys.stderr.write(f"error: {e}\n")
    sys.stderr.flush()
    return 2


def run_main(main):
    """Run a trainer's main; a user error (llama_train.errors.UserError) prints one clear line and
    exits 2 (no traceback).

    A finished run leaves with os._exit(0) once its output is flushed: every file (checkpoints,
    metrics, export) is closed by then, and library threads still alive at interpreter teardown
    (gloo's, Kineto's profiler thread: pytorch/kineto#1051) otherwise abort some finished runs
    with "terminate called without an active exception", which the launcher reports as a failure."""
    try:
        main()
    except UserError as e:
        sys.exit(user_error(e))
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_script(main) -> None:
    """A script's entry point: `main()`'s return value is the exit status; a UserError is one
    `error:` line and exit 2, as in the trainers."""
    quiet_console(verbose=False)  # e.g. transformers' "Loading weights" bar: garbles a log file
    try:
        code = main()
    except UserError as e:
        code = user_error(e)
    sys.exit(code or 0)
