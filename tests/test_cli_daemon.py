"""The command line: call, pool check, serve's refusals and settings, and help a newcomer can follow."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.daemon_fixtures import TOKEN, Daemon, daemon_fixture  # noqa: F401
from support.ports import unused_port
from support.walls import require_walls
from typer.testing import CliRunner

from agent_backend.cli import app
from agent_backend.daemon import DaemonSettings

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def test_call_prints_the_result_and_exits_by_it() -> None:
    ok = runner.invoke(app, ["call", "exec", '{"command": "echo hello"}'])
    assert ok.exit_code == 0, ok.output
    assert ok.stdout == "hello\n\n"
    assert "[exec: ok, exit status 0" in ok.stderr
    failed = runner.invoke(app, ["call", "exec", '{"command": "echo oops; exit 4"}', "--json"])
    assert failed.exit_code == 1
    result = json.loads(failed.stdout)
    assert result["exit_status"] == 4
    assert result["error_type"] == "NonZeroExit"
    bad = runner.invoke(app, ["call", "exec", '{"command": '])
    assert bad.exit_code == 1
    assert bad.stdout.startswith("Error: Invalid arguments for tool 'exec'")
    piped = runner.invoke(app, ["call", "exec", "-"], input='{"argv": ["echo", "from stdin"]}')
    assert piped.exit_code == 0
    assert piped.stdout.startswith("from stdin")


def test_call_on_a_pool_file_and_through_a_daemon(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    pooled = runner.invoke(
        app,
        [
            "call",
            "exec",
            '{"command": "echo pooled"}',
            "--pool",
            str(ROOT / "pools" / "local.toml"),
        ],
    )
    assert pooled.exit_code == 0
    assert pooled.stdout.startswith("pooled")
    monkeypatch.setenv("AGENT_BACKEND_TOKEN", TOKEN)
    remote = runner.invoke(
        app, ["call", "echo", '{"value": "remote"}', "--url", daemon.url, "--json"]
    )
    assert remote.exit_code == 0, remote.output
    assert json.loads(remote.stdout)["output"] == "remote"
    monkeypatch.setenv("AGENT_BACKEND_TOKEN", "wrong-token-" + "w" * 20)
    refused = runner.invoke(app, ["call", "echo", '{"value": "x"}', "--url", daemon.url])
    assert refused.exit_code == 3
    assert "Unauthorized" in refused.stderr


def test_pool_check_reports_each_host(tmp_path: Path) -> None:
    checked = runner.invoke(app, ["pool", "check"])  # no file: the built-in local pool
    assert checked.exit_code == 0, checked.output
    lines = checked.stdout.splitlines()
    assert lines[0].split() == ["HOST", "STATUS", "LATENCY", "DETAIL"]
    assert lines[1].split()[:2] == ["local", "ok"]
    assert "1/1 hosts healthy" in lines[-1]
    assert "guarantees:" in lines
    assert any(line.strip().startswith("isolation: ") for line in lines)
    broken = tmp_path / "broken.toml"
    broken.write_text('type = "local"\nmax_concurrent_calls = "many"\n')
    bad = runner.invoke(app, ["pool", "check", str(broken)])
    assert bad.exit_code == 3
    assert "max_concurrent_calls" in bad.stderr


def test_the_default_pool_is_walled_and_isolation_none_is_a_choice_on_the_command_line(
    tmp_path: Path,
) -> None:
    require_walls()
    default = runner.invoke(app, ["pool", "check", str(ROOT / "pools" / "local.toml")])
    assert default.exit_code == 0, default.output
    assert "  isolation: namespaces" in default.stdout.splitlines()
    unconfined = runner.invoke(
        app, ["pool", "check", str(ROOT / "pools" / "local.toml"), "--isolation", "none"]
    )
    assert unconfined.exit_code == 0, unconfined.output
    assert any(line.startswith("  isolation: none") for line in unconfined.stdout.splitlines())
    command = '{"command": "ls /proc | grep -c \'^[0-9]\'; id -u"}'
    inside = runner.invoke(app, ["call", "exec", command])
    assert inside.exit_code == 0, inside.output
    processes, uid = (int(word) for word in inside.stdout.split()[:2])
    assert processes < 10  # its own PID namespace: this host runs many more (pytest, for one)
    assert uid != os.getuid()  # a uid of its own
    # A file that only works unconfined cannot be walled from the command line.
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    pool = tmp_path / "cwd.toml"
    pool.write_text(f'type = "local"\nisolation = "none"\ndefault_cwd = "{scratch}"\n')
    walled = runner.invoke(app, ["pool", "check", str(pool), "--isolation", "namespaces"])
    assert walled.exit_code == 3
    assert "--isolation namespaces: default_cwd cannot be used" in walled.stderr


def test_pool_check_on_a_real_ssh_pool(sshd: Any, tmp_path: Path) -> None:
    """One host that answers (a real sshd on loopback), one that does not."""
    from support.ports import unused_port

    lines = ['type = "ssh"', "connect_timeout = 3", "connect_retries = 0"]
    for port in (sshd.port, unused_port()):
        options = sshd.client_options(port=port)
        lines.append("[[hosts]]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in options.items()]
    pool_file = tmp_path / "ssh.toml"
    pool_file.write_text("\n".join(lines) + "\n")
    checked = runner.invoke(app, ["pool", "check", str(pool_file), "--timeout", "5"])
    assert checked.exit_code == 1, checked.output
    hosts = [line for line in checked.stdout.splitlines()[1:-1] if "@" in line]  # not walls
    rows = {line.split()[0]: line.split()[1] for line in hosts}
    assert sorted(rows.values()) == ["DOWN", "ok"]
    assert f":{sshd.port}" in next(host for host, status in rows.items() if status == "ok")
    assert "1/2 hosts healthy" in checked.stdout


def test_serve_refuses_a_public_address_without_a_chosen_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AGENT_BACKEND_TOKEN", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    refused = runner.invoke(app, ["serve", "--host", "0.0.0.0", "--port", "0"])
    assert refused.exit_code == 3
    assert "refusing to listen on 0.0.0.0" in refused.stderr


@pytest.mark.parametrize("command", [[], ["serve"], ["mcp"], ["call"], ["pool", "check"]])
def test_help_explains_each_command(command: list[str]) -> None:
    shown = runner.invoke(app, [*command, "--help"])
    assert shown.exit_code == 0
    assert "Usage: agent-backend" in shown.stdout
    if command == ["serve"]:
        for option in ("--pool", "--host", "--port", "--tools-dir", "--token-file", "--grace"):
            assert option in shown.stdout


def test_serve_help_shows_the_defaults_the_settings_hold() -> None:
    shown = " ".join(runner.invoke(app, ["serve", "--help"], terminal_width=200).stdout.split())
    for name, flag in [
        ("host", "--host"),
        ("port", "--port"),
        ("grace", "--grace"),
        ("max_concurrent_per_token", "--max-concurrent"),
        ("max_batch", "--max-batch"),
        ("max_sessions_per_token", "--max-sessions"),
        ("session_ttl", "--session-ttl"),
        ("default_timeout", "--default-timeout"),
        ("max_timeout", "--max-timeout"),
        ("output_limit", "--output-limit"),
        ("keep_alive_timeout", "--keep-alive-timeout"),
    ]:
        default = DaemonSettings.model_fields[name].default
        assert re.search(
            rf"{flag} .*?\[default: \(\$AGENT_BACKEND_{name.upper()}, else {re.escape(str(default))}\)\]",
            shown,
        ), (flag, shown)


def test_the_daemon_docs_list_every_setting_with_its_default() -> None:
    text = (ROOT / "docs" / "daemon.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| `(AGENT_BACKEND_\w+)` \| `([^`]*)` \|", text, re.M)
    documented = {name: (variable, default) for name, variable, default in rows}
    expected = {
        name: (f"AGENT_BACKEND_{name.upper()}", str(field.default))
        for name, field in DaemonSettings.model_fields.items()
        if name != "tokens"
    }
    assert documented == expected


def test_serve_refuses_bad_settings_naming_where_they_came_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENT_BACKEND_TOKEN", TOKEN)
    option = runner.invoke(app, ["serve", "--port", "70000"])
    assert option.exit_code == 2
    assert "--port" in option.stderr
    monkeypatch.setenv("AGENT_BACKEND_GRACE", "soon")
    variable = runner.invoke(app, ["serve", "--port", "0"])
    assert variable.exit_code == 3
    assert "$AGENT_BACKEND_GRACE" in variable.stderr
    monkeypatch.delenv("AGENT_BACKEND_GRACE")
    crossed = runner.invoke(app, ["serve", "--default-timeout", "10", "--max-timeout", "5"])
    assert crossed.exit_code == 3
    assert "max_timeout (5) must be at least default_timeout (10)" in crossed.stderr
    env_file = tmp_path / "daemon.env"
    env_file.write_text("AGENT_BACKEND_PROT=9000\n")
    typo = runner.invoke(app, ["serve", "--env-file", str(env_file)])
    assert typo.exit_code == 3
    assert f"{env_file}: AGENT_BACKEND_PROT is not a daemon setting" in typo.stderr


def _serve_command() -> list[str]:
    script = Path(sys.executable).with_name("agent-backend")
    return [str(script)] if script.exists() else [sys.executable, "-m", "agent_backend.cli"]


@pytest.mark.timeout(60)
def test_serve_takes_options_over_the_environment_over_the_env_file(tmp_path: Path) -> None:
    """A real `agent-backend serve`: each setting comes from the first place that gives it."""
    port = unused_port()
    env_file = tmp_path / "daemon.env"
    env_file.write_text(
        f"AGENT_BACKEND_PORT={port}\nAGENT_BACKEND_GRACE=7\nAGENT_BACKEND_MAX_BATCH=2\n"
    )
    env = {
        **os.environ,
        "AGENT_BACKEND_TOKEN": TOKEN,
        "XDG_CONFIG_HOME": str(tmp_path / "cfg"),
        "AGENT_BACKEND_GRACE": "2.5",  # over the file's 7
        "AGENT_BACKEND_HOST": "0.0.0.0",  # under --host
    }
    process = subprocess.Popen(
        [*_serve_command(), "serve", "--env-file", str(env_file), "--host", "127.0.0.1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert process.stdout is not None
    assert process.stderr is not None
    try:
        banner = [process.stdout.readline() for _ in range(2)]
        while banner[-1] and not banner[-1].startswith("stop:"):
            banner.append(process.stdout.readline())
        threading.Thread(target=process.stdout.read, daemon=True).start()
        url = f"http://127.0.0.1:{port}"
        assert banner[0].startswith(f"agent-backend daemon on {url} "), banner
        assert any(line.startswith("walls: isolation: ") for line in banner), banner
        assert "calls in flight get 2.5 s to finish" in banner[-1], banner
        calls = [{"name": "exec", "arguments": {"command": "true"}}] * 3
        headers = {"Authorization": f"Bearer {TOKEN}"}
        refused = httpx.post(f"{url}/v1/batch", json={"calls": calls}, headers=headers, timeout=10)
        assert refused.status_code == 422
        assert "at most 2 calls" in refused.text
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)
        process.stderr.close()
        process.stdout.close()


def test_tools_strict_prints_the_strict_variant_and_needs_openai() -> None:
    printed = runner.invoke(app, ["tools", "--format", "openai", "--strict"])
    assert printed.exit_code == 0, printed.output
    tools = {t["function"]["name"]: t["function"] for t in json.loads(printed.output)}
    assert tools["exec"]["strict"] is True
    assert "null" in tools["exec"]["parameters"]["properties"]["command"]["type"]
    refused = runner.invoke(app, ["tools", "--strict"])
    assert refused.exit_code == 2
    assert "--format openai" in refused.output
