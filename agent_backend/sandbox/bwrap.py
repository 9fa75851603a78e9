"""The command line that starts a sandbox around a program: a shell that lowers the limits and
its OOM standing, ``setpriv`` that becomes the sandbox's own uid, and bubblewrap.

The outer process (the one the backend spawns and signals as a group) runs
``sh -c PRELUDE``: it sets ``oom_score_adj`` to 1000 (the OOM killer takes a
tool before anything else) and the hard and soft rlimits (descriptors, file
size, no core files), which nothing in the sandbox can raise (raising a hard
limit needs ``CAP_SYS_RESOURCE`` in the host's user namespace); then
``setpriv`` drops every group, takes the sandbox's uid and gid and sets
``no_new_privs``; then bubblewrap, running as that unprivileged uid, makes
new user, mount, PID, IPC, UTS, network and cgroup namespaces. Inside: the
host's system directories read-only, the workspace read-write at its own
path, a private size-capped ``/tmp``, a fresh ``/proc`` and a minimal
``/dev``, loopback only, no capabilities, no further user namespaces. The
program is the namespace's init (``--as-pid-1``: the shell that runs the session's
agent, which the commands cannot signal): when it exits, or the outer process is
killed, the PID namespace ends and the kernel kills everything left in it
(daemonized, ``setsid``, double-forked included).
No ``--die-with-parent``: that signal follows the *thread* that started the
sandbox, and the owner's death reaches the agent anyway, as end of file on its
socket.

This module only builds argument lists: it must never run anything.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from agent_backend.sandbox.config import SandboxLimits

__all__ = ["INIT_PATH", "SYSTEM_PATHS", "sandbox_argv"]

#: Where a sandbox sees the executable of ``sandbox_argv(init_fd=...)``.
INIT_PATH = "/.sandbox-init"

#: Host directories every sandbox sees read-only (those that exist; symlinks are kept as links).
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt")

# $1: oom_score_adj; $2: RLIMIT_NOFILE; $3: RLIMIT_FSIZE in 512-byte blocks; then the command.
_PRELUDE = (
    'echo 1000 > /proc/self/oom_score_adj && ulimit -n "$1" && ulimit -c 0 && '
    'ulimit -f "$2" && shift 2 && exec "$@"'
)


def _system_binds(paths: Sequence[str]) -> list[str]:
    args: list[str] = []
    for path in paths:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


def sandbox_argv(
    argv: Sequence[str],
    *,
    uid: int,
    workspace: str,
    workspace_at: str | None = None,
    cwd: str,
    limits: SandboxLimits,
    read_only: Sequence[str] = (),
    hosts_fd: int | None = None,
    init_fd: int | None = None,
    bwrap: str = "bwrap",
    setpriv: str = "setpriv",
    shell: str = "/bin/sh",
) -> list[str]:
    """The argv that runs ``argv`` in ``cwd`` inside a new sandbox of ``uid`` around
    ``workspace``.

    ``workspace_at``: where the sandbox sees ``workspace`` (None: at its own path), for
    a directory that will be renamed there before anything runs in it (a spare).
    ``read_only``: more host paths to show read-only at their own paths (a
    virtual environment, a dataset). ``hosts_fd``: a descriptor the sandbox's ``/etc/hosts`` is
    read from (bubblewrap copies it; the process that runs the argv must inherit it).
    ``init_fd``: a descriptor holding an executable (the host's shell) that the sandbox sees
    at :data:`INIT_PATH`, executable but not readable (mode 0111, on a read-only mount): a
    process started from it is not dumpable, so the commands, though they share its uid,
    cannot ptrace it or reach its memory through ``/proc/<pid>/mem``.
    """
    hosts = ["--ro-bind-data", str(hosts_fd), "/etc/hosts"] if hosts_fd is not None else []
    init = ["--perms", "0111", "--ro-bind-data", str(init_fd), INIT_PATH]
    init = init if init_fd is not None else []
    return [
        shell,
        "-c",
        _PRELUDE,
        "sandbox",
        str(limits.open_files),
        str(limits.file_size_mb * 2048),
        setpriv,
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--no-new-privs",
        "--",
        bwrap,
        "--unshare-user",
        "--disable-userns",
        "--uid",
        str(uid),
        "--gid",
        str(uid),
        "--unshare-pid",
        "--as-pid-1",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-net",
        "--unshare-cgroup-try",
        "--new-session",
        "--hostname",
        "sandbox",
        *_system_binds(SYSTEM_PATHS),
        *hosts,  # over the host's /etc/hosts, bound with /etc just before
        *init,
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--size",
        str(limits.tmp_mb << 20),
        "--tmpfs",
        "/tmp",
        # After /tmp: a path under it (a test's directory) is bound over the private tmpfs.
        *[arg for path in read_only for arg in ("--ro-bind", path, path)],
        "--bind",
        workspace,
        workspace_at or workspace,
        "--chdir",
        cwd,
        "--cap-drop",
        "ALL",
        "--",
        *argv,
    ]
