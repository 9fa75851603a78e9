"""A real OpenSSH ``sshd`` on 127.0.0.1 for tests and benchmarks, in a temp dir.

:class:`SSHServer` writes host and user keys (``ssh-keygen``), an
``authorized_keys`` file, a ``known_hosts`` file for the client and an
``sshd_config`` into a directory, then runs ``sshd -D -e -f <config>`` on a
free loopback port (or, for a fleet of separate hosts, on a network namespace's own
address, started with ``ip netns exec``: ``tests/support/netns.py``). It can be killed like a crashed host (the listener, every
per-connection process and every command they started) and restarted on the
same port with the same host key.

This module must never listen on anything but 127.0.0.1 or an address inside a network
namespace a test made, never touch the
system sshd or its configuration, and never signal a process it did not start
(processes are found by walking the process tree down from our own sshd).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import anyio

from support.ports import unused_port

__all__ = [
    "SSHKeys",
    "SSHServer",
    "find_sshd",
    "generate_keys",
    "process_tree",
    "sshd_missing_reason",
]

HOST = "127.0.0.1"


def find_sshd() -> str | None:
    for candidate in (shutil.which("sshd"), "/usr/sbin/sshd", "/usr/local/sbin/sshd"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def sshd_missing_reason() -> str | None:
    """None when sshd and ssh-keygen are usable, else why not."""
    if find_sshd() is None:
        return "OpenSSH sshd is not installed (make test installs it as root: scripts/ensure-system-deps.sh)"
    if shutil.which("ssh-keygen") is None:
        return "ssh-keygen is not installed"
    return None


class SSHKeys:
    """A host key and a client key pair, generated once per directory."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.host_key = directory / "ssh_host_ed25519_key"
        self.client_key = directory / "id_ed25519"
        self.other_host_key = directory / "other_host_ed25519_key"

    @property
    def host_public(self) -> str:
        return self.host_key.with_suffix(".pub").read_text().split()[1]

    @property
    def client_public_line(self) -> str:
        return self.client_key.with_suffix(".pub").read_text().strip()


def generate_keys(directory: Path) -> SSHKeys:
    directory.mkdir(parents=True, exist_ok=True)
    keys = SSHKeys(directory)
    for path in (keys.host_key, keys.client_key, keys.other_host_key):
        if not path.exists():
            subprocess.run(
                [
                    "ssh-keygen",
                    "-q",
                    "-t",
                    "ed25519",
                    "-N",
                    "",
                    "-C",
                    "agent-backend-test",
                    "-f",
                    str(path),
                ],
                check=True,
                capture_output=True,
            )
    return keys


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # The command name is in parentheses and may contain spaces: split after the last ')'.
        fields = stat[stat.rfind(")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(entry))
    return children


def process_tree(root: int) -> list[int]:
    """``root`` and every live descendant of it."""
    children = _children_map()
    found: list[int] = []
    stack = [root]
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(children.get(pid, ()))
    return found


def _signal_all(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


class SSHServer:
    """One sshd on 127.0.0.1:<port> (or ``address``); ``start()``, ``kill()``, ``restart()``, ``stop()``."""

    def __init__(
        self,
        directory: Path,
        keys: SSHKeys,
        *,
        port: int | None = None,
        user: str | None = None,
        max_sessions: int = 10,
        max_startups: str = "10:30:100",
        extra_config: Iterable[str] = (),
        address: str = HOST,
        netns: str | None = None,
    ) -> None:
        self.directory = directory
        self.address = address
        """Where sshd listens (and clients connect): 127.0.0.1, or a namespace's address."""
        self.netns = netns
        """The network namespace sshd runs in (``ip netns exec``); None: the current one."""
        self.keys = keys
        self.port = port or unused_port()
        self.user = user or pwd.getpwuid(os.getuid()).pw_name
        self.max_sessions = max_sessions
        self.max_startups = max_startups
        self.extra_config = list(extra_config)
        self.config_path = directory / "sshd_config"
        self.authorized_keys = directory / "authorized_keys"
        self.known_hosts = directory / "known_hosts"
        self.log_path = directory / "sshd.log"
        self.starts = 0
        self._process: subprocess.Popen[bytes] | None = None
        self._log_file: Any = None
        directory.mkdir(parents=True, exist_ok=True)

    # -- files -------------------------------------------------------------

    def write_files(self) -> None:
        self.authorized_keys.write_text(self.keys.client_public_line + "\n")
        if self.user != pwd.getpwuid(os.getuid()).pw_name:
            # sshd reads authorized_keys as the user logging in.
            self.authorized_keys.chmod(0o644)
            for directory in (self.directory, *self.directory.parents):
                if directory == Path("/"):
                    break
                mode = directory.stat().st_mode
                directory.chmod(mode | 0o011)  # traversable (no listing) by that user
        self.known_hosts.write_text(
            f"[{self.address}]:{self.port} ssh-ed25519 {self.keys.host_public}\n"
        )
        root_login = "PermitRootLogin prohibit-password" if self.user == "root" else ""
        # sshd keeps the first value it reads for a keyword: extra lines come first to win.
        lines = [
            *self.extra_config,
            f"Port {self.port}",
            f"ListenAddress {self.address}",
            f"HostKey {self.keys.host_key}",
            f"PidFile {self.directory / 'sshd.pid'}",
            f"AuthorizedKeysFile {self.authorized_keys}",
            "StrictModes no",
            "UsePAM no",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            root_login,
            f"AllowUsers {self.user}",
            f"MaxSessions {self.max_sessions}",
            f"MaxStartups {self.max_startups}",
            "UseDNS no",
            "PrintMotd no",
            "PrintLastLog no",
            "X11Forwarding no",
            "AllowTcpForwarding no",
            "AllowAgentForwarding no",
            "PermitUserEnvironment no",
            "Subsystem sftp internal-sftp",
            # bash sources ~/.bashrc for commands run by sshd unless SHLVL is already set; a
            # heavy ~/.bashrc (pyenv init: ~120 ms here) would otherwise dominate every call.
            "SetEnv SHLVL=1",
            "LogLevel ERROR",
        ]
        self.config_path.write_text("\n".join(line for line in lines if line) + "\n")

    def client_options(self, **overrides: Any) -> dict[str, Any]:
        """Keyword arguments for ``SSHHostConfig`` reaching this server (verification on)."""
        options: dict[str, Any] = {
            "host": self.address,
            "port": self.port,
            "username": self.user,
            "known_hosts": str(self.known_hosts),
            "client_keys": [str(self.keys.client_key)],
        }
        options.update(overrides)
        return options

    # -- lifecycle ---------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self, *, timeout: float = 10.0) -> None:
        if self.is_running():
            return
        sshd = find_sshd()
        if sshd is None:
            raise RuntimeError(sshd_missing_reason())
        if os.geteuid() == 0:
            # sshd refuses to start without its privilege separation directory.
            Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        self.write_files()
        self._log_file = self.log_path.open("ab")
        # `ip netns exec` enters the namespace and execs sshd: the pid is sshd's own.
        prefix = ["ip", "netns", "exec", self.netns] if self.netns is not None else []
        self._process = subprocess.Popen(
            [*prefix, sshd, "-D", "-e", "-f", str(self.config_path)],
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=self._log_file,
            start_new_session=True,
        )
        self.starts += 1
        deadline = time.monotonic() + timeout
        while True:
            if self._process.poll() is not None:
                raise RuntimeError(f"sshd exited with {self._process.returncode}: {self.log()}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection((self.address, self.port), 0.2),
            ):
                return
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(
                    f"sshd did not listen on {self.address}:{self.port}: {self.log()}"
                )
            time.sleep(0.01)

    def kill(self) -> None:
        """Kill sshd like a crashed host: the listener, its connections and their commands."""
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            # Freeze the tree first so nothing forks between the scan and the kill.
            tree = process_tree(process.pid)
            _signal_all(tree, signal.SIGSTOP)
            tree = sorted(set(tree) | set(self._tree_of(tree)))
            _signal_all(tree, signal.SIGKILL)
            _signal_all(tree, signal.SIGCONT)
        process.wait()
        self._process = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    @staticmethod
    def _tree_of(pids: Iterable[int]) -> list[int]:
        found: list[int] = []
        for pid in pids:
            found.extend(process_tree(pid))
        return found

    def stop(self) -> None:
        self.kill()

    def restart(self) -> None:
        self.kill()
        self.start()

    async def akill(self) -> None:
        await anyio.to_thread.run_sync(self.kill)

    async def astart(self) -> None:
        await anyio.to_thread.run_sync(self.start)

    async def arestart(self) -> None:
        await anyio.to_thread.run_sync(self.restart)

    def session_processes(self) -> list[int]:
        """Per-connection sshd processes and the commands they run (not the listener)."""
        if self._process is None:
            return []
        return [pid for pid in process_tree(self._process.pid) if pid != self._process.pid]

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""
