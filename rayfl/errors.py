"""Errors a user can cause. The CLI prints them as one line and exits with code 2."""

from __future__ import annotations

import difflib
import errno
import re
from collections.abc import Iterable


class UserError(Exception):
    """A problem the user can fix (bad config, missing data, impossible resources).

    The message names the problem and the fix in one line; no traceback is shown.
    """


class ConfigError(UserError):
    """An invalid configuration value or key."""


def suggest(name: str, choices: Iterable[str]) -> str:
    """Return ' (did you mean X?)' for the closest choice, or ''."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def require(condition: bool, key: str, problem: str) -> None:
    """Raise a ConfigError `key: problem` unless `condition` holds."""
    if not condition:
        raise ConfigError(f"{key}: {problem}")


NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=,@-]{0,99}")


def check_name(value: object, key: str) -> None:
    """A name that becomes part of a folder's name, a plot's title or a page (a suite's or a
    sweep's name, an algorithm label, a setting, a registered name): letters, digits and
    `_.+=,@-`, not starting with `.` or `-`, at most 100 characters; never a path or markup.

    Raises:
        ConfigError: one line naming `key` and the rule.
    """
    require(
        isinstance(value, str) and NAME.fullmatch(value) is not None,
        key,
        f"{value!r:.60} is not a name: use 1-100 letters, digits and _.+=,@- (starting with a "
        "letter, digit or _)",
    )


# what the machine refused, not what rayfl got wrong: a full disk, a quota, a read-only or
# forbidden folder
ENVIRONMENT = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


def environment_error(exc: OSError) -> str:
    """One line for an `ENVIRONMENT` error: what failed, and where."""
    where = f" writing {exc.filename}" if exc.filename else ""
    return f"{exc.strerror or exc}{where}"


def one_line(exc: BaseException) -> str:
    """The user's message of an error, also when Ray wrapped it (an error raised in an actor)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, UserError):
        exc = cause
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
