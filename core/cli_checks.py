"""Checks of command-line arguments shared by the core CLIs (train, sample, evaluate), done before any model
is loaded. Each raises :class:`UsageError` (a ``ValueError``) whose message names the flag, the value and
the rule; the CLIs print it as one ``error:`` line and exit 2.
"""

from __future__ import annotations

import math
import os
from pathlib import Path


class UsageError(ValueError):
    """A command-line argument breaks a rule."""


def int_in(flag: str, value: int, low: int, high: int) -> int:
    if not (low <= value <= high):
        raise UsageError(f"{flag}={value}: must be an integer in [{low}, {high}]")
    return value


def number_in(flag: str, value: float, low: float, high: float) -> float:
    if not (math.isfinite(value) and low <= value <= high):
        raise UsageError(f"{flag}={value}: must be a finite number in [{low:g}, {high:g}]")
    return value


def _nearest_existing(path: Path) -> Path:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def writable_dir(flag: str, path: Path) -> Path:
    """A folder we may create or write into: not an existing file, under a writable existing folder."""
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag}={str(path)!r}: is an existing file; give a folder (it is created if missing)")
    base = _nearest_existing(path)
    if not base.is_dir():
        raise UsageError(f"{flag}={str(path)!r}: {str(base)!r} is a file, so the folder cannot be created there")
    if not os.access(base, os.W_OK | os.X_OK):
        raise UsageError(f"{flag}={str(path)!r}: {str(base)!r} is not writable by this user")
    return path


def writable_file(flag: str, path: Path, suffixes: tuple[str, ...]) -> Path:
    """A file we may write: a known suffix, not a folder, in a folder we may create or write into."""
    if path.suffix.lower() not in suffixes:
        raise UsageError(f"{flag}={str(path)!r}: the file name must end in {' or '.join(suffixes)}")
    if path.is_dir():
        raise UsageError(f"{flag}={str(path)!r}: is a folder; give a file name")
    if path.exists() and not os.access(path, os.W_OK):
        raise UsageError(f"{flag}={str(path)!r}: the file is not writable by this user")
    base = _nearest_existing(path.parent)
    if not base.is_dir():
        raise UsageError(f"{flag}={str(path)!r}: {str(base)!r} is a file, so the image cannot be written under it")
    if not os.access(base, os.W_OK | os.X_OK):
        raise UsageError(f"{flag}={str(path)!r}: {str(base)!r} is not writable by this user")
    return path
