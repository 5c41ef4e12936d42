"""Plans: graph replay with new arrays every call, equal to the first (direct) run (marker ``gpu``)."""
import threading

import numpy
import pytest

import cupy_xattn
from cupy_xattn import bench, cases, graphs, plans
from cupy_xattn.grads import CrossAttentionGrads

pytestmark = pytest.mark.gpu


def _inputs(case, seed):
    import cupy
    return {name: cupy.asarray(a) for name, a in cases.make_inputs(case, seed=seed).items()}


def _equal(a, b):
    return all(bool((x == y).all()) for x, y in zip(a, b))


@pytest.mark.parametrize("precision", ["fp32", "tf32", "fp16"])
def test_replay_equals_first_run_with_new_arrays_every_call(precision):
    import cupy
    case = cases.Case(2, 300, 77, atol=0.2)
    p = cupy_xattn.plan(2, 300, 77, precision=precision)
    first_inputs = _inputs(case, 1)
    first = p(**first_inputs)                                 # direct run, then capture
    copies = {k: v.copy() for k, v in first_inputs.items()}  # same values, new addresses
    replay = p(**copies)
    assert _equal(first, replay)
    other = p(**_inputs(case, 2))                              # different values: different results
    assert not bool((other.grad_video_latents == first.grad_video_latents).all())
    out = CrossAttentionGrads(*(cupy.full(g.shape, numpy.nan, numpy.float32) for g in first))
    filled = p(**first_inputs, out=out)
    assert all(f is o for f, o in zip(filled, out)) and _equal(filled, first)


# The edges into the library's kernels of a 2x300x77 graph (6, 4, 6 at 0c0f441 on the H200): fp16 and
# fp32, copy → rescale twice and the three projections → attention; tf32, the projections → attention,
# attention → its dK|dV reduction, and two transposes after a GEMM or a transpose.
@pytest.mark.parametrize("precision, edges", [("fp32", 6), ("tf32", 4), ("fp16", 6)])
def test_graph_edges_into_the_library_kernels_are_programmatic_and_replays_repeat_the_first_run(precision, edges):
    """On sm_90 (graphs.py): each kernel of the library may launch before the kernels it depends on
    have finished, and waits for them inside (tests/test_kernels.py checks the wait in the PTX).
    Only edges into the library's kernels change; replays equal the direct run bit for bit."""
    import cupy
    from cupy_xattn import kernels
    if int(cupy.cuda.Device().compute_capability) < 90:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    case = cases.Case(2, 300, 77, atol=0.2)
    p = cupy_xattn.plan(2, 300, 77, precision=precision)
    inputs = _inputs(case, 6)
    first = p(**inputs)
    (_, graph), = p._programs.values()
    assert isinstance(graph, graphs.ProgrammaticGraph), "the graph kept its ordinary edges"
    print(precision, graph.programmatic_edges)
    targets = [target for _, target in graph.programmatic_edges]
    assert len(targets) == edges and set(targets) <= kernels.kernel_names()
    assert any(target.startswith("attn_bwd") for target in targets)
    for _ in range(20):
        assert _equal(p(**inputs), first)


def test_plan_matches_cross_attention_backward_and_the_cache_reuses_it():
    case = cases.Case(1, 200, 50, atol=0.2)
    inputs = _inputs(case, 3)
    p = cupy_xattn.plan(1, 200, 50)
    assert _equal(p(**inputs), cupy_xattn.cross_attention_backward(**inputs))
    before = len(plans._cache)
    cupy_xattn.cross_attention_backward(**_inputs(case, 4))
    assert len(plans._cache) == before


def test_two_shapes_interleaved_and_cache_eviction(monkeypatch):
    monkeypatch.setattr(plans, "CACHE_SIZE", 2)
    shapes = [cases.Case(1, 64, 77, atol=0.2), cases.Case(2, 100, 30, atol=0.2), cases.Case(1, 70, 20, atol=0.2)]
    inputs = [_inputs(c, 5) for c in shapes]
    first = [cupy_xattn.cross_attention_backward(**i) for i in inputs]
    assert len(plans._cache) <= 2
    again = [cupy_xattn.cross_attention_backward(**i) for i in reversed(inputs)][::-1]
    assert all(_equal(a, b) for a, b in zip(first, again))


def test_two_streams_and_two_threads():
    import cupy
    case = cases.Case(2, 256, 77, atol=0.2)
    inputs = [_inputs(case, s) for s in (6, 7)]
    expected = [cupy_xattn.cross_attention_backward(**i) for i in inputs]
    cupy.cuda.Device().synchronize()
    results = [None, None]

    def work(k):
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            for _ in range(3):
                results[k] = cupy_xattn.cross_attention_backward(**inputs[k])
            stream.synchronize()

    threads = [threading.Thread(target=work, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(_equal(r, e) for r, e in zip(results, expected))


def test_a_call_on_a_non_default_stream_does_not_synchronize_the_device():
    # Another stream is kept busy for about a second; a call on our stream must neither wait for
    # it on the host nor order its GPU work after it.
    import cupy
    case = cases.Case(2, 64, 77, atol=0.0)
    inputs = _inputs(case, 4)
    spin = cupy.RawKernel(bench.LEAD_SOURCE, "lead")
    busy, ours = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    with ours:
        cupy_xattn.cross_attention_backward(**inputs)  # first call: recorded and captured
    ours.synchronize()
    with busy:
        spin((1,), (1,), (numpy.int64(2_000_000_000),))
    busy_done = busy.record()
    with ours:
        out = cupy_xattn.cross_attention_backward(**inputs)
    ours_done = ours.record()
    assert not busy_done.done
    ours_done.synchronize()
    assert not busy_done.done, "the call waited for another stream's work"
    busy.synchronize()
    assert all(bool(cupy.isfinite(o).all()) for o in out)


def test_wrong_shape_on_a_plan_is_a_clear_error():
    p = cupy_xattn.plan(1, 64, 77)
    with pytest.raises(ValueError, match="this plan is for"):
        p(**_inputs(cases.Case(1, 65, 77, atol=0.2), 8))
    with pytest.raises(ValueError, match="this plan computes"):
        p(**_inputs(cases.Case(1, 64, 77, atol=0.2), 8), precision="fp16")


def test_out_overlapping_an_input_or_another_out_is_refused_on_the_fast_path_too():
    import cupy
    inputs = _inputs(cases.Case(1, 64, 77, atol=0.2), 9)
    good = cupy_xattn.cross_attention_backward(**inputs)
    aliased = list(cupy.empty_like(g) for g in good)
    aliased[2] = inputs["query_weight"]                       # grad_query_weight written over Wq
    with pytest.raises(ValueError, match="overlaps"):
        cupy_xattn.cross_attention_backward(**inputs, out=aliased)
    shared = list(cupy.empty_like(g) for g in good)
    shared[6] = shared[4]                                     # dWv and dWk in one buffer
    with pytest.raises(ValueError, match="overlaps"):
        cupy_xattn.cross_attention_backward(**inputs, out=shared)
    same_input_twice = dict(inputs, value_weight=inputs["key_weight"])  # inputs may share memory
    cupy_xattn.cross_attention_backward(**same_input_twice)


def test_single_video_row_plan_repeats_bitwise():
    # cuBLAS refuses graph capture for B·Nv = 1 with TF32 on the H200; the plan then runs uncaptured.
    case = cases.Case(1, 1, 77, atol=0.2)
    p = cupy_xattn.plan(1, 1, 77, precision="tf32")
    inputs = _inputs(case, 10)
    first = p(**inputs)
    assert _equal(first, p(**{k: v.copy() for k, v in inputs.items()}))


def test_out_of_gpu_memory_is_a_clear_error_and_frees_what_it_took():
    import gc

    import cupy
    case = cases.Case(4, 1024, 77, atol=0.0)
    inputs = _inputs(case, 3)
    out = CrossAttentionGrads(*(cupy.empty_like(inputs[name.removeprefix("grad_")]) for name in CrossAttentionGrads._fields))
    plan = cupy_xattn.plan(4, 1024, 77)
    # A pool of its own with room for two of the 16 MiB intermediates: the default pool's cached blocks,
    # left by earlier tests, served part of the outputs under a limit set on it (seen on the H200).
    pool, previous = cupy.cuda.MemoryPool(), cupy.cuda.get_allocator()
    pool.set_limit(size=32 << 20)
    cupy.cuda.set_allocator(pool.malloc)
    gc.disable()  # a recording kept alive by a reference cycle fails the check below, whenever gc would run
    try:
        with pytest.raises(MemoryError, match=r"the 10 outputs \(33\.2 MiB"):
            plan(**inputs)  # the outputs are allocated first
        with pytest.raises(MemoryError, match=r"B=4, Nv=1024, Nt=77, D=1024 \(tf32\): it needs about"):
            plan(**inputs, out=out)
        assert pool.used_bytes() == 0  # the half-built recording is gone
    finally:
        gc.enable()
        cupy.cuda.set_allocator(previous)
    plan(**inputs, out=out)  # with memory again, the same plan works
    assert all(bool(cupy.isfinite(o).all()) for o in out)
