"""The daemon's bearer token: where it lives, how it is made, and how a client finds it.

The token comes from ``AGENT_BACKEND_TOKEN``, or from a file readable only by
its owner (``$AGENT_BACKEND_TOKEN_FILE``, else
``$XDG_CONFIG_HOME/agent-backend/token``); when neither exists, the daemon
generates one into that file on first start (mode 0600, in a 0700
directory). :class:`agent_backend.Client` reads the same places, so a client
on the daemon's machine needs no configuration.

Standard library only (the client imports it). This module must never log a
token, and never accept a token file that others can read.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Final, Literal

from agent_backend.errors import ConfigError

__all__ = [
    "TOKEN_ENV",
    "TOKEN_FILE_ENV",
    "TokenSource",
    "default_token_path",
    "find_token",
    "is_loopback",
    "load_token",
]

TOKEN_ENV: Final = "AGENT_BACKEND_TOKEN"
TOKEN_FILE_ENV: Final = "AGENT_BACKEND_TOKEN_FILE"

_MIN_TOKEN = 16


@dataclasses.dataclass(frozen=True, slots=True)
class TokenSource:
    token: str = dataclasses.field(repr=False)
    origin: Literal["env", "file", "generated"]
    path: Path | None
    """The token file (None when the token came from the environment)."""

    @property
    def explicit(self) -> bool:
        """True when someone chose this token (env or an existing file), not generated now."""
        return self.origin != "generated"


def default_token_path(env: Mapping[str, str] | None = None) -> Path:
    """``$AGENT_BACKEND_TOKEN_FILE``, else ``$XDG_CONFIG_HOME/agent-backend/token``."""
    env = os.environ if env is None else env
    if env.get(TOKEN_FILE_ENV):
        return Path(env[TOKEN_FILE_ENV]).expanduser()
    base = env.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "agent-backend" / "token"


def _check_token(token: str, where: str) -> str:
    token = token.strip()
    if len(token) < _MIN_TOKEN or any(c.isspace() for c in token):
        raise ConfigError(
            f"{where}: a token is at least {_MIN_TOKEN} characters without spaces",
            file=where if where != TOKEN_ENV else None,
            key=TOKEN_ENV if where == TOKEN_ENV else "",
            expected=f"at least {_MIN_TOKEN} characters",
        )
    return token


def _read_private(path: Path) -> str:
    info = path.stat()
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"{path}: the token file is readable by others; run `chmod 600 {path}`",
            file=str(path),
            expected="mode 0600",
        )
    if info.st_uid != os.geteuid():
        raise ConfigError(
            f"{path}: the token file belongs to another user", file=str(path), expected="own file"
        )
    return _check_token(path.read_text(encoding="utf-8"), str(path))


def load_token(
    path: Path | None = None, *, env: Mapping[str, str] | None = None, create: bool = True
) -> TokenSource:
    """The daemon's token: from the environment, the token file, or generated into it.

    Raises :class:`ConfigError` for a short token or a file others can read.
    """
    env = os.environ if env is None else env
    if env.get(TOKEN_ENV):
        return TokenSource(_check_token(env[TOKEN_ENV], TOKEN_ENV), "env", None)
    path = path if path is not None else default_token_path(env)
    if path.exists():
        return TokenSource(_read_private(path), "file", path)
    if not create:
        raise ConfigError(
            f"no token: set {TOKEN_ENV} or create {path}", file=str(path), expected="a token"
        )
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another daemon made it first: use that one
        return TokenSource(_read_private(path), "file", path)
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        file.write(token + "\n")
    return TokenSource(token, "generated", path)


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def find_token(env: Mapping[str, str] | None = None) -> str | None:
    """The token a client on this machine should send: the environment's, or the file's."""
    env = os.environ if env is None else env
    try:
        return load_token(env=env, create=False).token
    except (ConfigError, OSError):
        return None
