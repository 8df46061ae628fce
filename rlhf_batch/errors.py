"""Errors a user can act on. The CLI prints their message as one line and exits non-zero
(with `--debug`, the traceback too); so is an OSError (`os_error_line`: a file that cannot be read or
written is the machine's state, not a bug); anything else is a bug and keeps its traceback."""

import errno
import os


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


DISK_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
ADVICE = {
    **dict.fromkeys(DISK_FULL, "free disk space and run again"),
    errno.EACCES: "check its permissions (and the folders' above it) for this user",
    errno.EPERM: "check its permissions (and the folders' above it) for this user",
    errno.EROFS: "give a path on a writable file system",
    errno.ENAMETOOLONG: "use a shorter path (at most 255 bytes per folder or file name)",
    errno.ENOTDIR: "a file stands where the path needs a folder",
    errno.EEXIST: "a file stands where the path needs a folder",
    errno.EISDIR: "a folder stands where the path needs a file",
}


def os_error_line(e: OSError, what: str = "") -> str:
    """An OSError as one line: the file(s) it names, the system's reason, what to do."""
    names = " -> ".join(os.fsdecode(f) for f in (e.filename, e.filename2) if f is not None)
    where = f"{what} {names}".strip() if names else what
    reason = e.strerror or str(e) or type(e).__name__
    advice = ADVICE.get(e.errno or -1)
    return f"{where + ': ' if where else ''}{reason}{'; ' + advice if advice else ''}"
