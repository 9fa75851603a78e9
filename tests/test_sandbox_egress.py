"""The namespaces tier's egress allow-list (docs/sandboxes.md, "Egress"), with real parts.

Real TCP servers on this host (on 127.0.0.1, on 127.0.0.2, and in a network
namespace of the test's own joined by a veth pair) and real sandboxes of the
local backend: an allowed ``host:port`` is reached and bytes go both ways,
half-closes included; anything else fails at once (``ECONNREFUSED`` or
``ENETUNREACH``, asserted by the outcome, with socket timeouts far above what is
expected only as a backstop); a host name is resolved inside through the
sandbox's own ``/etc/hosts``; the relay's bound holds; a sandbox started again
gets its relays again; and nothing is left after ``aclose()``.

The tests need root, bubblewrap and cgroup v1: without them they skip, except
under ``CI=true``, where they fail. Traffic goes only to addresses on this
machine: loopback, and the test's own namespace.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import ipaddress
import os
import secrets
import shutil
import socket
import socketserver
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import pytest
from support.walls import require_walls

from agent_backend.backends.local import LocalBackend, LocalHost, LocalPoolConfig
from agent_backend.dispatch.backend import Command, CommandResult
from agent_backend.errors import PoolClosed, SandboxUnavailable
from agent_backend.sandbox import EgressRelay, SandboxLimits, guarantees_of
from agent_backend.sandbox.egress import (
    MAX_CONNECTIONS,
    EgressStatistics,
    hosts_data,
    resolve_destinations,
)

pytestmark = pytest.mark.anyio

LIMITS = SandboxLimits(memory_mb=256, tasks=64, cpus=1.0, open_files=512, tmp_mb=16)
# Far beyond what a refusal or a relayed round trip takes on this machine: a backstop only.
BACKSTOP = 30


# -- real servers ------------------------------------------------------------------------------


class _Handler(socketserver.BaseRequestHandler):
    server: Server

    def handle(self) -> None:
        self.request.settimeout(BACKSTOP * 4)
        self.server.count_accepted()
        if self.server.mode == "hold":  # one byte to say the connection is through, then wait
            self.request.sendall(b"+")
            self.server.release.wait(BACKSTOP * 4)
            return
        received = bytearray()
        while data := self.request.recv(1 << 16):
            received += data
        self.server.received.append(bytes(received))
        # After the client's half-close: its bytes reversed, then our own end.
        self.request.sendall(bytes(reversed(received)))
        self.request.shutdown(socket.SHUT_WR)


class Server(socketserver.ThreadingTCPServer):
    """A TCP server in a thread: ``echo`` (the bytes it got, reversed, after the client's
    half-close) or ``hold`` (one byte, then the connection held until :meth:`close`)."""

    daemon_threads = False
    block_on_close = True  # server_close() joins every connection's thread

    def __init__(self, address: str, mode: str = "echo") -> None:
        self.address_family = socket.AF_INET6 if ":" in address else socket.AF_INET
        super().__init__((address, 0), _Handler)
        self.mode = mode
        self.port: int = self.server_address[1]
        self.received: list[bytes] = []
        self.release = threading.Event()
        self.accepted = 0
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    def count_accepted(self) -> None:
        with self._changed:
            self.accepted += 1
            self._changed.notify_all()

    def close(self) -> None:
        self.release.set()
        self.shutdown()
        self.server_close()
        self._thread.join()


@contextlib.contextmanager
def serving(address: str, mode: str = "echo") -> Iterator[Server]:
    server = Server(address, mode)
    try:
        yield server
    finally:
        server.close()


def _run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _free_subnet() -> int:
    """A third octet X with 10.214.X.0/24 on no link of this host."""
    used = set()
    for word in _run("ip", "-4", "-o", "addr", "show").split():
        with contextlib.suppress(ValueError):
            address = ipaddress.ip_interface(word)
            if address.ip in ipaddress.ip_network("10.214.0.0/16"):
                used.add(address.ip.packed[2])
    for offset in range(250):
        octet = (os.getpid() + offset) % 250 + 1
        if octet not in used:
            return octet
    raise RuntimeError("no free 10.214.X.0/24 subnet left")


_LOCK = os.path.join(tempfile.gettempdir(), "agent-backend-egress-netns.lock")
_PEER_SERVER = textwrap.dedent(
    """\
    import socket, sys
    listener = socket.create_server((sys.argv[1], 0))
    print(listener.getsockname()[1], flush=True)
    while True:
        conn, _ = listener.accept()
        with conn:
            received = b""
            while data := conn.recv(65536):
                received += data
            conn.sendall(b"peer:" + received)
    """
)


@contextlib.contextmanager
def peer_namespace() -> Iterator[tuple[str, int, str]]:
    """A network namespace of this test's own, joined to this host by a veth pair, with an
    echo server in it: its address, the server's port, and an address beside it (unused)."""
    if shutil.which("ip") is None:
        pytest.fail("iproute2 (ip) is needed for a namespace with a server in it")
    tag = f"{os.getpid():x}{secrets.token_hex(2)}"
    name, outer, inner = f"abegress-{tag}", f"abe{tag}o", f"abe{tag}i"
    server: subprocess.Popen[str] | None = None
    try:
        _run("ip", "netns", "add", name)
        _run("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
        _run("ip", "link", "set", inner, "netns", name)
        with open(_LOCK, "a") as lock:  # runs side by side never share a subnet
            fcntl.flock(lock, fcntl.LOCK_EX)
            octet = _free_subnet()
            _run("ip", "addr", "add", f"10.214.{octet}.1/24", "dev", outer)
        peer, beside = f"10.214.{octet}.2", f"10.214.{octet}.3"
        _run("ip", "link", "set", outer, "up")
        _run("ip", "-n", name, "addr", "add", f"{peer}/24", "dev", inner)
        _run("ip", "-n", name, "link", "set", inner, "up")
        _run("ip", "-n", name, "link", "set", "lo", "up")
        server = subprocess.Popen(
            ["ip", "netns", "exec", name, sys.executable, "-c", _PEER_SERVER, peer],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert server.stdout is not None
        port = int(server.stdout.readline())
        yield peer, port, beside
    finally:
        if server is not None:
            server.kill()
            server.wait()
            if server.stdout is not None:
                server.stdout.close()
        subprocess.run(["ip", "link", "del", outer], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


# -- sandboxes ---------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def egress_pool(*allowed: str, spares: int = 0) -> AsyncIterator[LocalHost]:
    require_walls()
    config = LocalPoolConfig(
        isolation="namespaces", limits=LIMITS, spare_workspaces=spares, egress_allow=allowed
    )
    async with LocalBackend(config) as backend:
        yield backend.host


async def python_in(host: LocalHost, workspace: str, script: str) -> CommandResult:
    command = Command(
        argv=("python3", "-c", textwrap.dedent(script)),
        cwd=workspace,
        timeout=BACKSTOP * 2,
        output_limit=1 << 16,
    )
    return await host.run(command)


def _connect_errno(host: str, port: int) -> str:
    """A line of Python that prints what a connect to ``host:port`` gives (0 or an errno)."""
    family = "socket.AF_INET6" if ":" in host else "socket.AF_INET"
    return (
        f"s = socket.socket({family}); s.settimeout({BACKSTOP}); "
        f"print({host!r}, {port}, s.connect_ex(({host!r}, {port})), flush=True); s.close()"
    )


def _relay(host: LocalHost) -> EgressRelay:
    relay = host._egress
    assert relay is not None
    return relay


def _socket_inodes() -> set[str]:
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:"):
                found.add(target)
    return found


def _egress_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("agent-backend-egress")]


# -- entries, hosts, guarantees (no sandbox) -----------------------------------------------------


@pytest.mark.parametrize(
    "entry", ["10.1.2.3:80", "[::1]:8000", "mirror.local:8080", "pypi-mirror.internal.:3141"]
)
def test_good_entries_load(entry: str) -> None:
    config = LocalPoolConfig(isolation="namespaces", egress_allow=(entry,))
    assert config.egress_allow == (entry,)


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ("mirror.local", "a port is required"),
        ("10.1.2.3:0", "from 1 to 65535"),
        ("10.1.2.3:65536", "from 1 to 65535"),
        ("10.1.2.3:http", "from 1 to 65535"),
        ("::1:80", "in brackets"),
        ("[::1]", "[address]:port"),
        ("[mirror]:80", "not an IPv6 address"),
        ("bad_name:80", "neither an IPv4 address nor a host name"),
        ("-bad.example:80", "neither an IPv4 address nor a host name"),
        ("10.1.2:80", "not a full IPv4 address"),
        ("0.0.0.0:80", "not an address a connection can go to"),
        ("[ff02::1]:80", "not an address a connection can go to"),
    ],
)
def test_bad_entries_are_refused_at_load_saying_why(entry: str, says: str) -> None:
    with pytest.raises(ValueError, match="egress_allow") as caught:
        LocalPoolConfig(isolation="namespaces", egress_allow=(entry,))
    assert says in str(caught.value)
    assert repr(entry) in str(caught.value)


def test_the_guarantees_name_the_allowed_destinations() -> None:
    limits = SandboxLimits()
    none = guarantees_of("namespaces", limits)
    assert none.network == "own network namespace: loopback only, no egress"
    some = guarantees_of("namespaces", limits, egress=("a:1", "b:2"))
    assert "network: own network namespace: loopback only; egress allowed to: a:1, b:2" in (
        some.lines()
    )
    assert guarantees_of("none", limits, egress=("a:1",)).network.startswith("host: every")


def test_a_sandboxs_hosts_keep_the_hosts_own_and_add_the_allowed_names() -> None:
    destinations = resolve_destinations(["127.0.0.1:80", "localhost:81"])
    base = b"127.0.0.1 localhost\n::1 localhost ip6-localhost\n"
    data = hosts_data(destinations, base=base).decode()
    assert data.startswith(base.decode())
    assert "127.0.0.1 localhost" in data.removeprefix(base.decode())  # the name, resolved
    assert "127.0.0.1 127.0.0.1" not in data  # an address needs no line
    assert hosts_data(resolve_destinations(["127.0.0.1:80"]), base=base) == base


# -- through real sandboxes ------------------------------------------------------------------------


async def test_allowed_round_trips_both_ways_and_everything_else_fails_at_once() -> None:
    with serving("127.0.0.1") as server:
        allowed = f"127.0.0.1:{server.port}"
        async with egress_pool(allowed) as host:
            assert f"egress allowed to: {allowed}" in host.guarantees().network
            workspace = await host.make_workspace()
            payload = secrets.token_bytes(1 << 20)
            await host.write_file(workspace, "payload", payload)
            script = f"""\
                import hashlib, socket
                s = socket.create_connection(("127.0.0.1", {server.port}), timeout={BACKSTOP})
                s.sendall(open("payload", "rb").read())
                s.shutdown(socket.SHUT_WR)  # half-close: the server answers after our end
                back = bytearray()
                while data := s.recv(65536):
                    back += data
                print("back", len(back), hashlib.sha256(back).hexdigest(), flush=True)
                {_connect_errno("127.0.0.1", server.port + 1)}
                {_connect_errno("127.0.0.2", server.port)}
                {_connect_errno("203.0.113.7", 80)}
                {_connect_errno("2001:db8::7", 443)}
                """
            result = await python_in(host, workspace, script)
            assert result.exit_status == 0, result.stderr.text()
            lines = result.stdout.text().splitlines()
            reversed_payload = bytes(reversed(payload))
            assert lines[0] == f"back {len(payload)} {hashlib.sha256(reversed_payload).hexdigest()}"
            assert server.received == [payload]  # what the real destination got
            assert lines[1:] == [
                f"127.0.0.1 {server.port + 1} {errno.ECONNREFUSED}",  # same host, other port
                f"127.0.0.2 {server.port} {errno.ECONNREFUSED}",  # another loopback address
                f"203.0.113.7 80 {errno.ENETUNREACH}",  # another host: no route
                f"2001:db8::7 443 {errno.ENETUNREACH}",
            ]


async def test_a_destination_in_another_namespace_is_reached_through_the_sandboxs_lo() -> None:
    require_walls()
    ip = shutil.which("ip")
    with peer_namespace() as (peer, port, beside):
        async with egress_pool(f"{peer}:{port}") as host:
            workspace = await host.make_workspace()
            script = f"""\
                import socket, subprocess
                s = socket.create_connection(("{peer}", {port}), timeout={BACKSTOP})
                s.sendall(b"ping"); s.shutdown(socket.SHUT_WR)
                print(s.makefile("rb").read().decode(), flush=True)
                {_connect_errno(beside, port)}
                {_connect_errno(peer, port + 1)}
                print(subprocess.run(["{ip}", "-o", "addr", "show", "dev", "lo"],
                                     capture_output=True, text=True).stdout, flush=True)
                """
            result = await python_in(host, workspace, script)
            assert result.exit_status == 0, result.stderr.text()
            lines = result.stdout.text().splitlines()
            assert lines[0] == "peer:ping"
            assert lines[1] == f"{beside} {port} {errno.ENETUNREACH}"  # no route: at once
            assert lines[2] == f"{peer} {port + 1} {errno.ECONNREFUSED}"
            assert f"inet {peer}/32" in result.stdout.text()  # on the sandbox's lo only
            assert peer not in _run("ip", "-o", "addr", "show", "dev", "lo")  # not the host's


async def test_a_host_name_resolves_inside_through_the_sandboxs_etc_hosts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    name = f"mirror-{secrets.token_hex(3)}.egress.test"
    assert name not in await anyio.Path("/etc/hosts").read_text()
    real_getaddrinfo = socket.getaddrinfo

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        # This host's resolver, with one name more (a test must not edit the host's /etc/hosts).
        return real_getaddrinfo("127.0.0.2" if host == name else host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    with serving("127.0.0.2") as server:
        async with egress_pool(f"{name}:{server.port}") as host:
            monkeypatch.undo()  # resolved once, at start: not needed any more
            workspace = await host.make_workspace()
            script = f"""\
                import socket
                print(socket.gethostbyname("{name}"), socket.gethostbyname("localhost"))
                s = socket.create_connection(("{name}", {server.port}), timeout={BACKSTOP})
                s.sendall(b"olleh"); s.shutdown(socket.SHUT_WR)
                print(s.makefile("rb").read().decode(), flush=True)
                """
            result = await python_in(host, workspace, script)
            assert result.exit_status == 0, result.stderr.text()
            assert result.stdout.text().splitlines() == ["127.0.0.2 127.0.0.1", "hello"]


async def test_a_connection_past_the_bound_is_reset_at_once() -> None:
    with serving("127.0.0.1", mode="hold") as server:
        async with egress_pool(f"127.0.0.1:{server.port}") as host:
            relay = _relay(host)
            assert relay.max_connections == MAX_CONNECTIONS
            workspace = await host.make_workspace()
            script = f"""\
                import socket
                held = []
                for _ in range({MAX_CONNECTIONS}):
                    s = socket.create_connection(("127.0.0.1", {server.port}), timeout={BACKSTOP})
                    assert s.recv(1) == b"+"  # through to the server
                    held.append(s)
                print("held", len(held), flush=True)
                try:  # the reset may come before connect() returns, or after
                    extra = socket.create_connection(("127.0.0.1", {server.port}), timeout={BACKSTOP})
                    print("extra", extra.recv(1), flush=True)
                except ConnectionResetError:
                    print("extra reset", flush=True)
                """
            result = await python_in(host, workspace, script)
            assert result.exit_status == 0, result.stderr.text()
            assert result.stdout.text().splitlines() == [f"held {MAX_CONNECTIONS}", "extra reset"]
            assert server.accepted == MAX_CONNECTIONS  # the one past the bound never reached it
            assert relay.statistics().reset_over_limit == 1
            server.release.set()
            # The held connections ended with the command: the bound is free again.
            for _ in range(BACKSTOP * 100):
                if relay.statistics().connections == 0:
                    break
                await anyio.sleep(0.01)
            assert relay.statistics().connections == 0
            again = await python_in(
                host,
                workspace,
                f"""\
                import socket
                s = socket.create_connection(("127.0.0.1", {server.port}), timeout={BACKSTOP})
                print(s.recv(1))
                """,
            )
            assert again.stdout.text().strip() == "b'+'"


async def test_a_restarted_sandbox_gets_its_relays_again() -> None:
    with serving("127.0.0.1") as server:
        async with egress_pool(f"127.0.0.1:{server.port}") as host:
            workspace = await host.make_workspace()
            walls = host._walls[os.path.basename(workspace).rsplit("-", 1)[-1]]
            assert walls.process is not None
            first = walls.process.relays
            assert first is not None
            assert not first.is_closed()
            probe = f"""\
                import socket
                s = socket.create_connection(("127.0.0.1", {server.port}), timeout={BACKSTOP})
                s.sendall(b"ab"); s.shutdown(socket.SHUT_WR)
                print(s.makefile("rb").read().decode(), flush=True)
                """
            assert (await python_in(host, workspace, probe)).stdout.text() == "ba\n"
            # A command kills its sandbox's agent (pid 2 there: it shares the command's uid).
            await host.run(Command(shell="kill -9 2", cwd=workspace, timeout=60, output_limit=99))
            again = await python_in(host, workspace, probe)
            assert again.stdout.text() == "ba\n", again.stderr.text()
            assert walls.process is not None
            assert first.is_closed()
            assert walls.process.relays is not None
            assert walls.process.relays is not first
            # The scratch directory's sandbox and this one: the old listeners are gone.
            assert _relay(host).statistics().sandboxes == 2


async def test_nothing_is_left_after_aclose() -> None:
    require_walls()
    sockets_before = _socket_inodes()
    assert _egress_threads() == []
    with serving("127.0.0.1") as server:
        config = LocalPoolConfig(
            isolation="namespaces",
            limits=LIMITS,
            spare_workspaces=2,
            egress_allow=(f"127.0.0.1:{server.port}",),
        )
        backend = LocalBackend(config)
        outcome: list[BaseException] = []
        async with anyio.create_task_group() as group, backend:
            relay = _relay(backend.host)
            workspace = await backend.host.make_workspace()
            # A call whose relayed connection is still open when the backend closes.
            script = f"""\
                    import socket, time
                    s = socket.create_connection(("127.0.0.1", {server.port}), timeout={BACKSTOP})
                    s.sendall(b"x")
                    time.sleep({BACKSTOP * 4})
                    """

            async def call() -> None:
                try:
                    await python_in(backend.host, workspace, script)
                except PoolClosed as exc:  # the backend closed under it, as it should
                    outcome.append(exc)

            group.start_soon(call)
            for _ in range(BACKSTOP * 100):
                if relay.statistics().connections == 1 and server.accepted == 1:
                    break
                await anyio.sleep(0.01)
            assert relay.statistics().connections == 1
            assert relay.statistics().sandboxes >= 2  # the scratch directory's, this one
            assert "agent-backend-egress" in _egress_threads()
        assert [type(exc) for exc in outcome] == [PoolClosed]
        assert relay.is_closed()
        assert relay.statistics() == EgressStatistics(0, 0, 0, closed=True)
        assert _egress_threads() == []
        assert backend.host._egress is None
    assert _socket_inodes() <= sockets_before  # no listener, no relayed connection


async def test_a_name_that_does_not_resolve_refuses_the_pool() -> None:
    require_walls()
    name = f"nowhere-{secrets.token_hex(4)}.invalid"
    with pytest.raises(SandboxUnavailable, match="egress_allow") as caught:
        async with egress_pool(f"{name}:80"):
            pass
    assert name in str(caught.value)
    assert _egress_threads() == []
