"""The egress allow-list of the namespaces tier: a TCP relay, owned by the backend, from each
sandbox's network namespace to the few ``host:port`` destinations a pool allows.

A sandbox's network namespace has loopback only. For each allowed destination,
:meth:`EgressRelay.open` puts a listening socket *inside* that namespace, at the
destination's own address and port (an address that is not a loopback one is
first added to the namespace's ``lo`` as a ``/32`` or ``/128``), and the relay's
thread, in the host's namespace, connects each accepted connection to the real
destination and copies bytes both ways, half-closes included. To a command in the
sandbox, ``connect(allowed)`` simply works; any other destination has no listener
(``ECONNREFUSED`` at once) or no route (``ENETUNREACH`` at once): no packet ever
leaves the namespace but through a relayed connection.

* Entries are checked when the config loads (:data:`EgressEntry`); host names are
  resolved once, on the host, when the pool starts (:meth:`EgressRelay.start`), and
  written to every sandbox's ``/etc/hosts`` (:meth:`EgressRelay.hosts_fd`, bound
  over the host's copy by bubblewrap): a sandbox has no DNS.
* The namespace is entered by a thread of its own that does nothing else: it
  adds the addresses, makes the listening sockets (a socket stays in the namespace
  it was made in) and ends. No thread that entered a sandbox's namespace is ever
  reused.
* Every relayed connection runs on one event loop, in one thread per relay
  (never the caller's loop); at most ``max_connections`` per sandbox at once, and
  one past that is reset as soon as it is accepted. A destination that refuses,
  or does not answer within :data:`CONNECT_SECONDS`, resets the connection too.

This module must never change the host's own network (no address, route, link or
firewall rule outside a sandbox's namespace), never let a thread that entered a
sandbox's namespace run anything but its setup, and never connect anywhere but to
an allowed destination.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import errno
import ipaddress
import logging
import os
import re
import socket
import struct
import threading
from collections.abc import Iterator, Sequence
from typing import Annotated, TypeAlias

import pydantic

__all__ = [
    "CONNECT_SECONDS",
    "MAX_CONNECTIONS",
    "Destination",
    "EgressEntry",
    "EgressRelay",
    "EgressStatistics",
    "SandboxRelays",
    "hosts_data",
    "parse_destination",
    "resolve_destinations",
]

logger = logging.getLogger("agent_backend.sandbox")

#: Connections relayed at once for one sandbox; one more is reset as soon as it is accepted.
MAX_CONNECTIONS = 64
#: Seconds the relay waits for an allowed destination to accept before it resets the connection.
CONNECT_SECONDS = 30.0

_CHUNK = 1 << 16
_CONTROL_SECONDS = 30.0
_CLONE_NEWNET = 0x40000000
_HOSTNAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")

IPAddress: TypeAlias = ipaddress.IPv4Address | ipaddress.IPv6Address


# -- entries ---------------------------------------------------------------------------------------


def parse_destination(entry: str) -> tuple[str, int]:
    """The host (an address or a host name) and the port of an ``egress_allow`` entry:
    ``1.2.3.4:80``, ``[::1]:8000`` or ``mirror.local:8080``. Raises :class:`ValueError`
    saying what is wrong."""
    where = f"egress_allow entry {entry!r}"
    if entry.startswith("["):
        host, bracket, rest = entry[1:].partition("]")
        if not bracket or not rest.startswith(":"):
            raise ValueError(f"{where}: write an IPv6 destination as [address]:port")
        port_text = rest[1:]
        try:
            address = ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{where}: {host!r} is not an IPv6 address") from None
        _check_address(where, address)
    else:
        host, colon, port_text = entry.rpartition(":")
        if not colon or not host:
            raise ValueError(f"{where}: expected host:port (a port is required)")
        if ":" in host:
            raise ValueError(f"{where}: write an IPv6 destination in brackets, [address]:port")
        try:
            _check_address(where, ipaddress.IPv4Address(host))
        except ipaddress.AddressValueError:
            _check_hostname(where, host)
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"{where}: the port must be a number from 1 to 65535")
    return host, int(port_text)


def _check_address(where: str, address: IPAddress) -> None:
    if address.is_unspecified or address.is_multicast:
        raise ValueError(f"{where}: {address} is not an address a connection can go to")


def _check_hostname(where: str, host: str) -> None:
    labels = host.removesuffix(".").split(".")
    if len(host) > 253 or not all(_HOSTNAME.fullmatch(label) for label in labels):
        raise ValueError(
            f"{where}: {host!r} is neither an IPv4 address nor a host name (letters, digits and "
            "hyphens, in dot-separated labels)"
        )
    if labels[-1].isdigit():
        raise ValueError(f"{where}: {host!r} is not a full IPv4 address (four numbers)")


def _checked_entry(entry: str) -> str:
    parse_destination(entry)
    return entry


EgressEntry: TypeAlias = Annotated[str, pydantic.AfterValidator(_checked_entry)]
"""One ``egress_allow`` entry, checked at load: ``host:port``, where host is an IPv4 address,
an IPv6 one in brackets, or a host name, and port is 1 to 65535."""


@dataclasses.dataclass(frozen=True, slots=True)
class Destination:
    """One allowed destination, resolved."""

    entry: str
    """As the pool file wrote it."""
    host: str
    """The address or host name of the entry."""
    port: int
    addresses: tuple[str, ...]
    """Its addresses (a host name's, as resolved when the pool started)."""

    @property
    def is_name(self) -> bool:
        """The entry names a host (written in each sandbox's ``/etc/hosts``)."""
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            return True
        return False


def resolve_destinations(entries: Sequence[str]) -> list[Destination]:
    """Each entry with its addresses; host names are resolved on this host (blocks: DNS).
    Raises :class:`OSError` naming the entry whose name does not resolve."""
    destinations = []
    for entry in entries:
        host, port = parse_destination(entry)
        try:
            found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise OSError(
                exc.errno, f"egress_allow entry {entry!r}: cannot resolve {host!r}: {exc.strerror}"
            ) from exc
        addresses: list[str] = []
        for _family, _type, _proto, _name, sockaddr in found:  # AF_INET and AF_INET6 only
            address = ipaddress.ip_address(str(sockaddr[0]))
            try:
                _check_address(f"egress_allow entry {entry!r}", address)
            except ValueError as exc:
                raise OSError(errno.EINVAL, f"{exc} (resolved from {host!r})") from None
            if str(address) not in addresses:
                addresses.append(str(address))
        if not addresses:
            raise OSError(errno.ENOENT, f"egress_allow entry {entry!r}: {host!r} has no address")
        destinations.append(Destination(entry, host, port, tuple(addresses)))
    return destinations


def hosts_data(destinations: Sequence[Destination], *, base: bytes) -> bytes:
    """A sandbox's ``/etc/hosts``: the host's own (``base``), then each allowed host name with
    its addresses."""
    lines = [f"{address} {d.host}" for d in destinations if d.is_name for address in d.addresses]
    if not lines:
        return base
    tail = "# agent-backend: the hosts of egress_allow, resolved when the pool started\n"
    tail += "".join(f"{line}\n" for line in lines)
    return base + (b"" if base.endswith(b"\n") or not base else b"\n") + tail.encode()


# -- inside a sandbox's namespace -----------------------------------------------------------------

# Netlink: add an address to an interface (rtnetlink(7)).
_RTM_NEWADDR = 20
_NLMSG_ERROR = 2
_NLM_F_REQUEST, _NLM_F_ACK, _NLM_F_EXCL, _NLM_F_CREATE = 0x1, 0x4, 0x200, 0x400
_IFA_ADDRESS, _IFA_LOCAL = 1, 2
_IFA_F_NODAD = 0x02
_RT_SCOPE_HOST = 254


def _add_to_loopback(address: IPAddress, index: int) -> None:
    """Add ``address`` as a single-address prefix to the interface ``index`` of this thread's
    network namespace (a netlink socket works in the namespace it was made in)."""
    family = socket.AF_INET if address.version == 4 else socket.AF_INET6
    packed = address.packed
    attributes = b"".join(
        struct.pack("=HH", 4 + len(packed), kind) + packed for kind in (_IFA_LOCAL, _IFA_ADDRESS)
    )
    flags = _IFA_F_NODAD if address.version == 6 else 0
    body = struct.pack("=BBBBI", family, len(packed) * 8, flags, _RT_SCOPE_HOST, index)
    body += attributes
    request = _NLM_F_REQUEST | _NLM_F_ACK | _NLM_F_EXCL | _NLM_F_CREATE
    header = struct.pack("=IHHII", 16 + len(body), _RTM_NEWADDR, request, 1, 0)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as netlink:
        netlink.settimeout(_CONTROL_SECONDS)
        netlink.bind((0, 0))
        netlink.send(header + body)
        reply = netlink.recv(1 << 16)
    if len(reply) >= 20 and struct.unpack_from("=H", reply, 4)[0] == _NLMSG_ERROR:
        error = -struct.unpack_from("=i", reply, 16)[0]
        if error not in (0, errno.EEXIST):
            raise OSError(error, f"cannot add {address} to the sandbox's loopback")


def _setns(fd: int) -> None:
    """Move the calling *thread* into the network namespace ``fd``."""
    setns = getattr(os, "setns", None)  # Python 3.12 and later
    if setns is not None:
        setns(fd, _CLONE_NEWNET)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        number = ctypes.get_errno()
        raise OSError(number, os.strerror(number))


def _listen_inside(
    netns: int, targets: Sequence[tuple[IPAddress, int]], backlog: int
) -> list[socket.socket]:
    """In a thread of its own that enters the namespace ``netns`` and ends: the addresses of
    ``targets`` on its ``lo``, and a listening socket at each target. Blocks."""
    made: list[socket.socket] = []
    failure: list[BaseException] = []

    def enter_and_listen() -> None:
        try:
            host = os.stat("/proc/thread-self/ns/net")
            theirs = os.fstat(netns)
            if (host.st_dev, host.st_ino) == (theirs.st_dev, theirs.st_ino):
                raise OSError(errno.EPERM, "the namespace handed over is the host's own")
            _setns(netns)
            loopback = socket.if_nametoindex("lo")
            for address in dict.fromkeys(address for address, _port in targets):
                if not address.is_loopback:
                    _add_to_loopback(address, loopback)
            for address, port in targets:
                family = socket.AF_INET if address.version == 4 else socket.AF_INET6
                listener = socket.socket(family, socket.SOCK_STREAM)
                made.append(listener)
                if family == socket.AF_INET6:
                    listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                listener.bind((str(address), port))
                listener.listen(backlog)
                listener.setblocking(False)
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=enter_and_listen, name="agent-backend-egress-setns")
    thread.start()
    thread.join()
    if failure:
        for listener in made:
            listener.close()
        error = failure[0]
        if isinstance(error, OSError):
            raise OSError(
                error.errno, f"cannot open the sandbox's egress relays: {error.strerror or error}"
            ) from error
        raise error
    return made


# -- the relay ---------------------------------------------------------------------------------------


def _reset(sock: socket.socket) -> None:
    """Close ``sock`` with a reset (``SO_LINGER`` 0): the peer sees ``ECONNRESET``, not an end."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


async def _pipe(source: socket.socket, sink: socket.socket) -> None:
    """Copy ``source`` to ``sink`` until ``source`` ends, then end ``sink``'s writing side."""
    loop = asyncio.get_running_loop()
    while data := await loop.sock_recv(source, _CHUNK):
        await loop.sock_sendall(sink, data)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


@dataclasses.dataclass(frozen=True, slots=True)
class EgressStatistics:
    """A relay's state, read at one moment."""

    sandboxes: int
    """Sandboxes whose listeners are open."""
    connections: int
    """Connections being relayed now, all sandboxes together."""
    reset_over_limit: int
    """Connections reset since start because their sandbox had ``max_connections`` already."""
    closed: bool


class SandboxRelays:
    """One sandbox's listeners, and the connections relayed for it; :meth:`close` ends them."""

    def __init__(
        self, relay: EgressRelay, listeners: Sequence[tuple[socket.socket, tuple[str, int]]]
    ) -> None:
        self._relay = relay
        self._listeners = list(listeners)
        self._task: asyncio.Task[None] | None = None
        self._open: set[socket.socket] = set()
        self._active = 0
        self._closed = False

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        return f"<SandboxRelays [listeners: {len(self._listeners)} | connections: {self._active}]{state}>"

    def connections(self) -> int:
        """Connections being relayed now for this sandbox."""
        return self._active

    def is_closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """End the listeners and every connection relayed for this sandbox; idempotent. Blocks:
        call from a thread, never from the relay's."""
        if self._closed:
            return
        self._closed = True
        self._relay._forget(self)

    # -- on the relay's loop ------------------------------------------------------------------------

    async def _serve(self) -> None:
        try:
            async with asyncio.TaskGroup() as group:
                for listener, target in self._listeners:
                    group.create_task(self._accept(listener, target, group))
        except Exception:  # a bug: its listeners close, and connections there are refused
            logger.exception("a sandbox's egress relay failed; its destinations are refused")
        finally:
            for listener, _target in self._listeners:
                listener.close()
            for sock in self._open:
                sock.close()
            self._open.clear()

    async def _accept(
        self, listener: socket.socket, target: tuple[str, int], group: asyncio.TaskGroup
    ) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                inside, _peer = await loop.sock_accept(listener)
            except (ConnectionAbortedError, InterruptedError):
                continue
            except OSError as exc:  # out of descriptors: the next accept may succeed
                logger.warning("egress relay to %s:%d cannot accept: %s", *target, exc)
                await asyncio.sleep(0.1)
                continue
            if self._active >= self._relay.max_connections:
                self._relay._over_limit += 1
                _reset(inside)
                continue
            self._active += 1
            self._open.add(inside)
            group.create_task(self._relay_one(inside, target))

    async def _relay_one(self, inside: socket.socket, target: tuple[str, int]) -> None:
        family = socket.AF_INET6 if ":" in target[0] else socket.AF_INET
        outside: socket.socket | None = None
        broken = False
        try:
            outside = socket.socket(family, socket.SOCK_STREAM)
            self._open.add(outside)
            outside.setblocking(False)
            async with asyncio.timeout(CONNECT_SECONDS):
                await asyncio.get_running_loop().sock_connect(outside, target)
            async with asyncio.TaskGroup() as pair:
                pair.create_task(_pipe(inside, outside))
                pair.create_task(_pipe(outside, inside))
        except* (OSError, TimeoutError):
            broken = True  # refused, reset, unreachable: the other side is reset as well
        finally:
            self._active -= 1
            for sock in (inside, outside):
                if sock is not None:
                    self._open.discard(sock)
                    if broken:
                        _reset(sock)
                    else:
                        sock.close()


class EgressRelay:
    """The relay of one pool: its allowed destinations, and a thread running every sandbox's
    relayed connections.

    :meth:`start` (blocks: resolves names) makes one; :meth:`open` gives a sandbox its
    listeners; :meth:`close` ends every sandbox's and the thread. Every method is called from
    worker threads, never from an event loop.
    """

    def __init__(
        self, destinations: Sequence[Destination], *, hosts: bytes, max_connections: int
    ) -> None:
        self.destinations = tuple(destinations)
        self.hosts = hosts
        """The ``/etc/hosts`` of every sandbox."""
        self.max_connections = max_connections
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self._lock = threading.Lock()
        self._sandboxes: set[SandboxRelays] = set()
        self._over_limit = 0
        self._closed = False

    def __repr__(self) -> str:
        stats = self.statistics()
        allowed = ", ".join(d.entry for d in self.destinations)
        state = " closed" if stats.closed else ""
        return (
            f"<EgressRelay to {allowed} [sandboxes: {stats.sandboxes}"
            f" | connections: {stats.connections}]{state}>"
        )

    @classmethod
    def start(
        cls,
        entries: Sequence[str],
        *,
        max_connections: int = MAX_CONNECTIONS,
        hosts_file: str = "/etc/hosts",
    ) -> EgressRelay:
        """The relay to ``entries``, its names resolved and its thread started. Blocks (DNS,
        a file): call from a thread. Raises :class:`OSError` naming an entry that does not
        resolve."""
        destinations = resolve_destinations(entries)
        try:
            with open(hosts_file, "rb") as file:
                base = file.read(1 << 20)
        except OSError:
            base = b"127.0.0.1 localhost\n::1 localhost\n"
        relay = cls(
            destinations, hosts=hosts_data(destinations, base=base), max_connections=max_connections
        )
        ready = threading.Event()
        thread = threading.Thread(
            target=relay._run, args=(ready,), name="agent-backend-egress", daemon=True
        )
        relay._thread = thread
        thread.start()
        ready.wait()
        if relay._loop is None:
            thread.join()
            raise OSError(errno.ECHILD, "the egress relay's thread did not start")
        return relay

    def targets(self) -> list[tuple[IPAddress, int]]:
        """Every address and port a sandbox gets a listener at, each once."""
        found = (
            (ipaddress.ip_address(address), d.port)
            for d in self.destinations
            for address in d.addresses
        )
        return list(dict.fromkeys(found))

    def is_closed(self) -> bool:
        return self._closed

    def statistics(self) -> EgressStatistics:
        sandboxes = list(self._sandboxes)
        return EgressStatistics(
            sandboxes=len(sandboxes),
            connections=sum(s.connections() for s in sandboxes),
            reset_over_limit=self._over_limit,
            closed=self._closed,
        )

    @contextlib.contextmanager
    def hosts_fd(self) -> Iterator[int]:
        """A descriptor holding :attr:`hosts` from its start (a new one each time: the reader
        moves its offset), closed on leaving; for bubblewrap's ``--ro-bind-data``."""
        fd = os.memfd_create("agent-backend-hosts", os.MFD_CLOEXEC)
        try:
            view = memoryview(self.hosts)
            while view:
                view = view[os.write(fd, view) :]
            os.lseek(fd, 0, os.SEEK_SET)
            yield fd
        finally:
            os.close(fd)

    def open(self, netns: int) -> SandboxRelays:
        """The listeners of the sandbox whose network namespace is ``netns`` (a descriptor,
        left open), serving until :meth:`SandboxRelays.close`. Blocks: call from a thread."""
        targets = self.targets()
        listeners = _listen_inside(netns, targets, min(self.max_connections, 128))
        relays = SandboxRelays(
            self,
            [(sock, (str(a), port)) for sock, (a, port) in zip(listeners, targets, strict=True)],
        )
        with self._lock:
            loop = self._loop
            if self._closed or loop is None:
                for sock in listeners:
                    sock.close()
                raise OSError(errno.ESHUTDOWN, "the egress relay is closed")
            try:
                future = asyncio.run_coroutine_threadsafe(self._add(relays), loop)
            except RuntimeError as exc:
                for sock in listeners:
                    sock.close()
                raise OSError(errno.ESHUTDOWN, "the egress relay is closed") from exc
        future.result(timeout=_CONTROL_SECONDS)
        return relays

    def close(self) -> None:
        """End every sandbox's relays, then the thread; idempotent. Blocks: call from a thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            loop, stop = self._loop, self._stop
            if loop is not None and stop is not None:
                loop.call_soon_threadsafe(stop.set)
        if self._thread is not None:
            self._thread.join()

    # -- on the relay's thread ----------------------------------------------------------------------

    def _run(self, ready: threading.Event) -> None:
        try:
            asyncio.run(self._main(ready))
        finally:
            ready.set()

    async def _main(self, ready: threading.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        ready.set()
        await self._stop.wait()
        await asyncio.gather(*(self._end(relays) for relays in list(self._sandboxes)))

    async def _add(self, relays: SandboxRelays) -> None:
        relays._task = asyncio.create_task(relays._serve())
        self._sandboxes.add(relays)

    async def _end(self, relays: SandboxRelays) -> None:
        task = relays._task
        if task is not None:
            task.cancel()
            await asyncio.wait({task})
        self._sandboxes.discard(relays)

    def _forget(self, relays: SandboxRelays) -> None:
        """Have the relay's thread end ``relays`` (from another thread; blocks until it has)."""
        with self._lock:
            loop = self._loop
            if self._closed or loop is None:
                return  # the thread ends (or has ended) every sandbox's relays itself
            try:
                future = asyncio.run_coroutine_threadsafe(self._end(relays), loop)
            except RuntimeError:  # the thread is gone, and its loop closed with everything
                return
        future.result(timeout=_CONTROL_SECONDS)
