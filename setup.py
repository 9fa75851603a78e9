"""The one part of the build pyproject.toml cannot declare: the optional C accelerator.

``agent_backend.schema._plain`` speeds up the hot path of ``prepare_arguments`` on
dict arguments (docs/validator.md). It is optional: without a C compiler the
install still succeeds and ``agent_backend/schema/plain.py`` uses its pure-Python
equivalent (``make test`` under ``CI=true`` insists on the compiled one).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "agent_backend.schema._plain",
            sources=["agent_backend/schema/_plain.c"],
            optional=True,
        )
    ]
)
