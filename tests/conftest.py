"""Markers: ``gpu`` tests skip without a usable GPU, unless CUPY_XATTN_REQUIRE_GPU=1 makes that a failure.
CUPY_XATTN_TEST_SHARD=k/n runs the k-th (from 0) of n contiguous slices of the selected tests."""
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


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected theirs
def pytest_collection_modifyitems(config, items):
    """Keep one shard of the selected tests (CUPY_XATTN_TEST_SHARD=k/n): scripts/h200_check.sh runs
    the GPU tests as parallel shards on one GPU, so that a fresh machine's kernel builds (NVRTC,
    one core each) share its cores. Contiguous slices: neighbouring tests mostly share builds."""
    shard = os.environ.get("CUPY_XATTN_TEST_SHARD")
    if not shard:
        return
    try:
        k, n = (int(part) for part in shard.split("/"))
        if not 0 <= k < n:
            raise ValueError
    except ValueError:
        raise pytest.UsageError(f"CUPY_XATTN_TEST_SHARD is k/n with 0 <= k < n, not {shard!r}") from None
    first, end = k * len(items) // n, (k + 1) * len(items) // n
    config.hook.pytest_deselected(items=items[:first] + items[end:])
    items[:] = items[first:end]
