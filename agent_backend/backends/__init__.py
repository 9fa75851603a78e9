"""Backends: the places a tool runs, each a :class:`~agent_backend.dispatch.Backend` of hosts.

* ``local`` (:mod:`agent_backend.backends.local`): subprocesses of this process, one process
  group per call, workspaces under a local root (``local_config``: its pool config;
  ``local_command``: one command from spawn to result; ``local_process``: the child and its
  pipes; ``local_spawn``: the spawner thread (``posix_spawn``); ``local_owner``: who owns a
  workspace; ``local_workspaces``: making, removing and spares; ``local_files``: file tools
  beneath a workspace's descriptor; ``local_sandbox``: a session's sandbox and its agent, under
  ``isolation = "namespaces"``).
* ``ssh`` (:mod:`agent_backend.backends.ssh`): pooled asyncssh connections to a fleet of hosts.
* ``ray`` (:mod:`agent_backend.backends.ray`): tools as Ray actors, GPUs included, results by
  reference; nodes as failure domains, placement, code shipped to the cluster.

Load one from a pool file with :func:`agent_backend.pool_file.load_pool`; each backend's module says
what it guarantees.
"""
