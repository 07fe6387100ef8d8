"""The one base class of every error a user can fix: bad flags, a bad config, missing or malformed
data, an unusable checkpoint. The trainers' run_main and every script catch `UserError` alone and
print its message as one `error:` line with exit status 2; anything else is a bug and keeps its
traceback. Each subclass also keeps the builtin base it always had (ValueError, FileNotFoundError,
...), so callers that catch those keep working."""


class UserError(Exception):
    """A problem with the input or the environment that the message tells the user how to fix."""
