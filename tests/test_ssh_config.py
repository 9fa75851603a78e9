"""SSH pool configuration (no network) and the exception mapping at the backend boundary."""

from __future__ import annotations

import pickle
import tomllib
from pathlib import Path

import pydantic
import pytest

from agent_backend.backends._errors import describe, map_exceptions
from agent_backend.backends.ssh import (
    SSHBackend,
    SSHHostConfig,
    SSHHostSettings,
    SSHPoolConfig,
)
from agent_backend.errors import (
    BackendUnavailable,
    ConfigError,
    PoolClosed,
    WorkerLost,
)
from agent_backend.pool_file import load_pool_config, pool_config_from_dict

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "pools" / "ssh.example.toml"


def test_example_file_loads_and_documents_every_key() -> None:
    config = load_pool_config(EXAMPLE)
    assert isinstance(config, SSHPoolConfig)
    first, second = config.hosts
    assert (first.host, first.port, first.max_connections) == ("10.0.0.11", 22, 8)
    assert (second.host, second.port, second.max_connections) == ("10.0.0.12", 2222, 16)
    assert first.known_hosts == str(Path("~/.ssh/known_hosts").expanduser())
    # Every key of the models appears in the example, set or commented out.
    text = EXAMPLE.read_text()
    keys = set(SSHPoolConfig.model_fields) | set(SSHHostConfig.model_fields)
    missing = [key for key in keys if f"{key} =" not in text and f"# {key} =" not in text]
    assert missing == []
    # And the example shows the defaults, except where a comment says otherwise.
    data = tomllib.loads(text)
    for key, value in data.items():
        if key in SSHHostSettings.model_fields:
            default = SSHHostSettings.model_fields[key].get_default(call_default_factory=True)
            if isinstance(value, list):
                assert tuple(value) == default, key
            elif key != "known_hosts":
                assert value == default, key


def test_every_field_is_documented() -> None:
    for model in (SSHHostSettings, SSHHostConfig, SSHPoolConfig):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no docstring"


def test_defaults_are_safe() -> None:
    host = SSHHostConfig(host="h")
    assert host.max_channels_per_connection == 8  # below OpenSSH's MaxSessions of 10
    assert host.insecure_skip_host_key_check is False
    assert host.known_hosts.endswith(".ssh/known_hosts")
    assert host.workspace_root is None  # /tmp/agent-backend-<uid>: one per remote user
    assert host.keepalive_interval > 0


def test_pool_level_keys_are_host_defaults() -> None:
    config = SSHPoolConfig.model_validate(
        {
            "type": "ssh",
            "username": "agent",
            "port": 2200,
            "hosts": [
                {"host": "a"},
                {"host": "b", "port": 22},
                SSHHostConfig(host="c", username="other"),
            ],
        }
    )
    assert [(h.host, h.port, h.username) for h in config.hosts] == [
        ("a", 2200, "agent"),
        ("b", 22, "agent"),
        ("c", 2200, "other"),
    ]


def test_relative_paths_are_relative_to_the_pool_file(tmp_path: Path) -> None:
    config = pool_config_from_dict(
        {"type": "ssh", "known_hosts": "kh", "client_keys": ["keys/id"], "hosts": [{"host": "a"}]},
        file="x.toml",
        config_dir=tmp_path,
    )
    (host,) = config.hosts
    assert host.known_hosts == str(tmp_path / "kh")
    assert host.client_keys == (str(tmp_path / "keys/id"),)


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"type": "ssh", "hosts": [{"host": "a"}], "bogus": 1}, "bogus"),
        ({"type": "ssh", "hosts": [{"host": "a", "prot": 22}]}, "prot"),
        ({"type": "ssh", "hosts": []}, "hosts"),
        ({"type": "ssh", "hosts": [{"host": "a", "port": 0}]}, "port"),
        ({"type": "ssh", "hosts": [{"host": "a"}], "workspace_root": "relative"}, "workspace_root"),
        ({"type": "ssh", "hosts": [{"host": "a"}], "env": {"BAD-NAME": "x"}}, "env"),
        (
            {"type": "ssh", "hosts": [{"host": "a"}], "max_channels_per_connection": 0},
            "max_channels",
        ),
        ({"type": "ssh", "hosts": [{"host": "a"}, {"host": "a"}]}, "twice"),
        ({"type": "ssh", "hosts": [{"host": "a"}], "preferred_ciphers": ["rot13"]}, "cipher"),
    ],
)
def test_bad_configs_fail_at_load_with_the_key(data: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        pool_config_from_dict(data, file="pools/bad.toml")
    assert key in str(info.value)
    assert "pools/bad.toml" in str(info.value)


def test_models_are_frozen_and_strict() -> None:
    host = SSHHostConfig(host="a")
    with pytest.raises(pydantic.ValidationError):
        host.port = 23  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError):
        SSHHostConfig(host="a", port="22x")  # type: ignore[arg-type]


def test_from_config_builds_one_host_per_entry() -> None:
    config = SSHPoolConfig(
        hosts=(SSHHostConfig(host="10.0.0.1", username="u", port=2222), SSHHostConfig(host="b"))
    )
    backend = SSHBackend.from_config(config)
    assert backend.kind == "ssh"
    assert backend.hosts[0].name == "u@10.0.0.1:2222"
    assert (
        repr(backend.hosts[0])
        == "<SSHHost 10.0.0.1:2222 [leases: 0 active, 0 queued | conns: 0 open, 0 idle]>"
    )
    assert not backend.is_closed()
    with pytest.raises(ConfigError):
        SSHBackend([])


def test_map_exceptions_translates_at_the_boundary() -> None:
    with (
        pytest.raises(WorkerLost) as info,
        map_exceptions({OSError: WorkerLost}, message="running x", backend="ssh", host="h"),
    ):
        raise ConnectionResetError("peer reset")
    error = info.value
    assert str(error) == "running x: ConnectionResetError: peer reset"
    assert (error.backend, error.host, error.cause) == (
        "ssh",
        "h",
        "ConnectionResetError: peer reset",
    )
    assert isinstance(error.__cause__, ConnectionResetError)
    again = pickle.loads(pickle.dumps(error))
    assert (type(again), again.host, again.cause) == (WorkerLost, "h", error.cause)
    # First match wins, in mapping order.
    with (
        pytest.raises(BackendUnavailable),
        map_exceptions({TimeoutError: BackendUnavailable, OSError: WorkerLost}, message="m"),
    ):
        raise TimeoutError
    # Ignored types, our own errors, unmapped exceptions and cancellation pass through.
    with (
        pytest.raises(ConnectionError),
        map_exceptions({OSError: WorkerLost}, message="m", ignore=(ConnectionError,)),
    ):
        raise ConnectionError("kept")
    with pytest.raises(PoolClosed), map_exceptions({Exception: WorkerLost}, message="m"):
        raise PoolClosed("closed")
    with pytest.raises(KeyError), map_exceptions({OSError: WorkerLost}, message="m"):
        raise KeyError("k")
    with pytest.raises(KeyboardInterrupt), map_exceptions({Exception: WorkerLost}, message="m"):
        raise KeyboardInterrupt
    assert describe(ValueError()) == "ValueError"
    assert len(describe(ValueError("x" * 1000), limit=50)) <= 50
