"""The compiled parts of expstore: the native gather and prompt scan
(expstore/gather_native.cpp), the check of trajectory rules (expstore/validate_native.cpp)
and the writer of chunk files' blocks (expstore/blocks_native.cpp), built against the
pyarrow of the build (pyproject's build requirements pin the same pyarrow major version as
the runtime's: the modules link to that version's libarrow). Optional: where they cannot
be built (no C++ compiler), the install goes on and gather.py, prefixes.py, schema.py and
codec.py do their work in Python. Everything else about the package is in pyproject.toml."""

import glob
import os

import pyarrow
import pybind11
from setuptools import Extension, setup


def _arrow_libraries() -> list[str]:
    """The full paths of pyarrow's libarrow and libarrow_python by their sonames: a wheel has
    no unversioned ``libarrow.so`` for ``-larrow`` to find."""
    libdir = pyarrow.get_library_dirs()[0]
    found = []
    for name in ("arrow", "arrow_python"):
        candidates = glob.glob(os.path.join(libdir, f"lib{name}.so.*"))
        if candidates:
            found.append(min(candidates, key=len))  # libarrow.so.2600, not libarrow.so.2600.1.0
    return found


def _native(name: str, source: str, optimize: str = "-O2") -> Extension:
    return Extension(
        name,
        sources=[source],
        include_dirs=[pyarrow.get_include(), pybind11.get_include()],
        extra_compile_args=["-std=c++20", optimize, "-fvisibility=hidden"],
        extra_link_args=_arrow_libraries(),
        language="c++",
        optional=True,
    )


setup(ext_modules=[
    _native("expstore._gather_native", "expstore/gather_native.cpp"),
    _native("expstore._blocks_native", "expstore/blocks_native.cpp"),
    _native("expstore._validate_native", "expstore/validate_native.cpp", "-O3"),  # its loops over tokens vectorise
])
