"""Shared fixtures. Async tests use anyio on asyncio (asyncssh runs on asyncio only).

The SSH fixtures start a real OpenSSH ``sshd`` on 127.0.0.1 (see ``tests/support/sshd.py``).
Without sshd they skip, except under ``CI=true``, where a missing sshd fails the run.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.sshd import SSHKeys, SSHServer, generate_keys, sshd_missing_reason
from support.vllm_server import start_vllm_server


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def pytest_collection_finish(session: pytest.Session) -> None:
    # vLLM takes a minute or so to start: launch it now, so that it warms up while the tests
    # that come before the first one to use it run.
    if any("vllm_server" in getattr(item, "fixturenames", ()) for item in session.items):
        start_vllm_server(session.config)


def _require_sshd() -> None:
    reason = sshd_missing_reason()
    if reason is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def ssh_keys(tmp_path_factory: pytest.TempPathFactory) -> SSHKeys:
    """A host key, a second host key and a client key, generated once per run."""
    _require_sshd()
    return generate_keys(tmp_path_factory.mktemp("ssh-keys"))


@pytest.fixture
def sshd_factory(ssh_keys: SSHKeys, tmp_path: Path) -> Iterator[Callable[..., SSHServer]]:
    """Start sshd servers (``sshd_factory(max_sessions=2)``); all are killed at teardown."""
    servers: list[SSHServer] = []

    def start(**options: Any) -> SSHServer:
        server = SSHServer(tmp_path / f"sshd-{len(servers)}", ssh_keys, **options)
        servers.append(server)
        server.start()
        return server

    yield start
    for server in servers:
        server.kill()


@pytest.fixture
def sshd(sshd_factory: Callable[..., SSHServer]) -> SSHServer:
    """One sshd with default limits, for the current user (root: key login only)."""
    return sshd_factory()
