"""Backends: one module per kind of place a tool runs (``local``, ``ssh``), each a ``Backend``."""
