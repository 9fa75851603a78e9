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

:func:`remote_sandbox_argv` is the SSH pools' variant (:mod:`agent_backend.backends.ssh`): a
sandbox per call, built on the remote host by its login user with bubblewrap alone. The same
prelude shell lowers the limits and the OOM standing before ``exec bwrap``; bubblewrap makes
every namespace (user included: no capabilities, ``no_new_privs``), binds the system directories
read-only if the host has them (``--ro-bind-try``: this machine cannot look at the remote one),
the workspace read-write at its own path, a private ``/tmp``; the command's PID namespace ends
when it exits (bubblewrap's init is PID 1) or when bubblewrap is killed (``--die-with-parent``).

This module only builds argument lists: it must never run anything.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from agent_backend.sandbox.config import SandboxLimits

__all__ = ["INIT_PATH", "SYSTEM_PATHS", "remote_sandbox_argv", "sandbox_argv"]

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
        "--mqueue",  # where a reset can list (and remove) the session's message queues
        "/dev/mqueue",
        "--tmpfs",  # its own: /dev is made read-only below
        "/dev/shm",
        "--size",
        str(limits.tmp_mb << 20),
        "--tmpfs",
        "/tmp",
        # After /tmp: a path under it (a test's directory) is bound over the private tmpfs.
        *[arg for path in read_only for arg in ("--ro-bind", path, path)],
        "--bind",
        workspace,
        workspace_at or workspace,
        # Last: the sandbox's own root and /dev (tmpfs, its uid's) read-only, so that no
        # session can change what the next one finds there (its /bin link, /dev/null).
        "--remount-ro",
        "/dev",
        "--remount-ro",
        "/",
        "--chdir",
        cwd,
        "--cap-drop",
        "ALL",
        "--",
        *argv,
    ]


# $1: RLIMIT_NOFILE; $2: RLIMIT_FSIZE in 512-byte blocks; then bwrap and its arguments. `ulimit`
# without -H or -S sets the hard limit and the soft one (dash, bash, busybox): nothing inside can
# raise them. Raising one's own oom_score_adj needs no privilege; where /proc refuses it, the
# command runs at the host's.
_REMOTE_PRELUDE = (
    "{ echo 1000 > /proc/self/oom_score_adj; } 2>/dev/null; "
    'ulimit -n "$1" && ulimit -c 0 && ulimit -f "$2" && shift 2 && exec "$@"'
)

# Inside the sandbox: $1 the working directory, then the command. As a login shell runs a
# command: a missing directory or program is exit status 127 (126: not executable).
_REMOTE_START = 'cd -- "$1" || exit 127; shift; exec "$@"'

#: Where a remote sandbox's commands start when the call has no workspace (its private tmpfs).
REMOTE_SCRATCH = "/tmp"


def remote_sandbox_argv(
    argv: Sequence[str],
    *,
    workspace: str | None,
    cwd: str | None = None,
    limits: SandboxLimits,
    bwrap: str = "bwrap",
    shell: str = "/bin/sh",
) -> list[str]:
    """The argv that runs ``argv`` on a remote host inside a new sandbox around ``workspace``,
    as the login user; each word is to be quoted for the remote shell (never spliced).

    ``workspace``: the only writable host directory, bound at its own path (None: none, the
    command starts in the private ``/tmp``); ``cwd``: where ``argv`` starts (None: the
    workspace), entered by a shell inside, so that a missing one is exit status 127 as
    without walls. Of ``limits``, what a sandbox without cgroups enforces: ``open_files`` and
    ``file_size_mb`` (both hard limits); core files are off.
    """
    home = workspace or REMOTE_SCRATCH
    return [
        shell,
        "-c",
        _REMOTE_PRELUDE,
        "sandbox",
        str(limits.open_files),
        str(limits.file_size_mb * 2048),
        bwrap,
        "--unshare-all",  # user, mount, PID, IPC, UTS, network (loopback only), cgroup
        "--unshare-user",  # not "try": no sandbox rather than one without a user namespace
        "--die-with-parent",
        "--new-session",
        "--hostname",
        "sandbox",
        *[arg for path in SYSTEM_PATHS for arg in ("--ro-bind-try", path, path)],
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--tmpfs",  # no --size (bubblewrap 0.7+): it is memory, unlimited on SSH hosts anyway
        "/tmp",
        *(["--bind", workspace, workspace] if workspace is not None else []),
        "--chdir",
        home,
        "--cap-drop",
        "ALL",
        "--",
        shell,
        "-c",
        _REMOTE_START,
        "sandbox",
        cwd or home,
        *argv,
    ]
