"""Errors a user can cause. The CLI prints them as one line and exits with code 2."""

from __future__ import annotations

import difflib
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
