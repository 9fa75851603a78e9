"""One rule for environment variable names wherever one is set: a tool's ``env``, the local
pool's ``extra_env``/``env_passthrough``, an SSH host's ``env`` and the exec tool's schema."""

from __future__ import annotations

import re
from collections.abc import Callable

import pydantic
import pytest

from agent_backend.backends.local import LocalPoolConfig
from agent_backend.backends.ssh import SSHHostConfig
from agent_backend.dispatch import builtin_tools
from agent_backend.dispatch.spec import ENV_NAME_PATTERN, ExecutionSpec

REFUSED = ["MY-VAR", "1X", "A=B", "", "A B", "NUL\x00"]
ACCEPTED = ["PATH", "_X", "a1_B2"]


SETTINGS: dict[str, Callable[[str], object]] = {
    "tool env": lambda name: ExecutionSpec(command=("true",), env={name: "v"}),
    "local extra_env": lambda name: LocalPoolConfig(extra_env={name: "v"}),
    "local env_passthrough": lambda name: LocalPoolConfig(env_passthrough=(name,)),
    "ssh host env": lambda name: SSHHostConfig(host="127.0.0.1", env={name: "v"}),
}


@pytest.mark.parametrize("where", SETTINGS)
@pytest.mark.parametrize("name", REFUSED)
def test_every_setting_refuses_the_same_names(where: str, name: str) -> None:
    assert not re.match(ENV_NAME_PATTERN, name)
    with pytest.raises(pydantic.ValidationError):
        SETTINGS[where](name)


@pytest.mark.parametrize("where", SETTINGS)
@pytest.mark.parametrize("name", ACCEPTED)
def test_every_setting_accepts_the_same_names(where: str, name: str) -> None:
    assert re.match(ENV_NAME_PATTERN, name)
    SETTINGS[where](name)


def test_the_exec_tool_schema_states_the_same_rule() -> None:
    (exec_tool,) = [t for t in builtin_tools() if t.name == "exec"]
    env = exec_tool.parameters["properties"]["env"]
    assert env["propertyNames"]["pattern"] == ENV_NAME_PATTERN
