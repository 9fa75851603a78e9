"""Ray pools on a real two-node cluster started with ``ray start``: code shipped, addresses joined.

The cluster (``support/ray_cluster.py``) is a head and one worker node, each
its own ``ray start --block`` (GCS or raylet, agents, workers), on loopback,
with Ray's token authentication on. Each scenario runs in a child driver
(``support/ray_driver.py``), all of them at once when the module starts,
so that the test process's own Ray (the session's, if any) is never touched
and the module stays within its time budget; each test then checks one
scenario's outcome.

The tool modules live in a temp folder that is on no node's ``sys.path``:
a call that works, from an actor that reserved the worker node's resource,
proves the folder was uploaded and unpacked there. The rollout workers'
``tools_dir`` is deleted by the driver as soon as the workers are made.

Without Ray the module skips, except under ``CI=true``, where it fails; so
does a cluster that cannot start.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.policy_server import PolicyServer, Reply, Turn, policy_server_fixture
from support.ports import unused_port
from support.ray_cluster import HOST, WORKER_RESOURCE, RayStartCluster, ray_start_missing_reason
from support.walls import passable

from agent_backend.errors import ConfigError
from agent_backend.pool_file import pool_config_from_dict

pytestmark = [pytest.mark.timeout(600)]
policy_server = policy_server_fixture

DRIVER = Path(__file__).resolve().parent / "support" / "ray_driver.py"
ROOT = Path(__file__).resolve().parents[1]
#: Seconds a child driver may take: a hang detector, not a speed verdict. Each takes ~20 s idle;
#: a Ray Client join whose first specific server never answers is retried only after Ray's own
#: waits (~130 s seen on a loaded CI run), and the retry must fit.
DRIVER_LIMIT = 300.0
#: What loading a pool and failing to join may take (the child's ``elapsed``, imports excluded):
#: CONNECT_TIMEOUT (15 s), or the child's own RAY_gcs_server_port_wait_time_s, and a margin.
JOIN_FAILS_WITHIN = 30.0
SHOUT_MODEL = "cluster-shout"

WHERE = '''
import os

import ray


def where() -> dict:
    """Where this call ran: the Ray node, this module's file, the actor's folder."""
    return {"node": ray.get_runtime_context().get_node_id(), "file": __file__, "cwd": os.getcwd()}
'''

SHOUT_TOOL = {
    "name": "shout",
    "description": "Say the arguments louder.",
    "parameters": {
        "type": "object",
        "properties": {"text": {"type": "string"}},
        "required": ["text"],
    },
    "x-agent-backend": {"command": ["tr", "a-z", "A-Z"]},
}


def _require_cluster_parts() -> None:
    reason = ray_start_missing_reason()
    if reason is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayStartCluster]:
    _require_cluster_parts()
    started = RayStartCluster(workers=1)
    try:
        started.start(within=120)
    except Exception as exc:
        logs = started.logs()
        started.stop()
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true and the Ray cluster did not start: {exc}\n{logs}")
        pytest.skip(f"the Ray cluster did not start: {exc}")
    try:
        yield started
    finally:
        started.stop()


@dataclasses.dataclass
class Outcome:
    name: str
    result: dict[str, Any]
    wall: float
    """Seconds from the child's launch to its exit (Python's and Ray's imports included)."""
    stderr: str
    cluster_logs: str = ""
    """The cluster's node and Ray Client logs once the drivers have exited."""

    def __getitem__(self, key: str) -> Any:
        return self.result[key]

    def explain(self) -> str:
        return (
            f"{self.name}: {json.dumps(self.result)[:3000]}\n--- stderr\n{self.stderr[-3000:]}"
            f"\n--- the cluster's logs\n{self.cluster_logs}"
        )


def shout_script(turn: Turn) -> Reply:
    """Call ``shout`` (a tool only the driver's tools_dir defines), then quote its output."""
    if turn.index == 0:
        return Reply("", tool_calls=[("shout", {"text": "hi"})])
    return Reply("heard: " + turn.last_tool_results()[0].strip())


@pytest.fixture(scope="module")
def shipped(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tool code only the drivers have: a working_dir folder, a one-file py_module, and a
    rollout tools_dir (one tool file)."""
    # Passable: the rollout scenario's workspaces are made under it, for sandboxes' own uids.
    root = passable(tmp_path_factory.mktemp("shipped"))
    folder = root / "working_dir"
    folder.mkdir()
    (folder / "shipped_tools.py").write_text(WHERE)
    module = root / "modules" / "shipped_module.py"
    module.parent.mkdir()
    module.write_text(WHERE)
    tools_dir = root / "tools"
    tools_dir.mkdir()
    (tools_dir / "shout.json").write_text(json.dumps(SHOUT_TOOL))
    return {"folder": folder, "module": module, "tools_dir": tools_dir, "root": root}


def _pool(address: str, **settings: Any) -> dict[str, Any]:
    pool: dict[str, Any] = {
        "name": "join",
        "address": address,
        "num_cpus": 0.1,
        "resources": {WORKER_RESOURCE: 0.5},  # off the head: on the worker node
        "start_timeout": 90,
        "call_timeout": 30,
        "log_to_driver": False,
        "tools": ["shipped_tools:where"],
    }
    pool.update(settings)
    return pool


@pytest.fixture(scope="module")
def outcomes(
    cluster: RayStartCluster, shipped: dict[str, Path], policy_server: PolicyServer
) -> dict[str, Outcome]:
    """Every scenario's child driver, run at once; their outcomes by name."""
    policy_server.add(SHOUT_MODEL, shout_script)
    folder = {"working_dir": str(shipped["folder"])}
    where = [["where", {}]]
    no_token = {"RAY_AUTH_MODE": None, "RAY_gcs_server_port_wait_time_s": "3"}
    scenarios: dict[str, tuple[dict[str, Any], dict[str, str | None]]] = {
        "host_port": (
            {
                "pool": _pool(cluster.gcs_address, replicas=2, runtime_env=folder),
                "calls": where * 4,
            },
            {},
        ),
        "auto": (
            {
                "pool": _pool(
                    "auto",
                    runtime_env={"py_modules": [str(shipped["module"])]},
                    tools=["shipped_module:where"],
                ),
                "calls": where,
            },
            {},
        ),
        "ray_client": (
            {"pool": _pool(cluster.client_address, runtime_env=folder), "calls": where},
            {},
        ),
        "no_token": ({"pool": _pool(cluster.gcs_address, runtime_env=folder)}, no_token),
        "wrong_address": ({"pool": _pool(f"{HOST}:{unused_port()}", runtime_env=folder)}, {}),
        "upload_refused": (
            {"pool": _pool(cluster.gcs_address, runtime_env={**folder, "excludes": 7})},
            {},
        ),
        "rollout": (
            {
                "pool": _pool(cluster.gcs_address, runtime_env=folder, max_concurrency=1),
                "rollout": {
                    "url": policy_server.url,
                    "model": SHOUT_MODEL,
                    "tools_dir": str(shipped["tools_dir"]),
                    "workspace_root": str(shipped["root"] / "workspaces"),
                },
            },
            {},
        ),
    }
    launched = {}
    for name, (spec, env_changes) in scenarios.items():
        spec_file = shipped["root"] / f"{name}.json"
        spec_file.write_text(json.dumps(spec))
        env = cluster.env
        env["PYTHONPATH"] = str(ROOT)
        for key, value in env_changes.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        process = subprocess.Popen(
            [sys.executable, str(DRIVER), str(spec_file)],
            env=env,
            cwd=cluster.root,  # not a folder of the tools: Ray puts the driver's cwd on sys.path
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        launched[name] = (process, time.monotonic())
    with concurrent.futures.ThreadPoolExecutor(len(launched)) as waiting:
        finished = dict(zip(launched, waiting.map(_finish, launched.values()), strict=True))
    logs = cluster.logs()
    return {name: Outcome(name, *outcome, cluster_logs=logs) for name, outcome in finished.items()}


def _finish(launched: tuple[subprocess.Popen[str], float]) -> tuple[dict[str, Any], float, str]:
    """A child driver's result, its wall time and its stderr, once it exits (killed at the
    limit)."""
    process, began = launched
    try:
        stdout, stderr = process.communicate(timeout=DRIVER_LIMIT)
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, stderr = process.communicate()
        stderr += f"\n[killed after {DRIVER_LIMIT:g}s]"
    wall = time.monotonic() - began
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    result = json.loads(lines[-1].removeprefix("RESULT ")) if lines else {"ok": None}
    return result, wall, stderr


def _served(outcome: Outcome) -> list[dict[str, Any]]:
    assert outcome["ok"] is True, outcome.explain()
    results: list[dict[str, Any]] = outcome["results"]
    return results


def _ran_shipped_off_head(outcome: Outcome, source: Path) -> None:
    for where in _served(outcome):
        assert where["node"] != outcome["head_node"], outcome.explain()  # on the worker node
        file = Path(where["file"])
        assert "_ray_pkg_" in str(file), outcome.explain()  # the unpacked package
        assert not file.is_relative_to(source), outcome.explain()  # not the driver's folder


# -- shipping code ----------------------------------------------------------------------------------


def test_a_local_working_dir_is_uploaded_and_serves_calls_on_the_worker_node(
    outcomes: dict[str, Outcome], shipped: dict[str, Path]
) -> None:
    outcome = outcomes["host_port"]
    _ran_shipped_off_head(outcome, shipped["folder"])
    assert len(outcome["results"]) == 4
    # Content-addressed: the same folder is the same package, joined through Ray Client too.
    client = outcomes["ray_client"]
    _ran_shipped_off_head(client, shipped["folder"])
    package = {Path(where["file"]).parent.name for where in outcome["results"]}
    assert package == {Path(client["results"][0]["file"]).parent.name}, package


def test_a_local_py_module_file_is_uploaded_too(
    outcomes: dict[str, Outcome], shipped: dict[str, Path]
) -> None:
    _ran_shipped_off_head(outcomes["auto"], shipped["module"].parent)


def test_an_upload_that_ray_refuses_is_a_config_error_naming_the_key(
    outcomes: dict[str, Outcome],
) -> None:
    outcome = outcomes["upload_refused"]
    assert outcome["ok"] is False, outcome.explain()
    assert outcome["error_type"] == "ConfigError", outcome.explain()
    assert outcome["key"] == "runtime_env.working_dir", outcome.explain()
    assert "could not be uploaded to the Ray cluster" in outcome["message"]


@pytest.mark.parametrize(
    ("runtime_env", "key", "says"),
    [
        ({"working_dir": "missing-folder"}, "runtime_env.working_dir", "no such folder"),
        ({"working_dir": "a_file.py"}, "runtime_env.working_dir", "not a folder"),
        ({"working_dir": "ftp://host/code.zip"}, "runtime_env.working_dir", "a URI Ray cannot"),
        ({"py_modules": ["pkg", "notes.txt"]}, "runtime_env.py_modules.1", "neither a folder"),
        ({"py_modules": ["gone.py"]}, "runtime_env.py_modules.0", "no such folder or file"),
    ],
)
def test_a_bad_local_path_is_a_config_error_at_load(
    tmp_path: Path, runtime_env: dict[str, Any], key: str, says: str
) -> None:
    (tmp_path / "a_file.py").write_text("")
    (tmp_path / "notes.txt").write_text("")
    (tmp_path / "pkg").mkdir()
    data = {"type": "ray", "tools": ["m:f"], "runtime_env": runtime_env}
    with pytest.raises(ConfigError) as info:
        pool_config_from_dict(data, file="pool.toml", config_dir=tmp_path)
    assert info.value.key == key
    assert says in str(info.value)
    assert "pool.toml" in str(info.value)


def test_local_paths_resolve_from_the_pool_file_folder_and_uris_pass_as_they_are(
    tmp_path: Path,
) -> None:
    from agent_backend.backends.ray.packages import ship_runtime_env

    (tmp_path / "pkg").mkdir()
    runtime_env = {"working_dir": ".", "py_modules": ["pkg", "s3://bucket/m.zip"], "pip": ["x"]}
    data = {"type": "ray", "tools": ["m:f"], "runtime_env": runtime_env}
    config = pool_config_from_dict(data, config_dir=tmp_path)
    assert config.runtime_env == {
        "working_dir": str(tmp_path),
        "py_modules": [str(tmp_path / "pkg"), "s3://bucket/m.zip"],
        "pip": ["x"],
    }
    remote = {"working_dir": "s3://bucket/code.zip", "env_vars": {"A": "1"}, "excludes": ["x"]}
    shipped = ship_runtime_env(remote)  # nothing local: nothing to upload, no Ray needed
    assert shipped == {"working_dir": "s3://bucket/code.zip", "env_vars": {"A": "1"}}
    assert remote["excludes"] == ["x"]  # the config's own is left alone
    assert ship_runtime_env(None) is None


# -- joining ----------------------------------------------------------------------------------------


def test_every_documented_address_form_joins_and_serves(
    outcomes: dict[str, Outcome], shipped: dict[str, Path]
) -> None:
    for name in ("host_port", "auto", "ray_client"):
        assert _served(outcomes[name]), outcomes[name].explain()


def test_a_wrong_address_fails_at_once_saying_nothing_listens_there(
    outcomes: dict[str, Outcome],
) -> None:
    outcome = outcomes["wrong_address"]
    assert outcome["ok"] is False, outcome.explain()
    assert outcome["error_type"] == "BackendUnavailable", outcome.explain()
    assert "nothing accepts connections at 127.0.0.2:" in outcome["message"]
    assert "Connection refused" in outcome["message"]
    assert outcome["elapsed"] < JOIN_FAILS_WITHIN, outcome.explain()


def test_a_driver_without_the_token_fails_in_bounded_time_with_rays_own_hint(
    outcomes: dict[str, Outcome],
) -> None:
    outcome = outcomes["no_token"]
    assert outcome["ok"] is False, outcome.explain()
    assert outcome["error_type"] == "BackendUnavailable", outcome.explain()
    message = outcome["message"]
    assert "Authentication token is missing or incorrect" in message  # Ray's words
    assert "RAY_AUTH_TOKEN_PATH" in message  # and its hint, whole
    assert outcome["elapsed"] < JOIN_FAILS_WITHIN, outcome.explain()


# -- rollout workers --------------------------------------------------------------------------------


def test_rollout_workers_get_the_tool_files_not_the_drivers_path(
    outcomes: dict[str, Outcome], policy_server: PolicyServer, shipped: dict[str, Path]
) -> None:
    outcome = outcomes["rollout"]
    records = _served(outcome)
    assert not shipped["tools_dir"].exists()  # deleted before the workers started
    requests = policy_server.requests_for(SHOUT_MODEL)
    assert len(requests) >= 2, outcome.explain()  # the tool call's turn, and the answer's
    offered = {tool["function"]["name"] for tool in requests[0]["tools"]}
    assert {"shout", "where"} <= offered, offered  # the tools_dir file and the shipped function
    tool_messages = [m for m in requests[1]["messages"] if m.get("role") == "tool"]
    assert '"TEXT":"HI"' in tool_messages[0]["content"].replace(" ", ""), tool_messages
    assert records, outcome.explain()
    assert records[0]["extras"]["worker"] == outcome["workers"][0], outcome.explain()


def test_a_join_error_keeps_rays_innermost_reason_whole_and_hints_at_the_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The shape Ray 2.60 raises for a refused token: its reason sits in the traceback text
    that the middle exception quotes; the generic outer message alone says nothing."""
    from agent_backend.backends.ray import runtime

    hint = "Ensure that the token ... RAY_AUTH_TOKEN_PATH ... " + "x" * 700
    trace = (
        "Traceback (most recent call last):\n  File ...\n"
        f"ray.exceptions.AuthenticationError: RPC error: InvalidAuthToken: {hint}\n"
    )
    inner = RuntimeError(f"Failed to connect to GCS. Last connection error: {trace}")
    try:
        raise ConnectionError("Failed to connect to Ray cluster at 127.0.0.2:1") from inner
    except ConnectionError as exc:
        reason = runtime._ray_reason(exc)
    assert reason.startswith("ConnectionError: Failed to connect to Ray cluster at 127.0.0.2:1")
    assert f"InvalidAuthToken: {hint}" in reason  # whole, past describe_cause's 500 characters
    assert "Traceback" not in reason
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    assert "RAY_AUTH_MODE=token" in runtime._auth_hint("Failed to connect")
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    assert runtime._auth_hint("Failed to connect") == ""


def test_the_probe_targets_of_each_address_form() -> None:
    from agent_backend.backends.ray import runtime

    assert runtime._probe_target("ray://head.example:10002") == ("head.example", 10002)
    assert runtime._probe_target("ray://head.example") == ("head.example", 10001)
    assert runtime._probe_target("10.0.0.5:6379") == ("10.0.0.5", 6379)
    assert runtime._probe_target("[::1]:6379") == ("::1", 6379)
    assert runtime._probe_target("not an address") is None


#: What Ray Client raised in CI when its proxy's per-driver server died at birth (ray#63202).
_BORN_DEAD = (
    "Initialization failure from server:\nTraceback (most recent call last):\n"
    '  File ".../ray/util/client/server/proxier.py", line 765, in Datapath\n'
    "    if not self.proxy_manager.start_specific_server(\n"
    "psutil.ZombieProcess: PID still exists but it's a zombie (pid=23001)\n"
)


@pytest.mark.parametrize(
    ("failures", "message", "calls", "joined"),
    [
        (2, _BORN_DEAD, 3, True),  # two servers died at birth, the third serves
        (1, "Initialization failure from server:\nStarting Ray client server failed.", 2, True),
        (9, _BORN_DEAD, 3, False),  # the attempts are bounded: the last failure is raised
        # The cluster refused this driver (here: a runtime env it cannot set up): not retried.
        (9, "Initialization failure from server:\nRuntimeError: WEIRD_ERROR", 1, False),
    ],
)
def test_joining_through_ray_client_retries_a_server_that_died_at_birth_only(
    monkeypatch: pytest.MonkeyPatch, failures: int, message: str, calls: int, joined: bool
) -> None:
    import ray

    from agent_backend.backends.ray import runtime

    seen: list[str] = []

    def init(*, address: str, log_to_driver: bool) -> None:
        seen.append(address)
        if len(seen) <= failures:
            raise ConnectionAbortedError(message)

    monkeypatch.setattr(runtime, "_probe", lambda address: None)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(runtime.time, "sleep", lambda seconds: None)
    if joined:
        runtime._join("ray://head.example:10001", log_to_driver=False)
    else:
        with pytest.raises(ConnectionAbortedError, match="Initialization failure"):
            runtime._join("ray://head.example:10001", log_to_driver=False)
    assert len(seen) == calls
    assert calls <= runtime.CLIENT_START_ATTEMPTS
    # A GCS address never goes through Ray Client's proxy: one attempt, whatever it raised.
    seen.clear()
    with pytest.raises(ConnectionAbortedError):
        runtime._join("head.example:6379", log_to_driver=False)
    assert seen == ["head.example:6379"]
