"""The closed set of errors this kit raises, each with the exit code the CLIs return for it.

Every error subclasses a builtin so callers can catch it without importing us, keeps its data
as attributes, and pickles (errors cross from engine worker processes to their parents).
"""

from __future__ import annotations

# Exit codes, documented in the README ("Exit codes"); one place so CLIs and tests agree.
EXIT_OK = 0
EXIT_NOT_VERIFIED = 1  # verify: some file is not in the expected patched state
EXIT_REFUSED = 2  # unknown/half-patched/missing source state, wrong release: nothing changed
EXIT_BAD_KIT_DATA = 3  # manifest or diff invalid (corrupt, path escape): nothing changed
EXIT_ENVIRONMENT = 4  # engine not found, permission denied, I/O error: nothing changed
EXIT_LOCKED = 5  # another installer holds the lock
EXIT_PENDING = 6  # status/verify: an interrupted patch command left its journal; `patch recover` finishes it
EXIT_CHANGED = 7  # the change was made (past the commit point), but the command did not end normally: a
#                   signal, an unwritable stdout or a failed final check came after it; run `patch verify`
EXIT_ENGINE_ENDED = 8  # serve: the engine ended by itself with status 0 (an engine process died; a unit restarts it)
EXIT_USAGE = 64  # bad command line (EX_USAGE)


class KitError(Exception):
    """Base class; `exit_code` is what the CLI returns."""

    exit_code = EXIT_REFUSED

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __reduce__(self):
        return self.__class__, (self.message,)


class RefusedSourceState(KitError):
    """An engine file is in a state we do not know (or a group is half-patched); nothing was changed."""

    exit_code = EXIT_REFUSED


class UnsupportedRelease(KitError):
    """The installed engine release has no manifest."""

    exit_code = EXIT_REFUSED


class BadKitData(KitError, ValueError):
    """A manifest, diff or sidecar description of ours is malformed or unsafe."""

    exit_code = EXIT_BAD_KIT_DATA


class EnvironmentProblem(KitError, OSError):
    """The engine cannot be found, or a file cannot be read or written."""

    exit_code = EXIT_ENVIRONMENT


class ChangedButUnfinished(KitError):
    """Past the commit point: every file was changed, then the final check (or the report) failed."""

    exit_code = EXIT_CHANGED


class LockHeld(KitError):
    """Another process holds the installer lock."""

    exit_code = EXIT_LOCKED
