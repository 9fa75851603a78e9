"""The ``namespaces`` tier on SSH hosts: what it guarantees, and what a host lacks for it.

Under ``isolation = "namespaces"`` each call runs inside a bubblewrap sandbox of its own, built
on the host by the login user (:func:`agent_backend.sandbox.bwrap.remote_sandbox_argv`; the line
is :func:`.remote.sandboxed_command_line`). Before a host runs anything of such a pool, one
sandbox runs ``true`` there (:meth:`.host.SSHHost` checks once, single-flight); if it fails,
:data:`DIAGNOSE` reads what the host has (``bwrap`` on the login PATH, the user-namespace
sysctls) and :func:`missing_on_host` turns it into what it lacks, with how to get it: the host
is refused with :class:`~agent_backend.errors.SandboxUnavailable`, never used unconfined.

This module only builds text: it must never run anything.
"""

from __future__ import annotations

from agent_backend.errors import clip
from agent_backend.sandbox import Guarantees, Isolation, SandboxLimits

__all__ = ["DIAGNOSE", "missing_on_host", "ssh_guarantees"]

# $1: the bubblewrap program. One "name value" line each ("-": absent or unreadable).
DIAGNOSE = (
    'b=$(command -v "$1" 2>/dev/null) || b=-; echo "bwrap $b"; '
    "for f in /proc/sys/user/max_user_namespaces /proc/sys/kernel/unprivileged_userns_clone"
    " /proc/sys/kernel/apparmor_restrict_unprivileged_userns; do"
    ' v=$(cat "$f" 2>/dev/null) || v=-; echo "$f ${v:--}"; done'
)

# (sysctl file, the value that forbids user namespaces to users, what to do)
_USERNS_SWITCHES = (
    (
        "/proc/sys/user/max_user_namespaces",
        "0",
        "user namespaces: sysctl -w user.max_user_namespaces=65536",
    ),
    (
        "/proc/sys/kernel/unprivileged_userns_clone",
        "0",
        "user namespaces for users: sysctl -w kernel.unprivileged_userns_clone=1",
    ),
    (
        "/proc/sys/kernel/apparmor_restrict_unprivileged_userns",
        "1",
        "user namespaces under AppArmor: sysctl -w kernel.apparmor_restrict_unprivileged_userns=0"
        " (or an AppArmor profile for bwrap)",
    ),
)


def missing_on_host(diagnosis: str, trial_error: str, *, bwrap: str = "bwrap") -> list[str]:
    """What a host lacks for the tier, each with how to get it, from :data:`DIAGNOSE`'s output
    and the failed trial sandbox's stderr; never empty (the trial failed)."""
    facts = dict(line.partition(" ")[::2] for line in diagnosis.splitlines() if " " in line)
    if facts.get("bwrap", "-") == "-":
        return [
            f"{bwrap!r} (bubblewrap) on the login PATH: apt-get install bubblewrap "
            "(dnf install bubblewrap)"
        ]
    missing = [hint for path, bad, hint in _USERNS_SWITCHES if facts.get(path) == bad]
    if not missing:
        said = clip(" ".join(trial_error.split()), 300) or "no message"
        missing.append(
            f"a sandbox bubblewrap can build as the login user (it said: {said}): bubblewrap "
            "0.2 or later, and user namespaces allowed to users"
        )
    return missing


def ssh_guarantees(isolation: Isolation, limits: SandboxLimits) -> Guarantees:
    """The guarantees of an SSH pool at ``isolation`` with ``limits`` (the local tier's words
    where they hold; an SSH host has no per-session cgroups)."""
    if isolation == "none":
        return Guarantees(
            isolation="none",
            filesystem="none: the whole host as the login user sees it",
            processes="each call's processes carry its token and are ended with it; a process "
            "that drops the token from its environment can escape",
            network="host: every address the login user can reach",
            uid="none (the login user, its namespaces and limits: pool isolation = 'none')",
            limits={},
            disk="no quota (the workspace root's filesystem)",
        )
    return Guarantees(
        isolation="namespaces",
        filesystem="own mount namespace per call: the host's system directories read-only, the "
        "session workspace the only writable host directory, a private /tmp per call",
        processes="own PID namespace per call: what a call starts dies when it ends",
        network="own network namespace per call: loopback only, no egress",
        uid="the login user in a user namespace of its own, no capabilities, no_new_privs",
        limits={
            "open files": f"{limits.open_files} per process (RLIMIT_NOFILE)",
            "file size": f"{limits.file_size_mb} MiB per file (RLIMIT_FSIZE)",
            "memory, tasks, cpu, tmp": "none per session (an SSH host has no per-session "
            "cgroups; the private /tmp is memory)",
        },
        disk="no quota (the workspace root's filesystem)",
    )
