"""A local backend's workspace directories, made and removed by a few threads of their own.

Making and removing a directory tree are disk operations, so they do not run
on the event loop (on a slow or stalled disk a ``mkdir`` can take seconds, and
every other call on the loop would stall with it). But a thread hop per operation, from the shared worker-thread
pool, costs more than the operation when many sessions open and close at
once: at 64 concurrent episodes beside a vLLM server on two cores, up to 64
worker threads fought the event loop for the GIL, and making a workspace took
165 ms, removing one 258 ms, on average (``bench/rollout_vllm_bench.py``).
So a :class:`WorkspaceKeeper` has :data:`THREADS` threads that take the jobs
from one queue, and keeps **spares** made ahead:

* a spare is an empty directory with a spare's name
  (``agent-backend-spare-<token>-*``): nothing mistakes it for a session's
  workspace, or for one left behind;
* :meth:`WorkspaceKeeper.take` renames a spare to its workspace name, on the
  caller's thread: one ``rename`` in the same directory, the one disk
  operation left on the event loop, and no thread hop; with no spare left, the
  caller waits for a thread to make one;
* the threads top the spares back up when they have nothing else to do, to
  the most workspaces ever in use at once (at most ``max_spares``): a
  rollout's next step finds as many ready as its last one used;
* :meth:`WorkspaceKeeper.remove` renames the workspace to a trash name
  (``agent-backend-trash-<token>-*``), on the caller's thread, and returns: the
  workspace is gone under its name at once, and the threads remove the tree
  afterwards, with no trip back to the event loop. Waiting for the removal
  held each episode of a rollout for two thread hops: beside a busy vLLM server
  on two cores, 84 ms of its time per turn at 16 concurrent episodes, 158 ms at
  64 (``bench/rollout_vllm_bench.py``), more than its tool calls took. A
  removal that fails later is logged (a session's close logs its failures and
  never raises them either) and handed back by :meth:`WorkspaceKeeper.aclose`,
  which waits for the trash: the backend tries it again there, and what is
  still left goes to the next backend to start in the root, as a dead
  owner's. Without a ``discard`` function, or when the rename fails,
  ``remove`` waits until the tree is gone and raises its error.

The jobs go in order: callers waiting for a workspace, removals a caller waits
for, spares, then trash: a rollout's next episodes find their spares made
before the last ones' trees are gone. Spares and trash left by a process that
died are removed, with its workspaces, by the next backend to start in the root
(:mod:`~agent_backend.backends.local.owner`).

asyncio only: the threads hand results back with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import anyio.to_thread

from agent_backend.errors import PoolClosed

__all__ = ["THREADS", "WorkspaceKeeper"]

logger = logging.getLogger("agent_backend.backends.local")

THREADS = 4
"""Enough for a slow disk to serve several sessions at once; few enough not to fight the loop."""


class WorkspaceKeeper:
    """Spare workspaces, waiting callers and pending removals; its threads serve them."""

    def __init__(
        self,
        make: Callable[[], str],
        activate: Callable[[str], str],
        remove: Callable[[str], None],
        *,
        max_spares: int,
        loop: asyncio.AbstractEventLoop,
        discard: Callable[[str], str] | None = None,
        respare: Callable[[str], str] | None = None,
    ) -> None:
        """``make`` makes a spare; ``activate`` renames one to its workspace name, and returns it;
        ``discard`` renames a workspace to a trash name, and returns it; ``respare`` renames a
        workspace made new to a spare's name, and returns it; ``remove`` removes a tree.
        """
        self._make = make
        self._activate = activate
        self._remove = remove
        self._discard = discard
        self._respare = respare
        self._max_spares = max_spares
        self._loop = loop
        self._lock = threading.Condition()
        self._spares: collections.deque[str] = collections.deque()
        # Workspaces given back made new (a sandbox reset), spares again: taken first; before
        # that, being made new, then checked empty by a thread.
        self._recycled: collections.deque[str] = collections.deque()
        self._resetting: set[str] = set()
        self._checks: collections.deque[str] = collections.deque()
        self._waiting: collections.deque[asyncio.Future[str]] = collections.deque()
        self._removals: collections.deque[tuple[str, asyncio.Future[None]]] = collections.deque()
        # Trees nobody waits for: trash, and workspaces whose caller gave up before they came.
        self._trash: collections.deque[str] = collections.deque()
        self._failed: list[str] = []  # trash the threads could not remove
        self._making = 0  # spares being made by a thread right now
        self._spares_failing = False  # the last spare could not be made (logged once)
        self._in_use = 0
        self._target = 0  # spares to keep: the most in use at once, at most max_spares
        self._closing = False
        self._ended = False
        self._threads = [
            threading.Thread(target=self._serve, name=f"agent-backend-workspaces-{i}", daemon=True)
            for i in range(THREADS)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def spares(self) -> int:
        """Workspaces made ahead, ready to be taken."""
        with self._lock:
            return len(self._spares)

    def spare_paths(self) -> frozenset[str]:
        """The spares' paths (empty directories with a spare's name) and the recycled ones'."""
        with self._lock:
            return frozenset((*self._spares, *self._recycled))

    @property
    def waiting(self) -> int:
        """Callers waiting for a thread to make their workspace."""
        with self._lock:
            return len(self._waiting)

    @property
    def running(self) -> bool:
        """Whether any of its threads is still running (until :meth:`aclose` ends them)."""
        return any(thread.is_alive() for thread in self._threads)

    # -- the event loop's side ----------------------------------------------------------------------

    async def take(self) -> str:
        """A new, empty workspace: a spare, or one a thread makes now. Raises its ``OSError``."""
        with self._lock:
            if self._closing:
                raise PoolClosed("the local backend is closed")
            self._in_use += 1
            self._target = min(self._max_spares, max(self._target, self._in_use))
            if self._recycled:  # nothing to make up for
                spare: str | None = self._recycled.popleft()
            else:
                spare = self._spares.popleft() if self._spares else None
                self._lock.notify()  # to make up for it, or to make this one
            if spare is None:
                future: asyncio.Future[str] = self._loop.create_future()
                self._waiting.append(future)
        try:
            if spare is not None:
                try:
                    return self._activate(spare)
                except OSError as exc:  # gone (removed from outside?): a thread makes one
                    logger.warning("spare workspace %s unusable (%s): making one", spare, exc)
                    future = self._loop.create_future()
                    with self._lock:
                        self._waiting.append(future)
                        self._lock.notify()
            return await future
        except BaseException:
            with self._lock:
                self._in_use -= 1
            raise

    def recycle(self, path: str) -> str | None:
        """Take back the workspace ``path``, to be made new by its caller, as a spare for a
        later :meth:`take`: renamed to a spare's name now (the new name, or None when enough
        are kept already or the rename failed: the caller removes it as usual). The caller
        then calls :meth:`made_new` with the outcome."""
        with self._lock:
            returning = len(self._recycled) + len(self._resetting) + len(self._checks)
            if self._respare is None or returning >= self._max_spares:
                return None
        try:
            spare = self._respare(path)
        except OSError as exc:
            logger.debug("workspace %s not renamed to a spare (%s): removed", path, exc)
            return None
        with self._lock:
            self._in_use -= 1
            self._resetting.add(spare)
        return spare

    def _kept(self) -> int:
        """Spares, and workspaces on their way back to being spares (under the lock)."""
        return len(self._spares) + len(self._recycled) + len(self._resetting) + len(self._checks)

    def made_new(self, spare: str, ok: bool) -> None:
        """On the event loop: the outcome of making ``spare`` (from :meth:`recycle`) new. A
        thread checks it is empty, then keeps it for the next :meth:`take`; otherwise (or not
        ``ok``) it is removed."""
        with self._lock:
            self._resetting.discard(spare)
            if ok:
                self._checks.append(spare)
            else:
                self._trash.append(spare)
            self._lock.notify()

    async def remove(self, path: str) -> None:
        """Remove the workspace ``path`` (taken from here): gone under its name on return.

        Renamed to trash and removed by the threads afterwards (module docstring); without
        ``discard``, or when its rename fails, this waits until the tree is gone and raises
        its error. Raises :class:`~agent_backend.errors.PoolClosed` once :meth:`aclose` has
        ended the threads.
        """
        if self._ended:
            raise PoolClosed("the local backend is closed")
        if self._discard is not None:
            try:
                trash = self._discard(path)
            except OSError as exc:
                logger.debug("workspace %s not renamed to trash (%s): removed in place", path, exc)
            else:
                with self._lock:
                    self._in_use -= 1
                    self._trash.append(trash)
                    self._lock.notify()
                return
        future: asyncio.Future[None] = self._loop.create_future()
        with self._lock:
            self._in_use -= 1
            self._removals.append((path, future))
            self._lock.notify()
        await future

    def _hand_over(
        self, future: asyncio.Future[str], path: str | None, error: BaseException | None
    ) -> None:
        """In the loop: give a made workspace (or the error) to a waiting caller."""
        if future.cancelled():  # the caller gave up: removed in the background
            if path is not None:
                with self._lock:
                    self._trash.append(path)
                    self._lock.notify()
            return
        if path is not None:
            future.set_result(path)
        else:
            assert error is not None
            future.set_exception(error)

    @staticmethod
    def _finish(future: asyncio.Future[None], error: BaseException | None) -> None:
        if future.cancelled():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    # -- the threads' side --------------------------------------------------------------------------

    def _serve(self) -> None:
        while True:
            with self._lock:
                while True:
                    if self._checks:  # cheap, and what it yields is ready at once
                        job: Any = ("check", self._checks.popleft())
                        break
                    if self._waiting:
                        job = ("make", self._waiting.popleft())
                        break
                    if self._removals:
                        job = ("remove", self._removals.popleft())
                        break
                    kept = self._kept() + self._making
                    if not self._closing and kept < self._target:
                        self._making += 1
                        job = ("spare", None)
                        break
                    if self._trash:
                        job = ("trash", self._trash.popleft())
                        break
                    if self._closing:
                        return
                    self._lock.wait()
            kind, item = job
            if kind == "check":  # made new by its sandbox's agent: seen empty from here too
                try:
                    empty = not os.listdir(item)
                except OSError:
                    empty = False
                waiter = None
                with self._lock:
                    if not empty or self._closing:
                        self._trash.append(item)
                    elif self._waiting:  # a caller waits for a workspace to be made: this one
                        waiter = self._waiting.popleft()
                    else:
                        self._recycled.append(item)
                if waiter is not None:
                    try:
                        path = self._activate(item)
                    except Exception as exc:
                        self._loop.call_soon_threadsafe(self._hand_over, waiter, None, exc)
                    else:
                        self._loop.call_soon_threadsafe(self._hand_over, waiter, path, None)
                continue
            # Exception, not OSError only: whatever fails goes to the caller (or the log);
            # a thread that died would leave its callers waiting forever.
            if kind == "remove":
                path, done = item
                try:
                    self._remove(path)
                except Exception as exc:
                    self._loop.call_soon_threadsafe(self._finish, done, exc)
                else:
                    self._loop.call_soon_threadsafe(self._finish, done, None)
                continue
            if kind == "trash":  # nobody waits: a failure is logged here, no trip to the loop
                try:
                    self._remove(item)
                except Exception as exc:
                    logger.warning("could not remove workspace %s: %s", item, exc)
                    with self._lock:
                        self._failed.append(item)  # tried again by aclose's caller
                continue
            try:
                path = self._make()
                if kind == "make":  # for a caller waiting now
                    path = self._activate(path)
            except Exception as exc:
                if kind == "make":
                    self._loop.call_soon_threadsafe(self._hand_over, item, None, exc)
                else:
                    with self._lock:
                        self._making -= 1
                        self._target = 0  # no more spares until the disk takes them again
                        first, self._spares_failing = not self._spares_failing, True
                    if first:  # once per streak: each later take tries again, quietly
                        logger.warning("could not make a spare workspace: %s", exc)
                continue
            if kind == "make":
                self._loop.call_soon_threadsafe(self._hand_over, item, path, None)
            else:
                with self._lock:
                    self._making -= 1
                    self._spares.append(path)
                    self._spares_failing = False

    async def aclose(self) -> list[str]:
        """Stop the threads (after the pending removals); return the directories left to remove:
        the spares, and the trash the threads could not remove.

        Idempotent. Callers still waiting are refused. Shield it: it waits for the threads.
        """
        with self._lock:
            self._closing = True
            waiting = list(self._waiting)
            self._waiting.clear()
            self._lock.notify_all()
        for future in waiting:
            if not future.done():
                future.set_exception(PoolClosed("the local backend is closed"))
        for thread in self._threads:
            await anyio.to_thread.run_sync(thread.join)
        # What the threads handed over before they ended has run by now (call_soon_threadsafe
        # is first in, first out); a workspace whose caller gave up was queued for removal
        # then, after the threads ended: it is returned with the spares.
        self._ended = True
        with self._lock:
            left = [
                *self._spares,
                *self._recycled,
                *self._resetting,
                *self._checks,
                *(path for path, _ in self._removals),
                *self._trash,
                *self._failed,
            ]
            self._spares.clear()
            self._recycled.clear()
            self._resetting.clear()
            self._checks.clear()
            self._removals.clear()
            self._trash.clear()
            self._failed.clear()
        return left
