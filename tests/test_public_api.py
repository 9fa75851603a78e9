"""The public surface: __all__ matches what is exported, every error pickles with its fields."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import pickle
import pkgutil

import pytest

import agent_backend
from agent_backend import errors


def test_all_lists_exactly_the_public_names() -> None:
    public = {name for name in dir(agent_backend) if not name.startswith("_")}
    public -= {m.name for m in pkgutil.iter_modules(agent_backend.__path__)}  # submodules
    assert set(agent_backend.__all__) - {"__version__"} == public
    for name in agent_backend.__all__:
        assert hasattr(agent_backend, name), name


#: Integration modules that import their framework, and the framework's top-level package.
FRAMEWORKS = {
    "agent_backend.integrations.verl": "verl",
    "agent_backend.integrations.skyrl": "skyrl",
    "agent_backend.integrations.pydantic_ai": "pydantic_ai",
    "agent_backend.integrations.openai_agents": "agents",
    "agent_backend.integrations.langchain": "langchain_core",
}


def test_every_subpackage_all_is_importable() -> None:
    for info in pkgutil.walk_packages(agent_backend.__path__, "agent_backend."):
        framework = FRAMEWORKS.get(info.name)
        if framework is not None and importlib.util.find_spec(framework) is None:
            # A user without that trainer; make test installs them all (and CI must have them).
            assert os.environ.get("CI") != "true", f"{framework} is not installed"
            continue
        module = importlib.import_module(info.name)
        for name in getattr(module, "__all__", ()):
            assert hasattr(module, name), f"{info.name}.{name}"


ERROR_SAMPLES = [
    errors.AgentBackendError("root"),
    errors.ToolArgumentError(
        "bad", issues=[errors.ArgumentIssue("/a", "expected integer", "integer", '"x"')], tool="t"
    ),
    errors.UnknownToolError("nope", available=["a", "b"]),
    errors.PathOutsideWorkspace("../etc/passwd"),
    errors.SchemaError("broken", source="f.json", pointer="/properties/a"),
    errors.SchemaRefError("cycle", ref="#/$defs/A", cycle=["#/$defs/A", "#/$defs/B"], source="s"),
    errors.ConfigError("bad key", file="pools/x.toml", key="hosts.0.port", expected="an integer"),
    errors.LeaseError("stale token"),
    errors.PoolClosed("closed"),
    errors.PoolBusy("this session already has 1024 calls in flight", limit=1024, retry_after=1.0),
    errors.BackendUnavailable("down", backend="ssh", host="h:22"),
    errors.SandboxUnavailable("no walls", missing=["bubblewrap (apt-get install bubblewrap)"]),
    errors.WorkerLost("lost", worker="conn-1", cause="EOF", backend="ssh", host="h:22"),
    errors.ToolTimeout("slow", timeout=1.5, backend="local", host="local"),
    errors.ResourceUnavailable(
        "no actor has a GPU", needed={"GPU": 1.0}, available={"CPU": 2.0}, backend="ray"
    ),
    errors.PayloadLost("released", payload="00ff", cause="released", backend="ray"),
    errors.ToolFailed(
        "503, message='Service Unavailable'",
        tool="score",
        error_type="aiohttp.client_exceptions.ClientResponseError",
        status=503,
        traceback="Traceback (most recent call last): ...",
    ),
    errors.PolicyError("no logprobs", status=200, url="http://127.0.0.1:1/v1", retryable=False),
    errors.NonFiniteLogprobs("nan at 3", positions=[3, 7]),
    errors.LedgerError("torn checkpoint", path="ledger.json"),
    errors.DaemonError("HTTP 418 without an error body", status=418),
    errors.Unauthorized("missing or wrong bearer token"),
    errors.NotFound("no route /v2/call"),
    errors.MethodNotAllowed("PUT is not allowed on /v1/call", status=405),
    errors.IdempotencyConflict("key reused for another request", key="job-42-call-7"),
    errors.RequestTooLarge("arguments over the limit", limit=262144, what="arguments"),
    errors.InvalidRequest(
        "body.name: Field required", issues=[{"loc": ["body", "name"], "msg": "Field required"}]
    ),
    errors.RateLimited("128 requests in flight", retry_after=2.0, limit=128),
    errors.TooManySessions("64 sessions open", limit=64, retry_after=2.0),
    errors.ServiceUnavailable("the daemon is shutting down"),
]


def test_every_error_class_has_a_sample() -> None:
    classes = {
        cls
        for _, cls in inspect.getmembers(errors, inspect.isclass)
        if issubclass(cls, errors.AgentBackendError)
    }
    sampled = {type(e) for e in ERROR_SAMPLES}
    assert classes - sampled == {
        errors.ModelFacingError,
        errors.BackendError,
        errors.PoolError,
        errors.RolloutError,
    }


@pytest.mark.parametrize("error", ERROR_SAMPLES, ids=lambda e: type(e).__name__)
def test_errors_pickle_with_their_fields(error: errors.AgentBackendError) -> None:
    clone = pickle.loads(pickle.dumps(error))
    assert type(clone) is type(error)
    assert clone.__dict__ == error.__dict__
    assert str(clone) == str(error)
    assert clone.args == error.args


def test_timeout_is_also_a_builtin_timeout() -> None:
    assert isinstance(errors.ToolTimeout("x"), TimeoutError)
    with pytest.raises(TimeoutError):
        raise errors.ToolTimeout("x", timeout=1.0)
