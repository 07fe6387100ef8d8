"""The stop request between the launch front and the ranks: a file under the run's --output_dir that
`python -m llama_train.launch` writes on the first SIGTERM/SIGINT and every rank looks for after each
step (train/guards.Stopper). A path under --output_dir reaches ranks on other hosts, which a launcher's
environment does not."""

import os

STOP_NAME = "llama_train.stop"  # <output_dir>/STOP_NAME: the stop request every rank looks for
STALE_S = 60.0  # a stop file older than this before a rank started is a dead run's: ignored


def stop_path(output_dir: str) -> str:
    return os.path.join(output_dir, STOP_NAME)
