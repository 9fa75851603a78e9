"""What the agent-framework toolset tests share: the tools, and a runner in two places.

Each framework's tests run against ``backend``, parametrized twice: a
:class:`Dispatcher` in the test process, and the daemon on a real uvicorn
(a thread of this process) through :class:`Client`. Both serve the same
registry: the four built-ins and ``outage``, a Python tool whose service is
down (it raises ``BackendUnavailable``: an infrastructure failure, which must
reach the caller as an exception, never the model as text). Output is bounded
at :data:`OUTPUT_LIMIT` bytes, and workspaces are made under a directory the
test can look into (every session's workspace must be gone after its run).

Test modules import the fixtures they use (``from toolset_fixtures import
backend_fixture, daemon_fixture``); they are named ``backend`` and
``toolset_daemon`` in test signatures.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import NoReturn

import pytest

from agent_backend import Client, Dispatcher, ToolRegistry
from agent_backend.backends.local import LocalBackend, LocalPoolConfig
from agent_backend.daemon import DaemonSettings, run_in_thread
from agent_backend.dispatch import builtin_tools
from agent_backend.errors import BackendUnavailable
from support.daemon_fixtures import TOKEN
from support.walls import passable

#: Bytes of output the model sees per call.
OUTPUT_LIMIT = 2048
#: What ``outage`` says: infrastructure, not the model's doing.
OUTAGE = "the search index is down"


def framework_missing(exc: ImportError, extra: str) -> NoReturn:
    """Skip the calling module without its framework; under ``CI=true`` fail instead."""
    reason = f"{exc.name or exc} is not installed: pip install -e '.[{extra}]' (make test does)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def make_registry() -> ToolRegistry:
    registry = ToolRegistry(builtin_tools())

    @registry.tool
    async def outage() -> str:
        """Search the index (whose server is down)."""
        raise BackendUnavailable(OUTAGE, backend="local", host="local")

    return registry


def pool_config(root: Path) -> LocalPoolConfig:
    return LocalPoolConfig(workspace_root=str(root), kill_grace=0.5)


@dataclasses.dataclass
class Backend:
    """A runner, and the directory its sessions' workspaces are made in."""

    runner: Dispatcher | Client
    root: Path

    def workspaces(self) -> list[str]:
        """The workspaces that exist now."""
        return sorted(n for n in os.listdir(self.root) if n.startswith("agent-backend-ws-"))


@pytest.fixture(name="toolset_daemon", scope="module")
def daemon_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """The daemon serving :func:`make_registry`: its URL and its workspace directory."""
    root = passable(tmp_path_factory.mktemp("daemon-workspaces"))  # reached by sandboxes' uids
    settings = DaemonSettings(tokens=(TOKEN,), port=0, grace=2.0)
    with run_in_thread(
        make_registry(), settings, pool=pool_config(root), output_limit=OUTPUT_LIMIT
    ) as daemon:
        yield daemon.url, root


@pytest.fixture(name="backend", params=["dispatcher", "daemon"])
async def backend_fixture(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    """The runner the toolsets are built over: in-process, or the daemon's client."""
    if request.param == "dispatcher":
        root = tmp_path / "workspaces"
        root.mkdir()
        async with (
            LocalBackend(pool_config(root)) as pool,
            Dispatcher(make_registry(), pool, output_limit=OUTPUT_LIMIT) as dispatcher,
        ):
            yield Backend(dispatcher, root)
    else:
        url, root = request.getfixturevalue("toolset_daemon")
        async with Client(url, token=TOKEN, retries=0) as client:
            yield Backend(client, root)
