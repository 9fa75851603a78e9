"""Backends: the places a tool runs, each a :class:`~agent_backend.dispatch.Backend` of hosts.

* ``local`` (:mod:`agent_backend.backends.local`): subprocesses of this process, one process
  group per call, workspaces under a local root, a sandbox per session under
  ``isolation = "namespaces"``.
* ``ssh`` (:mod:`agent_backend.backends.ssh`): pooled asyncssh connections to a fleet of hosts.
* ``ray`` (:mod:`agent_backend.backends.ray`): tools as Ray actors, GPUs included, results by
  reference; nodes as failure domains, placement, code shipped to the cluster.

Load one from a pool file with :func:`agent_backend.pool_file.load_pool`; each backend's module says
what it guarantees.
"""
