"""Shipping a pool's own code to the cluster: its local ``working_dir`` and ``py_modules``.

Ray takes local folders and files in a ``runtime_env`` only at the job level
(``ray.init``): per-actor options need URIs. :func:`ship_runtime_env` does for
a pool what ``ray.init`` does for a job: it zips each local ``working_dir``
folder and ``py_modules`` entry, uploads it to the cluster's package store
(the GCS, as ``gcs://_ray_pkg_<content hash>.zip``) unless a package of the
same content is there already, and returns the ``runtime_env`` with those
URIs, which every actor of the pool (replacements included) is given. Every
node downloads and unpacks a package once, when an actor there first needs it.

Ray has no public API for this: the upload is Ray's own code for
``ray.init`` (``ray._private.runtime_env``), whose rules (``.gitignore``,
``.rayignore``, ``excludes``, the size limit) therefore apply unchanged. It
works through Ray Client too (Ray forwards the store's calls to the cluster).

Blocking (hashes, zips, uploads): call it in a worker thread, once connected.
This module must never change the config it is given, never upload a remote
URI, and never let a Ray exception reach its caller (a failed upload is a
:class:`~agent_backend.errors.ConfigError` naming the key).
"""

from __future__ import annotations

import contextlib
import copy
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final

from agent_backend.errors import ConfigError, clip

__all__ = ["SHIPPED_KEYS", "is_local", "ship_runtime_env"]

#: The ``runtime_env`` keys whose local paths are uploaded.
SHIPPED_KEYS: Final = ("working_dir", "py_modules")

#: Set to 1, Ray packs files that ``.gitignore`` names too (Ray's own switch).
_IGNORE_GITIGNORE: Final = "RAY_RUNTIME_ENV_IGNORE_GITIGNORE"
#: Seconds Ray keeps a new package referenced after an upload (600 by default; 0: none).
_PIN_SECONDS: Final = "RAY_RUNTIME_ENV_TEMPORARY_REFERENCE_EXPIRATION_S"


def is_local(value: object) -> bool:
    """True for a local path (to upload), False for a URI (``gcs://``, ``s3://``...)."""
    return isinstance(value, str) and "://" not in value


def _needs_upload(runtime_env: Mapping[str, Any]) -> bool:
    modules = runtime_env.get("py_modules") or ()
    return is_local(runtime_env.get("working_dir")) or any(is_local(entry) for entry in modules)


def ship_runtime_env(runtime_env: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``runtime_env`` for actors: its local ``working_dir`` and ``py_modules`` uploaded.

    Returns a copy (None stays None), with each local path replaced by the
    URI of its package in the cluster and ``excludes`` dropped (it only
    says what to leave out of an upload). A package whose content is in the
    cluster already is not sent again. Blocking; needs this process to be
    connected to Ray. A path that cannot be packed or uploaded is a
    :class:`ConfigError` (``key="runtime_env.working_dir"`` or
    ``"runtime_env.py_modules"``).
    """
    if runtime_env is None:
        return None
    shipped = copy.deepcopy(dict(runtime_env))
    if _needs_upload(shipped):
        shipped = _upload(shipped, original=runtime_env)
    shipped.pop("excludes", None)
    return shipped


def _upload(shipped: dict[str, Any], *, original: Mapping[str, Any]) -> dict[str, Any]:
    from ray._private.runtime_env.py_modules import upload_py_modules_if_needed
    from ray._private.runtime_env.working_dir import upload_working_dir_if_needed

    include_gitignore = os.environ.get(_IGNORE_GITIGNORE, "0") != "1"
    with _no_pin_over_ray_client(), tempfile.TemporaryDirectory(prefix="agent-backend-") as scratch:
        shipped = _zips_first(shipped)
        steps: tuple[tuple[str, Callable[..., dict[str, Any]]], ...] = (
            ("py_modules", upload_py_modules_if_needed),
            ("working_dir", upload_working_dir_if_needed),
        )
        for key, upload in steps:
            if shipped.get(key) is None:
                continue
            try:
                shipped = upload(shipped, include_gitignore=include_gitignore, scratch_dir=scratch)
            except Exception as exc:
                raise _upload_error(key, original.get(key), exc) from None
    return shipped


@contextlib.contextmanager
def _no_pin_over_ray_client() -> Iterator[None]:
    """Through Ray Client, upload without the temporary reference Ray adds to a new package.

    Ray's upload pins each package for a while (so that it outlives a driver
    that dies before its job starts); through Ray Client that call never
    returns (Ray 2.60). Unpinned, a package stays in the store until the
    actors that use it are gone. Ray reads the pin's duration at each upload;
    0 skips it.
    """
    from ray.util.client import ray as client

    if not client.is_connected() or _PIN_SECONDS in os.environ:  # type: ignore[no-untyped-call]
        yield
        return
    os.environ[_PIN_SECONDS] = "0"
    try:
        yield
    finally:
        os.environ.pop(_PIN_SECONDS, None)


def _zips_first(runtime_env: dict[str, Any]) -> dict[str, Any]:
    """Upload local ``.zip`` entries of ``py_modules`` (Ray's ``ray.init`` packs only folders,
    ``.py`` files and wheels); each becomes the ``gcs://`` URI of its content."""
    modules = runtime_env.get("py_modules")
    if not modules:
        return runtime_env
    from ray._private.runtime_env.packaging import (
        get_uri_for_package,
        package_exists,
        upload_package_to_gcs,
    )

    entries: list[Any] = []
    for entry in modules:
        if is_local(entry) and Path(entry).suffix == ".zip":
            try:
                uri = get_uri_for_package(Path(entry))
                if not package_exists(uri):
                    upload_package_to_gcs(uri, Path(entry).read_bytes())
            except Exception as exc:
                raise _upload_error("py_modules", entry, exc) from None
            entries.append(uri)
        else:
            entries.append(entry)
    return {**runtime_env, "py_modules": entries}


def _upload_error(key: str, value: object, exc: BaseException) -> ConfigError:
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    reason = clip(f"{type(cause).__name__}: {cause}", 800)
    return ConfigError(
        f"runtime_env.{key}: {value!r} could not be uploaded to the Ray cluster: {reason}",
        key=f"runtime_env.{key}",
        expected="local folders and files that Ray can pack and upload (under its size limit)",
    )
