"""Markers: ``gpu`` tests skip without a usable GPU, unless CUPY_XATTN_REQUIRE_GPU=1 makes that a failure."""
import functools
import os

import pytest


@functools.cache
def _gpu_missing():
    """Why GPU tests cannot run here, or None when they can."""
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed"
    return None if cupy.is_available() else "no CUDA GPU visible to CuPy"


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is None or (reason := _gpu_missing()) is None:
        return
    if os.environ.get("CUPY_XATTN_REQUIRE_GPU") == "1":
        pytest.fail(f"CUPY_XATTN_REQUIRE_GPU=1 but {reason}", pytrace=False)
    pytest.skip(reason)
