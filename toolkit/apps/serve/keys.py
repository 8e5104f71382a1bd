"""API keys, per-key request rates and monthly character quotas (`onnxformer serve --api-keys FILE`).

The file holds one key a line, optionally followed by its limits; blank lines and '#' comments are skipped:

    # key                              requests/minute   characters/month
    3f9c2a7e-team-a                    rpm=120           chars=5000000
    b81d44c0-batch-jobs                                  chars=200000000
    0a6e5d11-unlimited

A presented key is compared with every known key in constant time (hmac.compare_digest, no early exit), so the
answer's timing does not tell how much of a key was right. Keys are never logged, put in metrics or answered:
an account is shown by its line number ("key 2"). Usage (requests, characters) is counted per key in memory and
restarts with the server; the monthly count restarts on the first request of a new calendar month (UTC).
"""

from __future__ import annotations

import hmac
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from runtime.errors import OnnxformerError


class KeysError(OnnxformerError):
    """An --api-keys file that cannot be used."""


class Denied(Exception):
    """A request refused for its key: kind is missing_key, invalid_key, quota or rate (each API picks its status)."""

    def __init__(self, kind: str, message: str, retry_after: int | None = None):
        super().__init__(message)
        self.kind, self.retry_after = kind, retry_after


@dataclass(eq=False)
class Account:
    """One key's limits and usage (the key itself stays in ApiKeys)."""

    label: str                          # "key 2": how logs, errors and usage name it
    rpm: int | None = None              # requests per minute (None: no limit)
    chars: int | None = None            # characters per calendar month (None: no limit)
    used_chars: int = 0
    requests: int = 0
    month: tuple[int, int] = (0, 0)
    recent: deque = field(default_factory=deque)     # monotonic times of the last minute's requests

    def usage(self) -> dict:
        return {"requests": self.requests, "characters": self.used_chars, "character_limit": self.chars,
                "requests_per_minute": self.rpm}


def _month() -> tuple[int, int]:
    now = datetime.now(timezone.utc)
    return now.year, now.month


class ApiKeys:
    """The known keys and their accounts; `admit` checks a key, its rate and its quota, and counts the request."""

    def __init__(self, entries: list[tuple[str, Account]], protect_metrics: bool = False):
        self._entries = entries                             # none: an open server, one account counts everything
        self._open = Account("anonymous")
        self._lock = threading.Lock()
        self.protect_metrics = protect_metrics              # /metrics needs a key too

    @property
    def open(self) -> bool:
        return not self._entries

    @classmethod
    def load(cls, path: str | Path, protect_metrics: bool = False) -> "ApiKeys":
        path = Path(path)
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise KeysError(f"--api-keys {path} cannot be read ({exc}); pass a text file with one key a line")
        entries: list[tuple[str, Account]] = []
        for number, line in enumerate(lines, 1):
            words = line.split("#")[0].split()
            if words:
                entries.append((words[0], _account(f"key {number}", words[1:], f"{path}:{number}")))
        if not entries:
            raise KeysError(f"--api-keys {path} holds no key; write one key a line")
        if len({key for key, _ in entries}) != len(entries):
            raise KeysError(f"--api-keys {path} lists a key twice; give each client its own key")
        return cls(entries, protect_metrics)

    def find(self, presented: str | None) -> Account:
        """The account of a presented key; Denied (missing_key or invalid_key) otherwise."""
        if self.open:
            return self._open
        if not presented:
            raise Denied("missing_key", "this server needs an API key; send the key you were given")
        found = None
        for key, account in self._entries:                  # every key compared: no early exit
            if hmac.compare_digest(key.encode(), presented.encode()):
                found = account
        if found is None:
            raise Denied("invalid_key", "the API key is not valid; check the key you were given")
        return found

    def admit(self, presented: str | None, characters: int = 0) -> Account:
        """Check the key, its rate (Denied 'rate' with the seconds to wait) and its monthly characters (Denied
        'quota'), then count this request and its characters against it."""
        account = self.find(presented)
        with self._lock:
            now = time.monotonic()
            while account.recent and account.recent[0] <= now - 60:
                account.recent.popleft()
            if account.rpm is not None and len(account.recent) >= account.rpm:
                wait = max(1, math.ceil(account.recent[0] + 60 - now))
                raise Denied("rate", f"{account.label} is over its {account.rpm} requests per minute; "
                                     f"retry after {wait} s", retry_after=wait)
            if account.month != _month():
                account.month, account.used_chars = _month(), 0
            if account.chars is not None and account.used_chars + characters > account.chars:
                raise Denied("quota", f"{account.label} would pass its {account.chars} characters this month "
                                      f"({account.used_chars} used, {characters} asked); wait for next month or ask "
                                      f"for a larger quota")
            account.recent.append(now)
            account.requests += 1
            account.used_chars += characters
        return account

    def refund(self, account: Account, characters: int) -> None:
        """Give back the characters of an admitted request that was not answered (refused later, or failed)."""
        with self._lock:
            account.used_chars = max(0, account.used_chars - characters)


def _account(label: str, words: list[str], where: str) -> Account:
    account = Account(label)
    for word in words:
        name, _, value = word.partition("=")
        if name not in ("rpm", "chars") or not value.isdigit() or int(value) < 1:
            raise KeysError(f"{where}: {word!r} is not a limit; write rpm=N (requests per minute) or chars=N "
                            f"(characters per month), N at least 1")
        setattr(account, name, int(value))
    return account


def bearer(header: str | None, scheme: str = "Bearer") -> str | None:
    """The key of an `Authorization: <scheme> KEY` header (None without one)."""
    if not header:
        return None
    given, _, key = header.strip().partition(" ")
    return key.strip() if given.lower() == scheme.lower() and key.strip() else None


def check_access(host: str, api_keys: Path | None, protect_metrics: bool, allow_open: bool,
                 certfile: Path | None, keyfile: Path | None) -> tuple[ApiKeys | None, tuple | None]:
    """`serve`'s access options checked together: (the keys or None, (certificate, key) or None). A server
    without keys listens on a loopback address only, unless the operator says --allow-open."""
    if protect_metrics and api_keys is None:
        raise KeysError("--protect-metrics needs --api-keys FILE (the keys /metrics then asks for)")
    if (certfile is None) != (keyfile is None):
        raise KeysError("HTTPS needs both --ssl-certfile and --ssl-keyfile (PEM files)")
    for option, path in (("--ssl-certfile", certfile), ("--ssl-keyfile", keyfile)):
        if path is not None and not Path(path).is_file():
            raise KeysError(f"{option} {path} does not exist; pass a PEM file")
    keys = ApiKeys.load(api_keys, protect_metrics) if api_keys is not None else None
    if keys is None and not allow_open and not _loopback(host):
        raise KeysError(f"--host {host} is reachable from other machines, and this server has no --api-keys; "
                        f"pass --api-keys FILE, or --allow-open to serve without keys, or listen on 127.0.0.1")
    return keys, ((str(certfile), str(keyfile)) if certfile is not None else None)


def _loopback(host: str) -> bool:
    """Whether every address `host` resolves to is a loopback one (unresolvable: True, bind() says why)."""
    import ipaddress
    import socket

    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return True
    return all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)
