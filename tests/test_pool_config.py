"""Pool files: pools/local.toml is the embedded default, bad files fail at load naming the file,
the dotted key and what was expected; the built-in tools are their schema files."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest
from support.ray_fixtures import require_ray

from agent_backend.backends.local import LocalBackend, LocalPoolConfig
from agent_backend.backends.ssh import SSHHostConfig, SSHHostSettings, SSHPoolConfig
from agent_backend.config import ConfigModel, import_object
from agent_backend.daemon import DaemonSettings
from agent_backend.data import BUILTIN_TOOLS_DIR, DEFAULT_POOL_FILE, POOLS_DIR
from agent_backend.dispatch import BUILTIN_DEFINITIONS, Dispatcher
from agent_backend.errors import ConfigError
from agent_backend.pool_file import (
    DEFAULT_POOL,
    POOL_TYPES,
    PoolSet,
    PoolSetConfig,
    load_pool,
    load_pool_config,
    load_pools,
    load_pools_config,
    pool_config_from_dict,
    pool_from_config,
)
from agent_backend.tools import ToolRegistry

ROOT = Path(__file__).resolve().parents[1]
LOCAL_TOML = ROOT / "pools" / "local.toml"
MIXED_TOML = ROOT / "pools" / "mixed.example.toml"
TOOLS_DIR = ROOT / "schemas" / "tools"


def write(tmp_path: Path, text: str, name: str = "pool.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_pools_local_toml_is_the_embedded_default() -> None:
    assert load_pool_config(LOCAL_TOML) == DEFAULT_POOL == LocalPoolConfig()


def test_pools_local_toml_mentions_every_key() -> None:
    text = LOCAL_TOML.read_text()
    for key in LocalPoolConfig.model_fields:
        assert f"\n{key} = " in text or f"\n# {key} = " in text or f"\n[{key}]" in text, key


def test_every_config_field_is_documented() -> None:
    for name, field in LocalPoolConfig.model_fields.items():
        assert field.description, name


@pytest.mark.anyio
async def test_load_pool_gives_a_backend_to_async_with() -> None:
    async with load_pool(LOCAL_TOML) as pool:
        assert isinstance(pool, LocalBackend)
        dispatcher = Dispatcher(ToolRegistry.from_dir(TOOLS_DIR), pool)
        result = await dispatcher.call(("exec", {"argv": ["echo", "from", "a", "file"]}))
        assert result.output == "from a file\n"
    async with load_pool() as default_pool:
        assert isinstance(default_pool, LocalBackend)
        assert default_pool.config == DEFAULT_POOL


@pytest.mark.parametrize(
    ("text", "key", "expected"),
    [
        ('type = "local"\nmax_concurent_calls = 4\n', "max_concurent_calls", "no such key"),
        (
            'type = "local"\nmax_concurrent_calls = 0\n',
            "max_concurrent_calls",
            "greater than or equal to 1 (got 0)",
        ),
        (
            'type = "local"\nmax_concurrent_calls = "many"\n',
            "max_concurrent_calls",
            "a valid integer",
        ),
        ('type = "local"\nkill_grace = -1\n', "kill_grace", "greater than 0"),
        ('type = "local"\nextra_env = { A = 1 }\n', "extra_env.A", "string"),
        ('type = "local"\nenv_passthrough = "PATH"\n', "env_passthrough", "tuple"),
        ("max_concurrent_calls = 4\n", "type", "one of 'local'"),
        ('type = "lokal"\n', "type", "one of 'local'"),
        ("type = 3\n", "type", "one of 'local'"),
    ],
)
def test_a_bad_file_names_file_key_and_expectation(
    tmp_path: Path, text: str, key: str, expected: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load_pool(path)
    error = caught.value
    assert error.file == str(path)
    assert error.key == key
    assert expected in error.expected, error.expected
    assert str(error).startswith(f"{path}: {key}: ")
    again = pickle.loads(pickle.dumps(error))
    assert (again.file, again.key, again.expected, str(again)) == (
        error.file,
        error.key,
        error.expected,
        str(error),
    )


def test_every_problem_is_listed(tmp_path: Path) -> None:
    path = write(tmp_path, 'type = "local"\nbogus = 1\nshell = 5\nkill_grace = 0\n')
    with pytest.raises(ConfigError) as caught:
        load_pool_config(path)
    lines = str(caught.value).splitlines()
    assert [line.split(": ")[1] for line in lines] == ["shell", "kill_grace", "bogus"]


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the pool file") as caught:
        load_pool(tmp_path / "missing.toml")
    assert caught.value.file == str(tmp_path / "missing.toml")
    broken = write(tmp_path, 'type = "local"\nshell = \n')
    with pytest.raises(ConfigError, match="not valid TOML") as caught:
        load_pool(broken)
    assert (caught.value.file, caught.value.expected) == (str(broken), "TOML")
    with pytest.raises(ConfigError, match="a table"):
        pool_config_from_dict(["type", "local"], file="x.toml")


def test_relative_paths_are_relative_to_the_pool_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "conf").mkdir()
    path = write(
        tmp_path / "conf",
        'type = "local"\nworkspace_root = "ws"\nisolation = "none"\ndefault_cwd = "~/x"\n',
    )
    monkeypatch.chdir("/")
    monkeypatch.setenv("HOME", "/home/someone")
    config = load_pool_config(path)
    assert isinstance(config, LocalPoolConfig)
    assert config.workspace_root == str(tmp_path / "conf" / "ws")
    assert config.default_cwd == "/home/someone/x"


def test_every_config_model_shares_the_one_base() -> None:
    """Unknown keys refused, frozen, a docstring on every field: said once, in ConfigModel."""
    require_ray()
    from agent_backend.backends.ray import LocalRayConfig, RayPoolConfig, RayToolConfig

    models = [LocalPoolConfig, SSHHostSettings, SSHHostConfig, SSHPoolConfig]
    models += [RayToolConfig, LocalRayConfig, RayPoolConfig, DaemonSettings]
    for model in models:
        assert issubclass(model, ConfigModel), model
        config = model.model_config
        assert (config["extra"], config["frozen"]) == ("forbid", True), model
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name}"


def test_a_config_built_in_code_resolves_paths_from_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    config = LocalPoolConfig(workspace_root="ws")
    assert config.workspace_root == str(tmp_path / "ws")
    ssh = SSHHostConfig(host="a", client_keys=("keys/id", "/abs/id"))
    assert ssh.client_keys == (str(tmp_path / "keys/id"), "/abs/id")


def test_import_object_takes_module_colon_attribute() -> None:
    import collections.abc

    assert import_object("collections.abc:Mapping") is collections.abc.Mapping
    assert import_object("pathlib:Path.home") == Path.home  # into a class
    for malformed in ("collections.abc", "os:", ":path"):
        with pytest.raises(ValueError, match="is not module:attribute"):
            import_object(malformed)
    with pytest.raises(ImportError, match="No module named 'no_such_module'"):
        import_object("no_such_module:thing")
    with pytest.raises(ImportError, match="nothing_here"):
        import_object("os:nothing_here")
    with pytest.raises(ImportError, match="os:path has no attribute 'nope'"):
        import_object("os:path.nope")


def test_no_source_is_the_default_pool() -> None:
    assert PoolSetConfig.single() == PoolSetConfig({"default": DEFAULT_POOL}, "default")
    pools = load_pools()
    assert list(pools.backends) == ["default"]
    assert pools.backends["default"].config == DEFAULT_POOL  # type: ignore[attr-defined]


def test_pool_types_and_config_objects(tmp_path: Path) -> None:
    assert POOL_TYPES == ("local", "ssh", "ray")
    config = LocalPoolConfig(workspace_root=str(tmp_path), max_concurrent_calls=3)
    backend = pool_from_config(config)
    assert isinstance(backend, LocalBackend)
    assert backend.config is config
    assert isinstance(load_pool(config), LocalBackend)
    with pytest.raises(TypeError):
        pool_from_config(object())  # type: ignore[arg-type]
    with pytest.raises(Exception, match="frozen"):
        config.shell = "/bin/bash"


def test_a_local_pool_file_does_not_import_the_other_backends(tmp_path: Path) -> None:
    import subprocess

    code = (
        "import sys; from agent_backend.pool_file import load_pool; "
        f"load_pool({str(LOCAL_TOML)!r}); "
        "print(sorted(m for m in ('asyncssh', 'ray') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- sets of pools ------------------------------------------------------------------------------


def test_the_mixed_example_is_a_set_of_a_command_pool_and_a_ray_pool() -> None:
    require_ray()
    from agent_backend.backends.ray import RayPoolConfig

    config = load_pools_config(MIXED_TOML)
    assert config.default == "cmd"
    assert list(config.pools) == ["cmd", "gpu"]
    assert isinstance(config.pools["cmd"], LocalPoolConfig)
    gpu = config.pools["gpu"]
    assert isinstance(gpu, RayPoolConfig)
    assert [tool.name for tool in gpu.tools] == ["score"]
    pools = load_pools(MIXED_TOML)  # built, not started: nothing connects
    assert isinstance(pools, PoolSet)
    assert repr(pools) == "<PoolSet cmd: local, gpu: ray default=cmd>"
    assert pools.dispatcher_options()["default"] == "cmd"


def test_a_single_pool_file_loads_as_a_set_of_one() -> None:
    config = load_pools_config(LOCAL_TOML)
    assert dict(config.pools) == {"default": DEFAULT_POOL}
    assert config.default == "default"
    pools = load_pools()
    assert pools.describe() == "local"
    assert pools.has_hosts()


@pytest.mark.anyio
async def test_a_pool_set_opens_and_closes_its_backends_together(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        'default = "b"\n[pools.a]\ntype = "local"\n[pools.b]\ntype = "local"\nshell = "/bin/sh"\n',
    )
    async with load_pools(path) as pools:
        a, b = pools.backends["a"], pools.backends["b"]
        assert isinstance(a, LocalBackend)
        assert isinstance(b, LocalBackend)
        async with Dispatcher(ToolRegistry.from_dir(TOOLS_DIR), **pools.dispatcher_options()) as d:
            assert d.default == "b"
            assert d.pool is b
            assert (await d.call(("exec", {"command": "echo hi"}))).output == "hi\n"
    assert a.host.is_closed()
    assert b.host.is_closed()


@pytest.mark.parametrize(
    ("text", "key", "expected"),
    [
        ('default = "c"\n[pools.a]\ntype = "local"\n', "default", "one of 'a'"),
        ("pools = {}\n", "pools", "at least one"),
        ('[pools.a]\ntype = "local"\nbogus = 1\n', "pools.a.bogus", "no such key"),
        ('[pools.a]\ntype = "lokal"\n', "pools.a.type", "one of 'local'"),
        ('[pools."a b"]\ntype = "local"\n', "pools.a b", "1-64 characters"),
        ('type = "local"\n[pools.a]\ntype = "local"\n', "type", "no such key"),
    ],
)
def test_a_bad_pool_set_names_file_key_and_expectation(
    tmp_path: Path, text: str, key: str, expected: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load_pools(path)
    assert caught.value.file == str(path)
    assert caught.value.key == key
    assert expected in caught.value.expected, caught.value.expected
    assert str(caught.value).startswith(f"{path}: {key}")


# -- built-in tool files --------------------------------------------------------------------------


def test_the_documented_paths_are_the_package_data() -> None:
    """schemas/tools and pools, the paths the docs use in a checkout, are the package's data."""
    assert TOOLS_DIR.resolve() == BUILTIN_TOOLS_DIR.resolve()
    assert (ROOT / "pools").resolve() == POOLS_DIR.resolve()
    assert LOCAL_TOML.resolve() == DEFAULT_POOL_FILE.resolve()
    assert sorted(path.stem for path in BUILTIN_TOOLS_DIR.glob("*.json")) == sorted(
        BUILTIN_DEFINITIONS
    )


def test_the_tool_directory_loads_the_four_builtins() -> None:
    registry = ToolRegistry.from_dir(TOOLS_DIR)
    assert sorted(registry.names()) == ["exec", "list_dir", "read_file", "write_file"]
    for tool in registry:
        assert tool.meta["x-agent-backend"] == {"builtin": tool.name}
        assert tool.description
        for name, prop in tool.parameters["properties"].items():
            assert prop.get("description"), (tool.name, name)


def test_the_cli_takes_a_set_of_pools(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from agent_backend.cli import app

    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "where.json").write_text(
        '{"name": "where", "x-agent-backend": {"command": ["pwd"], "pool": "side"}}'
    )
    side = tmp_path / "side"
    path = write(
        tmp_path,
        f'default = "main"\n[pools.main]\ntype = "local"\n'
        f'[pools.side]\ntype = "local"\nisolation = "none"\ndefault_cwd = "{tmp_path}"\nworkspace_root = "{side}"\n',
    )
    runner = CliRunner()
    routed = runner.invoke(
        app, ["call", "where", "{}", "--pool", str(path), "--tools-dir", str(tools)]
    )
    assert routed.exit_code == 0, routed.output
    assert routed.stdout.strip() == str(tmp_path.resolve())  # sessionless: the side pool's cwd
    bad = runner.invoke(app, ["call", "where", "{}", "--pool", str(write(tmp_path, "pools = 1\n"))])
    assert bad.exit_code == 3
    assert "pools: expected one [pools.NAME] table per pool" in bad.stderr
