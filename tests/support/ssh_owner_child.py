"""A daemon stand-in for tests/test_ssh_owners.py, run as ``python ssh_owner_child.py JSON``.

It opens an SSH backend on one host (JSON: ``SSHHostConfig`` keyword arguments, plus
``"sleep"``: a unique duration), makes a workspace holding ``left-behind.txt``, starts
``sleep <duration>`` in it, and prints ``READY <instance> <workspace>`` once that command's
channel is open; then waits to be killed (the test SIGKILLs it: nothing of it runs after).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

from agent_backend.backends.ssh import SSHBackend, SSHHostConfig, SSHPoolConfig
from agent_backend.dispatch.backend import Command


async def main(options: dict[str, Any]) -> None:
    duration = options.pop("sleep")
    config = SSHPoolConfig(hosts=(SSHHostConfig(**options),))
    async with SSHBackend.from_config(config) as backend:
        host = backend.hosts[0]
        workspace = await host.make_workspace()
        await host.write_file(workspace, "left-behind.txt", b"from a daemon that was killed\n")
        call = asyncio.create_task(
            host.run(Command(argv=("sleep", duration), cwd=workspace, timeout=600))
        )
        deadline = time.monotonic() + 60
        while host.statistics().channels_open < 1:  # the command's channel is open
            if call.done() or time.monotonic() > deadline:
                raise SystemExit(f"the command did not start: {call}")
            await asyncio.sleep(0.01)
        print(f"READY {host.instance} {workspace}", flush=True)
        await call  # never returns: SIGKILLed first


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
