"""How the trainers start and end: a user error is one line and exit 2, a finished run exits 0."""

import logging
import os
import sys

from llama_train.checkpoint import CheckpointError
from llama_train.config import ConfigError
from utils.data.sources import DataSourceError
from utils.data.tokenizer import VocabSizeError

# errors that mean "the input or the flags are wrong", printed without a traceback
USER_ERRORS = (
    ConfigError,
    DataSourceError,
    FileNotFoundError,
    VocabSizeError,
    CheckpointError,
    FloatingPointError,
)


def run_main(main):
    """Run a trainer's main; a user error prints one clear line and exits 2 (no traceback).

    A finished run leaves with os._exit(0) once its output is flushed: every file (checkpoints,
    metrics, export) is closed by then, and library threads still alive at interpreter teardown
    (gloo's, Kineto's profiler thread: pytorch/kineto#1051) otherwise abort some finished runs
    with "terminate called without an active exception", which the launcher reports as a failure."""
    try:
        main()
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
