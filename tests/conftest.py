"""Markers: ``gpu`` tests skip without a usable GPU, unless CUPY_XATTN_REQUIRE_GPU=1 makes that a failure.
CUPY_XATTN_TEST_SHARD=k/n runs the k-th (from 0) of n shards of the selected tests.
CUPY_XATTN_TEST_DEADLINE=<Unix time in seconds> stops the run after the test that passes it."""
import functools
import os
import time

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


SHARD_BLOCKS = 4  # blocks of the selected tests per shard (pytest_collection_modifyitems)


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected theirs
def pytest_collection_modifyitems(config, items):
    """Keep one shard of the selected tests (CUPY_XATTN_TEST_SHARD=k/n): scripts/h200_check.sh runs
    the GPU tests as parallel shards on one GPU, so that a fresh machine's kernel builds (NVRTC,
    one core each) share its cores. The tests, in order, are cut into SHARD_BLOCKS · n contiguous
    blocks, and shard k takes blocks k, k + n, ...: within a block neighbouring tests mostly share
    builds (each built in one shard), and each shard takes a part of every region of the suite, where
    one slice each left the slowest at 533 s and the fastest at 107 (Session 38: the heavy cases sit
    together)."""
    shard = os.environ.get("CUPY_XATTN_TEST_SHARD")
    if not shard:
        return
    try:
        k, n = (int(part) for part in shard.split("/"))
        if not 0 <= k < n:
            raise ValueError
    except ValueError:
        raise pytest.UsageError(f"CUPY_XATTN_TEST_SHARD is k/n with 0 <= k < n, not {shard!r}") from None
    blocks = SHARD_BLOCKS * n
    bounds = [b * len(items) // blocks for b in range(blocks + 1)]
    mine = {i for b in range(k, blocks, n) for i in range(bounds[b], bounds[b + 1])}
    config.hook.pytest_deselected(items=[item for i, item in enumerate(items) if i not in mine])
    items[:] = [item for i, item in enumerate(items) if i in mine]


@functools.cache  # read once: the hook below asks after every test
def _deadline():
    """CUPY_XATTN_TEST_DEADLINE as a float, or None where unset."""
    deadline = os.environ.get("CUPY_XATTN_TEST_DEADLINE")
    if not deadline:
        return None
    try:
        return float(deadline)
    except ValueError:
        raise pytest.UsageError(f"CUPY_XATTN_TEST_DEADLINE is a Unix time in seconds, not {deadline!r}") from None


def pytest_configure(config):
    _deadline()  # a bad value stops the run before any test, not after the first


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Stop after the test running at CUPY_XATTN_TEST_DEADLINE, as -x stops after a failure: the
    summary and the slowest durations are still written, and the exit status is 2 (interrupted).
    scripts/h200_check.sh sets it (TEST_SECONDS) so that its shards end inside a device call."""
    yield
    deadline = _deadline()
    if deadline is not None and time.time() >= deadline and nextitem is not None:
        item.session.shouldstop = f"CUPY_XATTN_TEST_DEADLINE passed, {item.nodeid} the last test run"
