"""Which tests run together on one pytest-xdist worker, and the scheduler that keeps them so.

`make test` runs the suite on two workers. Some tests share a costly thing that one worker
holds, and must run one after another on that worker:

- ``ray``: the tests of the session's local Ray (``ray_cluster``), and the docs examples that
  start one (marked ``xdist_group("ray")``): else each worker starts its own on the same cores;
- ``vllm``: the tests of the vLLM server (``vllm_server``), whose seeded samples and logprob
  comparisons assume no other test's requests batch with theirs;
- a module whose tests share a module-scoped fixture (the wheel's venv, a template, a pool):
  split over two workers, each would build it, and between two of its tests a worker running
  another module's would tear it down and build it again.

pytest-xdist's own ``--dist loadgroup`` carries ``xdist_group`` marks to its scheduler by
renaming node ids, which pytest 9.2 no longer lets it do: the marks are silently ignored
(pytest-dev/pytest-xdist#1386). So each worker writes the groups of what it collected to a
file in the run's folder, which the controller named (in ``workerinput``), and the controller's scheduler,
the ``GroupScheduling`` of :func:`make_scheduler` (xdist's load-scope scheduling with its scope read from those files),
sends each group to one worker as one unit; every other test is a unit of its own. Units go
out in collection order, which :func:`order_items` sets: the longest groups first (Ray's; the
wheel's, which installs a venv), then the other groups, then the rest, the vLLM tests last, so
that the server warms up meanwhile.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

__all__ = ["RUN_FOLDER_KEY", "make_scheduler", "order_items", "run_folder", "write_groups"]

#: The key of xdist's ``workerinput`` that holds the run's shared folder: the workers' group
#: files, and what support/vllm_server.py shares between the controller and the workers.
RUN_FOLDER_KEY = "agent_backend_run_folder"
GROUP_BY_FIXTURE = {"ray_cluster": "ray", "vllm_server": "vllm"}
#: Where a group's unit goes in the queue: lower first; groups not named here come at 1.
GROUP_RANK = {"ray": 0, "wheel": 0, "vllm": 3}
UNGROUPED_RANK = 2

_directory: Path | None = None


def run_folder(config: pytest.Config | None = None) -> Path:
    """Controller: the folder this run shares with its workers (one per session, removed
    when ``config``, given on the first call, is cleaned up)."""
    global _directory
    if _directory is None:
        _directory = path = Path(tempfile.mkdtemp(prefix="pytest-run-"))
        if config is not None:
            config.add_cleanup(lambda: shutil.rmtree(path, ignore_errors=True))
    return _directory


def group_of(item: pytest.Item) -> str | None:
    """The group ``item`` runs in, or None for a unit of its own."""
    mark = item.get_closest_marker("xdist_group")
    if mark is not None:
        return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
    names = getattr(item, "fixturenames", ())
    for fixture, group in GROUP_BY_FIXTURE.items():
        if fixture in names:
            return group
    info = getattr(item, "_fixtureinfo", None)
    definitions: dict[str, Any] = getattr(info, "name2fixturedefs", {})
    if any(defs and defs[-1].scope == "module" for defs in definitions.values()):
        return f"module:{item.nodeid.split('::', 1)[0]}"
    return None


def _rank(group: str | None) -> int:
    if group is None:
        return UNGROUPED_RANK
    return GROUP_RANK.get(group, 1)


def order_items(items: list[pytest.Item]) -> None:
    """Sort ``items`` (stably) by their group's rank; every worker sorts alike."""
    items.sort(key=lambda item: _rank(group_of(item)))


def write_groups(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Worker: record the group of each collected test for the controller's scheduler."""
    workerinput: dict[str, Any] = getattr(config, "workerinput", {})
    folder = workerinput.get(RUN_FOLDER_KEY)
    if folder is None:
        return
    groups = {item.nodeid: group for item in items if (group := group_of(item)) is not None}
    path = Path(folder) / f"groups-{workerinput.get('workerid', os.getpid())}.json"
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(groups), encoding="utf-8")
    partial.replace(path)  # the controller never reads half a file


def make_scheduler(config: pytest.Config, log: Any = None) -> Any:
    """Controller: the scheduler for ``--dist loadgroup`` (``pytest_xdist_make_scheduler``)."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        """xdist's load-scope scheduling, a test's scope read from the workers' group files.

        The scheduler asks for scopes only once every worker has reported its collection, and
        a worker writes its file before it reports (``write_groups``, a tryfirst
        ``pytest_collection_finish``).
        """

        def __init__(self, config: pytest.Config, log: Any = None) -> None:
            config.option.loadscopereorder = False  # keep collection order (order_items)
            super().__init__(config, log)
            self._groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._groups is None:
                self._groups = {}
                for path in sorted(run_folder().glob("groups-*.json")):
                    self._groups.update(json.loads(path.read_text(encoding="utf-8")))
            group = self._groups.get(nodeid)
            return nodeid if group is None else f"group:{group}"

    return GroupScheduling(config, log)
