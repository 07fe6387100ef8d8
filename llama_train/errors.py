"""Every error a user can fix: bad flags, a bad config, missing or malformed data, an unusable
checkpoint, a run that cannot go on. The trainers' run_main and every script catch `UserError` alone
and print its message as one `error:` line with exit status 2; anything else is a bug and keeps its
traceback. Each subclass also keeps the builtin base it always had (ValueError, FileNotFoundError,
...), so callers that catch those keep working.

This module imports nothing, so any module can raise these without importing the one that owns the
concern (config.py, checkpoint/): utils/data, which sits below llama_train, imports this leaf and
nothing else of the package (tests/test_layout.py keeps it so)."""


class UserError(Exception):
    """A problem with the input or the environment that the message tells the user how to fix."""


# --- flags and configs ---


class ConfigError(UserError, ValueError):
    """A flag, a combination of flags or a ds_config that cannot run; said before any work."""


# --- checkpoints and weights ---


class CheckpointError(UserError, RuntimeError):
    """A checkpoint or weights file that cannot be used (incomplete, truncated, corrupted, unsafe
    to unpickle, or of another model or run)."""


# --- training ---


class NonFiniteError(UserError, FloatingPointError):
    """Training produced inf/NaN gradients it cannot skip past; the last checkpoint is intact."""


# --- data (utils/data) ---


class DataSourceError(UserError, ValueError):
    """Input data that cannot be used as given (malformed file, empty corpus, bad split ...)."""


class EmptySplitError(DataSourceError):
    """A train or eval split with too little text for one block."""


class SourceNotFoundError(UserError, FileNotFoundError):
    """A data_path entry that names neither a known source nor an existing path."""


class SourceUnavailableError(UserError, RuntimeError):
    """A source that needs something this machine lacks (a library, network access)."""


class CacheError(UserError, RuntimeError):
    """A cache directory that exists but cannot be trusted."""


class CacheWaitTimeout(UserError, TimeoutError):
    """Local rank 0's build did not finish within LLAMA_TRAIN_DATA_WAIT_TIMEOUT."""


class TokenizerError(UserError, ValueError):
    """A --tokenizer path that holds no tokenizer."""


class TokenizerNotFoundError(UserError, FileNotFoundError):
    """A --tokenizer path that does not exist."""


class VocabSizeError(UserError, ValueError):
    """The tokenizer and the model's embedding disagree, or the corpus cannot fill the vocab."""


class LedgerError(UserError, ValueError):
    """A sample ledger that is damaged, truncated or of another run."""
