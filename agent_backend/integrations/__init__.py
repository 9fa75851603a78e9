"""Thin adapters from agent_backend's public API to trainers and agent frameworks.

One module per framework (:mod:`agent_backend.integrations.trl`, ...). Each
imports its framework lazily, if at all, and uses only the public API of
agent_backend; none holds logic of its own beyond the framework's shapes.
"""
