"""A quiet, honest console: library output that means nothing to a user is hidden by name (never
all warnings), and `--verbose` brings it back.

What is hidden, and why:
- torch's FutureWarning that `all_gather_into_tensor` is deprecated: DeepSpeed 0.19.8 calls it for
  ZeRO-1/2 on every rank; nothing a user of this trainer can change.
- DeepSpeed's INFO lines (engine configuration, timers): DeepSpeed's own logger stays at WARNING
  unless --verbose (the `deepspeed` launcher takes `--log_level` for its own lines).
- transformers' "Writing model shards" bar in save_pretrained: one export, a bar that garbles logs.
"""

import logging
import warnings

# (message regex, category): library warnings hidden unless --verbose
HIDDEN_WARNINGS = [
    (r"`torch\.distributed\.all_gather_into_tensor` is deprecated", FutureWarning),
]


def quiet_console(verbose: bool):
    """Apply the filters above (or show everything at INFO with `verbose`)."""
    if verbose:
        logging.getLogger("DeepSpeed").setLevel(logging.INFO)
        return
    for message, category in HIDDEN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # transformers is a dependency; a broken install shows its error elsewhere
        return
    hf_logging.disable_progress_bar()
