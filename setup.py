"""The two parts of the build pyproject.toml cannot declare.

* The optional C accelerator: ``agent_backend.schema._plain`` speeds up the hot
  path of ``prepare_arguments`` on dict arguments and the common repair nodes
  (``_repair.c``, docs/validator.md). Without
  a C compiler the install still succeeds and ``agent_backend/schema/plain.py``
  uses its pure-Python equivalent (``make test`` under ``CI=true`` insists on
  the compiled one).
* The data files the package needs at run time (the built-in tool schemas, the
  pool files): their sources stay at the repository's top level, and a wheel
  carries copies inside the package, under ``agent_backend/_data/``. What is
  copied is ``SHIPPED`` in ``agent_backend/resources.py``, which also says
  where the package looks for them.
"""

import importlib.util
import os
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def _resources():  # agent_backend/resources.py alone: the package's dependencies may be missing
    spec = importlib.util.spec_from_file_location(
        "_resources", HERE / "agent_backend" / "resources.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class build_py_with_data(build_py):
    """``build_py``, then the data files copied into the built package's ``_data``.

    An editable install needs no copies: the package reads the sources.
    """

    def run(self):
        super().run()
        if not self.editable_mode:
            for source, target in self._data_files():
                self.mkpath(os.path.dirname(target))
                self.copy_file(source, target, preserve_mode=False)

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [target for _, target in self._data_files()]

    def _data_files(self):
        data = os.path.join(self.build_lib, "agent_backend", "_data")
        files = []
        for folder, pattern in _resources().SHIPPED:
            found = sorted(path for path in (HERE / folder).glob(pattern) if path.is_file())
            if not found:
                raise SystemExit(
                    f"{folder}/{pattern}: no files to ship (an incomplete source tree?)"
                )
            for path in found:
                files.append((str(path), os.path.join(data, folder, path.name)))
        return files


setup(
    cmdclass={"build_py": build_py_with_data},
    ext_modules=[
        Extension(
            "agent_backend.schema._plain",
            sources=[
                "agent_backend/schema/_plain.c",
                "agent_backend/schema/_repair.c",
                "agent_backend/schema/_quick.c",
            ],
            optional=True,
        )
    ],
)
