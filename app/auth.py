"""The login of a server bound off loopback: one user and password, compared in constant time, with a lockout
after repeated failures so a password cannot be guessed at the speed of HTTP.

Gradio calls ``auth(username, password)`` from its /login route (it passes no client address, so failures
are counted per user name; any name counts, so guessing names is locked out the same way). A locked-out
attempt raises an HTTP 429 whose detail says how long the lock lasts; the correct password is refused too
while the lock holds. No sleep on failure: the callable runs on the server's event loop, and a sleep there
would stall every page.
"""

from __future__ import annotations

import hmac
import math
import threading
import time
from collections import deque
from typing import Callable

from fastapi import HTTPException

MAX_FAILURES = 5
WINDOW_SECONDS = 300.0
LOCKOUT_SECONDS = 300.0


class LockedOut(HTTPException):
    """Too many failed logins for this user name within the window."""

    def __init__(self, username: str, seconds_left: float, guard: "LoginGuard"):
        super().__init__(status_code=429, detail=(
            f"Too many failed logins for {username[:64]!r}: locked for {math.ceil(seconds_left)} more seconds "
            f"({guard.max_failures} failures within {guard.window:g} s lock the login for {guard.lockout:g} s)."))


class LoginGuard:
    """``auth`` for ``gr.Blocks.launch``: True for the one user and password, with a per-user-name lockout."""

    def __init__(self, username: str, password: str, max_failures: int = MAX_FAILURES,
                 window: float = WINDOW_SECONDS, lockout: float = LOCKOUT_SECONDS,
                 clock: Callable[[], float] = time.monotonic):
        self._user = username.encode()
        self._password = password.encode()
        self.max_failures, self.window, self.lockout, self.clock = max_failures, window, lockout, clock
        self._failures: dict[str, deque[float]] = {}
        self._locked_until: dict[str, float] = {}
        self._lock = threading.Lock()

    def __call__(self, username: str, password: str) -> bool:
        key = (username or "")[:256]  # bounded: the table must not grow with the names an attacker sends
        now = self.clock()
        with self._lock:
            until = self._locked_until.get(key, 0.0)
            if now < until:
                raise LockedOut(key, until - now, self)
            ok = hmac.compare_digest(key.encode(), self._user) & hmac.compare_digest((password or "").encode(),
                                                                                     self._password)
            if ok:
                self._failures.pop(key, None)
                return True
            if len(self._failures) > 10_000:  # a flood of distinct names: forget the oldest, keep locks
                self._failures.pop(next(iter(self._failures)))
            fails = self._failures.setdefault(key, deque())
            fails.append(now)
            while fails and fails[0] <= now - self.window:
                fails.popleft()
            if len(fails) >= self.max_failures:
                self._locked_until[key] = now + self.lockout
                fails.clear()
            return False
