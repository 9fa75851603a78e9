"""Separate SSH hosts for tests: network namespaces on a bridge, each running its own sshd.

:class:`Fleet` builds, in the root network namespace, one bridge holding the first
address of a private ``10.213.X.0/24`` (``X`` picked free under a lock, so that runs
side by side never share a subnet) and, per host, a network namespace joined to the
bridge by a veth pair, with its own address (``10.213.X.(10+i)``) and its own OpenSSH
``sshd`` (:class:`~support.sshd.SSHServer`, same keys, started with ``ip netns
exec``). The client (the test) stays in the root namespace and reaches each host
over its veth: real separate hosts, with real links that can fail.

Link control, per host:

* :meth:`Fleet.link_down` / :meth:`Fleet.link_up`: the host's root-side veth (a
  bridge port) goes down/up. Packets are dropped, not refused: the route stays
  on the bridge and the neighbour entries are permanent, so no ARP failure turns
  into ``EHOSTUNREACH``; a connection in flight just stops hearing back.
* :meth:`Fleet.impair`: packet loss and delay. With the kernel's ``netem`` qdisc,
  both directions of the host's link (root side and namespace side). Without it
  (some kernels are built without ``sch_netem``), loss is dropped by an nftables
  rule in the host's namespace (``numgen random``, both directions) and a delay
  cannot be emulated: :class:`NetemMissing` is raised, and ``rate_kbit`` (a ``tbf``
  qdisc, a slow link whose queue delays packets) is what is left.

Names carry a per-run prefix (``abf<pid in base 36>-<fleet>``, namespaces
``abfleet-<pid>-<fleet>-<host>``): :func:`remove_stale` removes those of runs whose
process is gone (a crashed run), and :meth:`Fleet.close` always removes the
fleet's namespaces, links and processes.

This module must never change anything in the root namespace but the links,
addresses and neighbour entries it made itself, never route traffic anywhere but
its own subnet, and never signal a process that is not inside a namespace it made
(or one of a dead run's, by the same name scheme).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from support.sshd import SSHKeys, SSHServer, sshd_missing_reason

__all__ = [
    "Fleet",
    "FleetHost",
    "NetemMissing",
    "fleet_missing_reason",
    "remove_stale",
    "require_fleet",
]

SSH_PORT = 2222
_NETNS_RE = re.compile(r"^abfleet-(\d+)-\d+-\d+$")
_LINK_RE = re.compile(r"^abf([0-9a-z]+)-")
_LOCK = Path(tempfile.gettempdir()) / "agent-backend-netns.lock"
_counter = iter(range(1, 1 << 30))


class NetemMissing(RuntimeError):
    """The kernel has no ``netem`` qdisc: a delay cannot be emulated."""


def _run(*argv: str, check: bool = True, stdin: str | None = None) -> str:
    done = subprocess.run(argv, input=stdin, capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _base36(number: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        number, digit = divmod(number, 36)
        out = digits[digit] + out
        if number == 0:
            return out


def _pid_alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


@functools.cache
def fleet_missing_reason() -> str | None:
    """None when separate hosts can be made here, else why not."""
    reason = sshd_missing_reason()
    if reason is not None:
        return reason
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (ip) is not installed (scripts/ensure-system-deps.sh test installs it)"
    probe = f"abfleet-{os.getpid()}-0-0"
    try:
        _run("ip", "netns", "add", probe)
    except RuntimeError as exc:
        return f"cannot create a network namespace: {exc}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


def require_fleet() -> None:
    """Skip the test without the capability; under ``CI=true``, fail it."""
    reason = fleet_missing_reason()
    if reason is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and {reason}")
    pytest.skip(reason)


def _netns_pids(name: str) -> list[int]:
    return [int(pid) for pid in _run("ip", "netns", "pids", name, check=False).split()]


def _kill_namespace(name: str) -> None:
    """SIGKILL everything inside the namespace (repeat: a dying sshd may fork), then delete it."""
    for _ in range(50):
        pids = _netns_pids(name)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)
    _run("ip", "netns", "del", name, check=False)


def _link_names() -> list[str]:
    names = []
    for line in _run("ip", "-o", "link", "show").splitlines():
        # "7: abf1a2b-1h0@if6: <...>": the name, without the peer suffix.
        names.append(line.split(":", 2)[1].strip().split("@")[0])
    return names


def remove_stale() -> list[str]:
    """Remove the namespaces and links of earlier runs whose process is gone; what was removed."""
    removed = []
    for line in _run("ip", "netns", "list", check=False).splitlines():
        name = line.split()[0] if line.split() else ""
        match = _NETNS_RE.match(name)
        if match and not _pid_alive(int(match.group(1))):
            _kill_namespace(name)
            removed.append(name)
    for name in _link_names():
        match = _LINK_RE.match(name)
        if match and not _pid_alive(int(match.group(1), 36)):
            _run("ip", "link", "del", name, check=False)
            removed.append(name)
    return removed


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    with _LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _free_subnet() -> int:
    """A third octet X with 10.213.X.0/24 on no link of the root namespace (call under the lock)."""
    used = set()
    for line in _run("ip", "-4", "-o", "addr", "show").splitlines():
        for word in line.split():
            if "/" in word:
                with contextlib.suppress(ValueError):
                    address = ipaddress.ip_interface(word)
                    if address.ip in ipaddress.ip_network("10.213.0.0/16"):
                        used.add(address.ip.packed[2])
    start = os.getpid() % 200 + 20
    for offset in range(235):
        octet = (start + offset) % 235 + 20
        if octet not in used:
            return octet
    raise RuntimeError("no free 10.213.X.0/24 subnet left")


@dataclass
class FleetHost:
    """One host of a fleet: its namespace, its links, its sshd."""

    index: int
    netns: str
    address: str
    veth: str
    """The root-side end of its link (a port of the fleet's bridge)."""
    peer: str
    """The namespace-side end."""
    server: SSHServer
    impaired: list[str] = field(default_factory=list)
    """What :meth:`Fleet.impair` set up and :meth:`Fleet.clear` removes."""


class Fleet:
    """N separate hosts, each a network namespace with its own sshd; ``start()`` / ``close()``."""

    def __init__(self, directory: Path, keys: SSHKeys, *, hosts: int) -> None:
        if not 1 <= hosts <= 200:
            raise ValueError("a fleet has 1 to 200 hosts")
        self.directory = directory
        self.keys = keys
        self.size = hosts
        serial = next(_counter)
        self.prefix = f"abf{_base36(os.getpid())}-{serial}"
        self.netns_prefix = f"abfleet-{os.getpid()}-{serial}"
        self.bridge = f"{self.prefix}b"
        self.hosts: list[FleetHost] = []
        self.subnet = ""
        self._netem: bool | None = None

    def __enter__(self) -> Fleet:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- lifecycle ---------------------------------------------------------

    def start(self) -> None:
        try:
            with _locked():
                remove_stale()
                octet = _free_subnet()
                self.subnet = f"10.213.{octet}.0/24"
                _run("ip", "link", "add", self.bridge, "type", "bridge")
                _run("ip", "addr", "add", f"10.213.{octet}.1/24", "dev", self.bridge)
                _run("ip", "link", "set", self.bridge, "up")
            bridge_mac = self._mac(self.bridge)
            # Set explicitly, the bridge keeps it (else it takes its lowest port's, which changes).
            _run("ip", "link", "set", self.bridge, "address", bridge_mac)
            for index in range(self.size):
                self.hosts.append(self._add_host(index, octet, bridge_mac))
            for host in self.hosts:
                host.server.start()
        except BaseException:
            self.close()
            raise

    def _add_host(self, index: int, octet: int, bridge_mac: str) -> FleetHost:
        netns = f"{self.netns_prefix}-{index}"
        veth, peer = f"{self.prefix}h{index}", f"{self.prefix}n{index}"
        address = f"10.213.{octet}.{10 + index}"
        _run("ip", "netns", "add", netns)
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", peer, "netns", netns)
        _run("ip", "link", "set", veth, "master", self.bridge)
        _run("ip", "link", "set", veth, "up")
        _run("ip", "-n", netns, "addr", "add", f"{address}/24", "dev", peer)
        _run("ip", "-n", netns, "link", "set", peer, "up")
        _run("ip", "-n", netns, "link", "set", "lo", "up")
        # Permanent neighbours both ways: a link that is down drops packets silently,
        # instead of failing ARP (which would report EHOSTUNREACH: a refusal, not a loss).
        peer_mac = self._mac(peer, netns=netns)
        _run(
            "ip",
            "neigh",
            "replace",
            address,
            "lladdr",
            peer_mac,
            "dev",
            self.bridge,
            "nud",
            "permanent",
        )
        _run(
            "ip", "-n", netns, "neigh", "replace", f"10.213.{octet}.1",
            "lladdr", bridge_mac, "dev", peer, "nud", "permanent",
        )  # fmt: skip
        server = SSHServer(
            self.directory / f"host{index}",
            self.keys,
            port=SSH_PORT,
            address=address,
            netns=netns,
            max_startups="100:30:200",
        )
        return FleetHost(index, netns, address, veth, peer, server)

    def close(self) -> None:
        """Kill every sshd, remove every namespace and link of the fleet; idempotent.

        Raises if something of the fleet is still there afterwards."""
        for host in self.hosts:
            with contextlib.suppress(Exception):
                host.server.kill()
        namespaces = [
            line.split()[0]
            for line in _run("ip", "netns", "list", check=False).splitlines()
            if line.startswith(f"{self.netns_prefix}-")
        ]
        for name in namespaces:
            _kill_namespace(name)  # its end of each veth goes with it, and the pair too
        for name in _link_names():
            if name.startswith(self.prefix + "h") or name.startswith(self.prefix + "n"):
                _run("ip", "link", "del", name, check=False)
        _run("ip", "link", "del", self.bridge, check=False)
        self.hosts = []
        left = [n for n in _link_names() if n.startswith(self.prefix)] + [
            line
            for line in _run("ip", "netns", "list", check=False).splitlines()
            if line.startswith(f"{self.netns_prefix}-")
        ]
        if left:
            raise RuntimeError(f"fleet teardown left {left}")

    def leftovers(self) -> list[str]:
        """Namespaces and links of this fleet that exist now (empty after close())."""
        names = [n for n in _link_names() if n.startswith(self.prefix)]
        names += [
            line.split()[0]
            for line in _run("ip", "netns", "list", check=False).splitlines()
            if line.startswith(f"{self.netns_prefix}-")
        ]
        return names

    # -- link control ------------------------------------------------------

    def link_down(self, index: int) -> None:
        """The host's link goes down: its packets are dropped (nothing is refused)."""
        _run("ip", "link", "set", self.hosts[index].veth, "down")

    def link_up(self, index: int) -> None:
        _run("ip", "link", "set", self.hosts[index].veth, "up")

    def has_netem(self) -> bool:
        """Whether the kernel has the netem qdisc (probed once, on the first host's link)."""
        if self._netem is None:
            veth = self.hosts[0].veth
            done = subprocess.run(
                ["tc", "qdisc", "add", "dev", veth, "root", "netem", "delay", "1ms"],
                capture_output=True,
                check=False,
            )
            self._netem = done.returncode == 0
            if self._netem:
                _run("tc", "qdisc", "del", "dev", veth, "root", check=False)
        return self._netem

    def impair(
        self,
        index: int,
        *,
        loss_percent: float = 0.0,
        delay_ms: float = 0.0,
        rate_kbit: int | None = None,
    ) -> str:
        """Loss, delay and/or a rate limit on both directions of the host's link; how (for logs)."""
        host = self.hosts[index]
        self.clear(index)
        ends = [("", host.veth), (host.netns, host.peer)]
        if self.has_netem() and (loss_percent or delay_ms):
            netem = ["netem"]
            if delay_ms:
                netem += ["delay", f"{delay_ms}ms"]
            if loss_percent:
                netem += ["loss", f"{loss_percent}%"]
            if rate_kbit:
                netem += ["rate", f"{rate_kbit}kbit"]
            for netns, dev in ends:
                self._tc(netns, "qdisc", "replace", "dev", dev, "root", *netem)
            host.impaired.append("netem")
            return " ".join(netem)
        if delay_ms:
            raise NetemMissing("this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM): no delay")
        how = []
        if loss_percent:
            if shutil.which("nft") is None:
                raise RuntimeError("packet loss without netem needs nftables (nft)")
            share = max(1, round(loss_percent))
            rules = (
                "table inet abfault {\n"
                f"  chain in {{ type filter hook input priority 0; numgen random mod 100 < {share} drop; }}\n"
                f"  chain out {{ type filter hook output priority 0; numgen random mod 100 < {share} drop; }}\n"
                "}\n"
            )
            _run("ip", "netns", "exec", host.netns, "nft", "-f", "-", stdin=rules)
            host.impaired.append("nft")
            how.append(f"nft loss {share}%")
        if rate_kbit:
            for netns, dev in ends:
                self._tc(
                    netns, "qdisc", "replace", "dev", dev, "root", "tbf",
                    "rate", f"{rate_kbit}kbit", "burst", "16kb", "latency", "2s",
                )  # fmt: skip
            host.impaired.append("tbf")
            how.append(f"tbf rate {rate_kbit}kbit")
        return ", ".join(how)

    def clear(self, index: int) -> None:
        """Remove every impairment of the host's link."""
        host = self.hosts[index]
        if "nft" in host.impaired:
            _run(
                "ip",
                "netns",
                "exec",
                host.netns,
                "nft",
                "delete",
                "table",
                "inet",
                "abfault",
                check=False,
            )
        if "netem" in host.impaired or "tbf" in host.impaired:
            self._tc("", "qdisc", "del", "dev", host.veth, "root", check=False)
            self._tc(host.netns, "qdisc", "del", "dev", host.peer, "root", check=False)
        host.impaired.clear()

    # -- helpers -----------------------------------------------------------

    @staticmethod
    def _tc(netns: str, *argv: str, check: bool = True) -> None:
        prefix = ("ip", "netns", "exec", netns) if netns else ()
        _run(*prefix, "tc", *argv, check=check)

    @staticmethod
    def _mac(dev: str, *, netns: str | None = None) -> str:
        prefix = ("-n", netns) if netns else ()
        out = _run("ip", *prefix, "-o", "link", "show", dev)
        return out.split("link/ether", 1)[1].split()[0]

    def __repr__(self) -> str:
        return f"<Fleet {self.prefix} {self.subnet} {len(self.hosts)} hosts>"
