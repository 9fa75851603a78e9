"""schemas/wire/daemon-openapi.json is the daemon's OpenAPI document, kept in sync.

Regenerate after changing a route or a wire model:
``AGENT_BACKEND_WRITE_SCHEMAS=1 .venv/bin/python -m pytest tests/test_daemon_openapi_file.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from agent_backend.daemon import DaemonSettings, create_app
from agent_backend.dispatch import Dispatcher
from agent_backend.pool_file import DEFAULT_POOL, load_pool
from agent_backend.tools import ToolRegistry

FILE = Path(__file__).resolve().parents[1] / "schemas" / "wire" / "daemon-openapi.json"


def test_the_checked_in_openapi_document_is_current() -> None:
    dispatcher = Dispatcher(ToolRegistry(), load_pool(DEFAULT_POOL))  # never started: not needed
    app = create_app(dispatcher, DaemonSettings(tokens=("x" * 32,), mcp=False))
    text = json.dumps(app.openapi(), indent=2, sort_keys=True) + "\n"
    if os.environ.get("AGENT_BACKEND_WRITE_SCHEMAS") == "1":
        FILE.write_text(text, encoding="utf-8")
    assert FILE.read_text(encoding="utf-8") == text, (
        f"{FILE.name} is stale: AGENT_BACKEND_WRITE_SCHEMAS=1 pytest {Path(__file__).name}"
    )
