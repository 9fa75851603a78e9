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
from support.vllm_server import needs_vllm, note_need, share_with_workers, start_vllm_server
from support.walls import passable
from support.xdist_groups import (
    RUN_FOLDER_KEY,
    make_scheduler,
    order_items,
    run_folder,
    write_groups,
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def tmp_path(tmp_path: Path) -> Path:
    """pytest's ``tmp_path``, passable by other uids (:func:`support.walls.passable`): the
    default pool's sandboxes must reach workspace roots made under it."""
    return passable(tmp_path)


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reports its collection
def pytest_collection_finish(session: pytest.Session) -> None:
    if hasattr(session.config, "workerinput"):
        # An xdist worker: its groups for the controller's scheduler. It never launches vLLM:
        # the controller does, once for all (pytest_xdist_node_collection_finished).
        write_groups(session.config, session.items)
        note_need(session.config, session.items)
        return
    # vLLM takes a minute or so to start: launch it now, so that it warms up while the tests
    # that come before the first one to use it run.
    if needs_vllm(session.items):
        start_vllm_server(session.config)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):
        order_items(items)  # the order xdist's units go out in (support/xdist_groups.py)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """xdist controller: tell each worker the run's shared folder (groups, the vLLM launch)."""
    node.workerinput[RUN_FOLDER_KEY] = str(run_folder(node.config))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist controller: ``--dist loadgroup`` honours the groups (support/xdist_groups.py)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    return make_scheduler(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    """xdist controller: launch vLLM once, as soon as the first worker has collected."""
    share_with_workers(node.config, run_folder(node.config))


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
