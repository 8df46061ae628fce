"""Errors a user can act on. The CLI prints their message as one line and exits non-zero
(with `--debug`, the traceback too); anything else is a bug and keeps its traceback."""


class UserError(Exception):
    """Bad input, config or state; the message names the file, column, row or option."""


class ConfigError(UserError, ValueError):
    """A config problem; the message names the file and the key."""


class SchemaError(UserError, ValueError):
    """A table does not match the contract; the message names the file and the column."""


class StageError(UserError, RuntimeError):
    """A stage cannot run as asked (inputs missing, config changed, ...)."""


class ModelError(UserError, ValueError):
    """A model or tokenizer directory cannot be used; the message names the directory."""


class RewardError(UserError, RuntimeError):
    """A reward function failed; the message names the function and the rollout."""
