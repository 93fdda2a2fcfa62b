"""Fixtures of the engine's unit tests."""

import pytest

from expstore import gather


@pytest.fixture(params=["native", "python"])
def gathers(request, monkeypatch):
    """Runs a test of row gathering over both gathers: the native one (gather_native.cpp)
    and the Python one it replaces where it is not built."""
    if request.param == "python":
        monkeypatch.setattr(gather, "native", None)
    return request.param
