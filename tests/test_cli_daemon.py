"""The command line: call, pool check, serve's refusals, and help a newcomer can follow."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from daemon_fixtures import TOKEN, Daemon, daemon_fixture  # noqa: F401
from typer.testing import CliRunner

from agent_backend.cli import app

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
    checked = runner.invoke(app, ["pool", "check", str(ROOT / "pools" / "local.toml")])
    assert checked.exit_code == 0, checked.output
    lines = checked.stdout.splitlines()
    assert lines[0].split() == ["HOST", "STATUS", "LATENCY", "DETAIL"]
    assert lines[1].split()[:2] == ["local", "ok"]
    assert "1/1 hosts healthy" in lines[-1]
    broken = tmp_path / "broken.toml"
    broken.write_text('type = "local"\nmax_concurrent_calls = "many"\n')
    bad = runner.invoke(app, ["pool", "check", str(broken)])
    assert bad.exit_code == 3
    assert "max_concurrent_calls" in bad.stderr


def test_pool_check_on_a_real_ssh_pool(sshd: Any, tmp_path: Path) -> None:
    """One host that answers (a real sshd on loopback), one that does not."""
    from sshd import free_port

    lines = ['type = "ssh"', "connect_timeout = 3", "connect_retries = 0"]
    for port in (sshd.port, free_port()):
        options = sshd.client_options(port=port)
        lines.append("[[hosts]]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in options.items()]
    pool_file = tmp_path / "ssh.toml"
    pool_file.write_text("\n".join(lines) + "\n")
    checked = runner.invoke(app, ["pool", "check", str(pool_file), "--timeout", "5"])
    assert checked.exit_code == 1, checked.output
    rows = {line.split()[0]: line.split()[1] for line in checked.stdout.splitlines()[1:-1]}
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


def test_tools_strict_prints_the_strict_variant_and_needs_openai() -> None:
    printed = runner.invoke(app, ["tools", "--format", "openai", "--strict"])
    assert printed.exit_code == 0, printed.output
    tools = {t["function"]["name"]: t["function"] for t in json.loads(printed.output)}
    assert tools["exec"]["strict"] is True
    assert "null" in tools["exec"]["parameters"]["properties"]["command"]["type"]
    refused = runner.invoke(app, ["tools", "--strict"])
    assert refused.exit_code == 2
    assert "--format openai" in refused.output
