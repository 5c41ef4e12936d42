"""Plans and the backward's recording, run on a fake CuPy without a GPU.

The fake records what would reach the GPU (kernel launches, cuBLAS calls, copies, events), so
the orchestration — steps, pointer table, first run and capture, replay, scale eviction,
stream ordering, device checks, the uncaptured fallback — is tested in CI. The numbers are the
GPU tests' business (tests/test_gpu_*.py).
"""
import functools
import itertools
import re
import struct
import sys
import types

import numpy
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

_addresses = itertools.count(1 << 32, 1 << 24)  # 16 MiB apart, 16-byte aligned


class FakePointer:
    """A cupy.cuda.MemoryPointer: an address on a device, offset by adding bytes."""

    def __init__(self, ptr, device_id=0):
        self.ptr, self.device_id = ptr, device_id

    def __add__(self, offset):
        return FakePointer(self.ptr + offset, self.device_id)


def _alloc(nbytes):
    """cupy.cuda.alloc: a fresh address range of at least ``nbytes``."""
    ptr = next(_addresses)
    for _ in range(nbytes >> 24):  # larger than the spacing: skip the addresses it covers
        next(_addresses)
    return FakePointer(ptr)


class FakeArray:
    """What the library reads of a CuPy array."""

    def __init__(self, shape, dtype=numpy.float32, memptr=None, *, ptr=None, device=0):
        self.shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        self.dtype = numpy.dtype(dtype)
        self.size = int(numpy.prod(self.shape))
        self.nbytes = self.size * self.dtype.itemsize
        if memptr is None:
            memptr = _alloc(self.nbytes) if ptr is None else FakePointer(ptr, device)
        self.data = memptr
        self._c_contiguous = True
        self.ndim = len(self.shape)
        self.itemsize = self.dtype.itemsize
        self.strides = tuple(int(numpy.prod(self.shape[i + 1:])) * self.itemsize for i in range(self.ndim))

    @property
    def device(self):
        return types.SimpleNamespace(id=self.data.device_id)

    def __getitem__(self, rows):  # rows of a C-contiguous array (wkv_h[:d], buffer[1:])
        start, stop, _ = rows.indices(self.shape[0])
        row_bytes = self.nbytes // self.shape[0]
        return FakeArray((stop - start,) + self.shape[1:], self.dtype, self.data + start * row_bytes)

    def reshape(self, *shape):
        return FakeArray(shape[0] if len(shape) == 1 else shape, self.dtype, self.data)

    def __setitem__(self, index, value):  # a fill on the GPU: nothing to record
        pass


class FakeEvent:
    def __init__(self, log, disable_timing=False):
        self.log = log
        log.append(("new event", self))

    def record(self, stream):
        self.log.append(("record", stream.ptr, self))


class FakeStream:
    def __init__(self, log, ptr):
        self.log, self.ptr, self.capturing = log, ptr, False

    def record(self):
        event = FakeEvent(self.log)
        event.record(self)
        return event

    def wait_event(self, event):
        self.log.append(("wait", self.ptr, event))

    def begin_capture(self):
        self.capturing = True

    def end_capture(self):
        self.capturing = False
        if self.log.invalidated:
            self.log.invalidated = False
            raise FakeRuntimeError(901)  # cudaErrorStreamCaptureInvalidated
        return FakeGraph(self.log)

    def __enter__(self):
        self.log.current.append(self)
        return self

    def __exit__(self, *exc):
        self.log.current.pop()


class FakeGraph:
    def __init__(self, log):
        self.log = log

    def launch(self, stream):
        self.log.append(("graph", stream.ptr))


class FakeRuntimeError(RuntimeError):
    def __init__(self, status):
        super().__init__(f"CUDA error {status}")
        self.status = status


class Log(list):
    """Everything the fake GPU was asked to do, in order."""

    def __init__(self):
        super().__init__()
        self.current, self.invalidated, self.device, self.refuse_in_capture = [], False, 0, False
        self.fail_on_stream = None  # a stream pointer whose next GEMM fails
        self.bias_gemms = []  # (stream, arguments, sm_target) of each cuBLASLt GEMM recorded (Handle.bias_gemm)

    def count(self, kind):
        return sum(1 for entry in self if entry[0] == kind)


@functools.lru_cache(maxsize=None)
def _kernel_parameter_count(filename, name):
    """Parameters of ``extern "C"`` kernel ``name`` in kernels_cu/<filename>, read from its source."""
    from cupy_xattn import kernels
    found = re.search(kernels.KERNEL_HEAD + name + r"\s*\(([^)]*)\)",
                      kernels.kernel_source(filename))
    assert found, f"no kernel {name} in {filename}"
    return len(found.group(1).split(","))


def _fake_array(values, dtype):
    """cupy.array: an array that keeps its values (the metadata a kernel will read)."""
    array = FakeArray(len(values), dtype)
    array.values = list(values)
    return array


@pytest.fixture
def gpu(monkeypatch):
    """A fake CuPy, kernel loader and cuBLAS handle; returns the log of GPU work."""
    log = Log()
    null = FakeStream(log, 0)
    streams = itertools.count(100)

    def get_current_stream():
        return log.current[-1] if log.current else null

    class Device:
        def __init__(self, device=None):
            self.id = log.device if device is None else device
            self.compute_capability = "90"  # an H200: the resident attention on wgmma

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    runtime = types.SimpleNamespace(
        getDevice=lambda: log.device, streamPerThread=2,
        getDeviceProperties=lambda device: {"multiProcessorCount": 132},
        memcpyAsync=lambda dst, src, size, kind, stream: log.append(("copy", stream, dst, size)),
        memsetAsync=lambda ptr, value, size, stream: log.append(("memset", stream)))
    cuda = types.SimpleNamespace(
        Stream=lambda non_blocking=False: FakeStream(log, next(streams)), get_current_stream=get_current_stream,
        Event=lambda disable_timing=False: FakeEvent(log, disable_timing), Device=Device, runtime=runtime,
        alloc=_alloc)
    fake = types.SimpleNamespace(
        ndarray=FakeArray, cuda=cuda, is_available=lambda: True, float16=numpy.float16, uint8=numpy.uint8,
        empty=lambda shape, dtype=numpy.float32: FakeArray(shape, dtype),
        zeros=lambda shape, dtype=numpy.float32: FakeArray(shape, dtype),
        ones=lambda shape, dtype=numpy.float32: FakeArray(shape, dtype),
        full=lambda shape, value, dtype=numpy.float32: FakeArray(shape, dtype),
        array=_fake_array)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    # Modules a real CuPy left half-imported (lazily) would now import against the fake, e.g. when
    # hypothesis reads every loaded module's constants.
    for name in [name for name in sys.modules if name.split(".")[0] == "cupyx"]:
        monkeypatch.delitem(sys.modules, name)
    runtime_module = types.ModuleType("cupy_backends.cuda.api.runtime")
    runtime_module.CUDARuntimeError = FakeRuntimeError
    monkeypatch.setitem(sys.modules, "cupy_backends.cuda.api.runtime", runtime_module)

    from cupy_xattn import _cublas, backward, graphs, kernels, plans

    class FakeKernel:
        max_dynamic_shared_size_bytes = 0
        preferred_shared_memory_carveout = -1

        def __init__(self, filename, name, defines):
            self.name, self.n_params, self.defines = name, _kernel_parameter_count(filename, name), defines or {}

        def __call__(self, grid, block, args, shared_mem=0):
            # A launch with the wrong argument count fails on a GPU (invalid argument or worse).
            assert len(args) == self.n_params, f"{self.name}: {len(args)} arguments for {self.n_params} parameters"
            log.append(("kernel", self.name, get_current_stream().ptr, args))

    class FakeHandle:
        WORKSPACE_BYTES = 0  # the fake allocates none

        def __init__(self, stream):
            self.stream = stream

        def gemm_batched(self, *args, sm_target=0):
            assert 0 <= sm_target <= 132, sm_target  # cuBLAS takes at most the device's SMs
            self._call(args[-2])

        def bias_gemm(self, *args, sm_target=0):  # cuBLASLt: chooses its algorithm when recorded
            assert 0 <= sm_target <= 132, sm_target
            log.bias_gemms.append((self.stream.ptr, args, sm_target))
            return lambda: self._call(1)

        def _call(self, batch):
            if log.refuse_in_capture and self.stream.capturing:
                log.invalidated = True
                raise _cublas.CublasError("refused during capture")
            if self.stream.ptr == log.fail_on_stream:
                log.append(("failed gemm", self.stream.ptr))
                raise _cublas.CublasError("failed on purpose")
            log.append(("gemm", batch, self.stream.ptr))  # batch count, stream

    monkeypatch.setattr(kernels, "get_kernel",
                        lambda filename, name, defines=None, arch=None: FakeKernel(filename, name, defines))
    monkeypatch.setattr(backward._cublas, "Handle", FakeHandle)
    monkeypatch.setattr(plans, "_cache", type(plans._cache)())

    def programmatic(graph):  # the edges of a real graph are the GPU tests' business
        log.append(("programmatic edges", graph))
        return graph

    monkeypatch.setattr(graphs, "programmatic", programmatic)
    log.null = null
    return log


def _inputs(b=2, nv=70, nt=20, d=128):
    from cupy_xattn.checks import INPUT_SHAPES
    dims = {"B": b, "Nv": nv, "Nt": nt, "D": d}
    return {name: FakeArray([dims[s] for s in symbols]) for name, symbols in INPUT_SHAPES.items()}


def _run_counts(log, start=0):
    part = Log()
    part.extend(log[start:])
    return {kind: part.count(kind) for kind in ("gemm", "kernel", "graph", "copy")}


# Kernels: the attention (70 rows = 2 query tiles, split in 2) and, in tf32, its dK|dV chunk
# reduction and two transposes (Wo^T; [Wq^T | Wk^T | Wv^T]: its weight gradients over 140 and 40 rows
# read the row-major operands, see test_tf32_weight_gradients_over_few_rows_...); fp16 and fp32
# the copy and rescale kernels for each of their two groups of tensors (fp32's copies write the
# remainders too; the second copy sums the chunks' dK|dV partials).
# GEMMs: 7 products (tf32: Q0 and dO batched in one, 6) and 2 bias sums; dWo and dWq are two in fp16
# and fp32 (alphas differ); each
# product is three GEMMs in fp32 (3xFP16).
@pytest.mark.parametrize("precision, gemms, kernels", [("tf32", 8, 4), ("fp32", 26, 5), ("fp16", 10, 5)])
def test_first_call_runs_then_captures_later_calls_replay(gpu, precision, gemms, kernels):
    import cupy_xattn
    plan = cupy_xattn.plan(2, 70, 20, hidden_size=128, num_heads=2, precision=precision)
    out = plan(**_inputs())
    assert len(out) == 10 and out.grad_text_embeddings.shape == (2, 20, 128)
    # Direct run plus the capture: every step issued twice, nothing replayed yet.
    assert _run_counts(gpu) == {"gemm": 2 * gemms, "kernel": 2 * kernels, "graph": 0, "copy": 1}
    assert gpu.count("programmatic edges") == 1  # the captured graph, before its first replay
    mark = len(gpu)
    plan(**_inputs(), out=out)
    assert _run_counts(gpu, mark) == {"gemm": 0, "kernel": 0, "graph": 1, "copy": 1}


@pytest.mark.parametrize("shape", [(2, 70, 20), (4, 64, 200)])  # dT as two column halves, as one product
def test_fp32_products_are_three_gemms_over_hi_and_lo_copies(gpu, monkeypatch, shape):
    from cupy_xattn import backward
    from cupy_xattn.checks import Problem
    from cupy_xattn.gemm import R_16F
    calls = []

    class RecordingHandle(backward._cublas.Handle):
        def gemm_batched(self, *args, sm_target=0):
            calls.append((self.stream.ptr, args))
            super().gemm_batched(*args, sm_target=sm_target)
    monkeypatch.setattr(backward._cublas, "Handle", RecordingHandle)
    program = backward.Backward(Problem(*shape, 128, 2, 64, 0.125), "fp32", gpu.null, 132)
    program.run()
    lo_offset, one = program._lo_offset, program._constants.data.ptr + 4
    copies = program._halves.data.ptr  # the fp16 copies; their remainders from lo_offset on

    def operands(address, batch):
        return _table_entries(program, address, batch)

    products = [(lane, args) for lane, args in calls if args[7] == R_16F]
    assert len(products) == 24  # 8 products (dWo and dWq apart: alphas differ), three GEMMs each
    dwo = program._alpha_o.data.ptr  # dWo's hi·lo reads O's remainder, at a scale of its own
    for i in range(0, len(products), 3):
        (lane_1, lo_hi), (lane_2, hi_lo), (lane_3, hi_hi) = products[i:i + 3]
        assert lane_1 == lane_2 == lane_3 and lo_hi[5] == hi_hi[5]  # one lane; lo·hi and hi·hi share an alpha
        assert hi_lo[5] == (dwo + 4 if hi_hi[5] == dwo else hi_hi[5])  # hi·lo too, but dWo's
        assert [g[12] for g in (lo_hi, hi_lo, hi_hi)] == [one - 4, one, one]  # beta 0, then accumulate
        batch = hi_hi[-2]
        b, a, c = (operands(hi_hi[k], batch) for k in (6, 9, 13))  # cuBLAS gets b first (column-major)
        assert all(isinstance(e, int) and copies <= e < copies + lo_offset for e in a + b)
        assert operands(lo_hi[9], batch) == [e + lo_offset for e in a] and operands(lo_hi[6], batch) == b
        assert operands(hi_lo[6], batch) == [e + lo_offset for e in b] and operands(hi_lo[9], batch) == a
        assert operands(lo_hi[13], batch) == operands(hi_lo[13], batch) == c


def test_the_pointer_table_gets_every_caller_address(gpu):
    import cupy_xattn
    from cupy_xattn.grads import INPUT_NAMES
    plan = cupy_xattn.plan(2, 70, 20, hidden_size=128, num_heads=2)
    inputs = _inputs()
    out = plan(**inputs)
    (program, _), = plan._programs.values()
    table = set(int(x) for x in program._table._host)
    assert {inputs[name].data.ptr for name in INPUT_NAMES if name != "output_bias"} <= table
    assert {o.data.ptr for o in out} <= table
    # tf32's dT for B·Nt < 96 rows is two batched halves of its columns: the second writes from
    # column D / 2 on, with rows D / 2 on of [Wk^T | Wv^T] (columns D.. of [Wq^T | Wk^T | Wv^T]).
    assert out.grad_text_embeddings.data.ptr + 4 * 64 in table
    weights_t = program._wqkv_t.data.ptr
    assert {weights_t + 4 * 128, weights_t + 4 * (64 * 3 * 128 + 128)} <= table
    plan = cupy_xattn.plan(2, 70, 48, hidden_size=128, num_heads=2)  # 96 rows: one product
    out = plan(**_inputs(2, 70, 48))
    (program, _), = plan._programs.values()
    assert out.grad_text_embeddings.data.ptr + 4 * 64 not in set(int(x) for x in program._table._host)


def test_text_lengths_are_written_when_given_and_once_more_when_dropped(gpu):
    import cupy_xattn
    plan = cupy_xattn.plan(2, 70, 20, hidden_size=128, num_heads=2)
    inputs = tuple(_inputs().values())
    plan.launch(inputs, 0.125)
    (program, _), = plan._programs.values()
    lengths = program._text_lengths.data.ptr

    def copies(*text_lengths):
        mark = len(gpu)
        plan.launch(inputs, 0.125, text_lengths=None if not text_lengths else numpy.array(text_lengths, numpy.int32))
        return [(dst, size) for kind, _, dst, size in (e for e in gpu[mark:] if e[0] == "copy")]

    table = program._table.device.data.ptr
    assert copies(5, 20) == [(table, program._table._host.nbytes), (lengths, 8)]
    assert copies() == [(table, program._table._host.nbytes), (lengths, 8)]  # every token again
    assert copies() == [(table, program._table._host.nbytes)]  # nothing left to undo


def test_a_plan_keeps_two_scales(gpu):
    import cupy_xattn
    plan = cupy_xattn.plan(1, 64, 77, hidden_size=128, num_heads=2)
    for scale in (0.1, 0.2, 0.3, 0.2):
        plan(**_inputs(1, 64, 77), scale=scale)
    assert list(plan._programs) == [0.3, 0.2]


def test_a_plan_on_its_own_stream_orders_itself_after_and_before_the_callers(gpu):
    import cupy_xattn
    cupy = sys.modules["cupy"]
    own = cupy.cuda.Stream(non_blocking=True)
    plan = cupy_xattn.plan(1, 64, 77, hidden_size=128, num_heads=2, stream=own)
    plan(**_inputs(1, 64, 77))
    mark = len(gpu)
    plan(**_inputs(1, 64, 77))
    events = [e for e in gpu[mark:] if e[0] in ("record", "wait", "graph", "copy")]
    kinds = [(e[0], e[1]) for e in events]
    assert kinds[:2] == [("record", 0), ("wait", own.ptr)]          # the caller's work first
    assert ("graph", own.ptr) in kinds and kinds[-2:] == [("record", own.ptr), ("wait", 0)]  # then back


def test_cross_attention_backward_reuses_the_cached_plan(gpu):
    import cupy_xattn
    from cupy_xattn import plans
    cupy_xattn.cross_attention_backward(**_inputs(), num_heads=2)
    mark = len(gpu)
    cupy_xattn.cross_attention_backward(**_inputs(), num_heads=2)
    assert len(plans._cache) == 1 and _run_counts(gpu, mark)["graph"] == 1


def test_the_cache_keeps_a_plan_per_stream(gpu):
    # A cached plan orders its work on the stream it was made for: a call on another stream gets its own.
    import cupy_xattn
    from cupy_xattn import plans
    cupy = sys.modules["cupy"]
    other = cupy.cuda.Stream(non_blocking=True)
    cupy_xattn.cross_attention_backward(**_inputs(), num_heads=2)
    with other:
        cupy_xattn.cross_attention_backward(**_inputs(), num_heads=2)
    assert [plan.stream.ptr for plan in plans._cache.values()] == [gpu.null.ptr, other.ptr]


@pytest.mark.parametrize("name", ["batch_size", "num_video_tokens", "num_text_tokens", "hidden_size", "num_heads"])
def test_a_plan_refuses_zero_sizes(gpu, name):
    # As cross_attention_backward refuses empty dimensions: nothing to record, and D % 0 would divide by zero.
    import cupy_xattn
    sizes = dict(batch_size=2, num_video_tokens=70, num_text_tokens=20, hidden_size=128, num_heads=2)
    with pytest.raises(ValueError, match=f"plan sizes must be positive integers: {name}=0$"):
        cupy_xattn.plan(**{**sizes, name: 0})


def test_a_plan_refuses_a_batch_past_the_grid_limit(gpu):
    # at creation, not at every call after it
    import cupy_xattn
    from cupy_xattn import checks
    cupy_xattn.plan(checks.MAX_BATCH, 1, 1, hidden_size=64, num_heads=1)
    with pytest.raises(ValueError, match="B=65536 exceeds 65535"):
        cupy_xattn.plan(checks.MAX_BATCH + 1, 1, 1, hidden_size=64, num_heads=1)


def test_a_plan_is_for_its_own_gpu(gpu):
    import cupy_xattn
    plan = cupy_xattn.plan(1, 64, 77, hidden_size=128, num_heads=2)
    problem = plan._problem(0.125)
    assert plan.matches(problem, "tf32")
    gpu.device = 1
    assert not plan.matches(problem, "tf32")


def test_a_refused_capture_leaves_the_plan_uncaptured_and_correct(gpu):
    import cupy_xattn
    from cupy_xattn import plans
    gpu.refuse_in_capture = True
    plan = cupy_xattn.plan(1, 1, 77, hidden_size=128, num_heads=2)
    plan(**_inputs(1, 1, 77))
    assert [graph for _, graph in plan._programs.values()] == [plans._UNCAPTURED]
    mark = len(gpu)
    plan(**_inputs(1, 1, 77))
    assert _run_counts(gpu, mark) == {"gemm": 8, "kernel": 3, "graph": 0, "copy": 1}  # see above


def test_misaligned_inputs_leave_the_fast_path(gpu):
    from cupy_xattn import checks
    inputs = _inputs()
    shifted = dict(inputs, query_bias=FakeArray((128,), ptr=inputs["query_bias"].data.ptr + 4))
    kwargs = dict(scale=None, num_heads=2, precision="tf32", backend="cupy", out=None)
    assert checks.fast_validate(tuple(inputs.values()), **kwargs) is not None
    assert checks.fast_validate(tuple(shifted.values()), **kwargs) is None


def test_outputs_are_fresh_memory_every_call(gpu):
    import cupy_xattn
    plan = cupy_xattn.plan(2, 70, 20, hidden_size=128, num_heads=2)
    inputs = _inputs()
    calls = [plan(**inputs) for _ in range(3)]
    spans = sorted((o.data.ptr, o.data.ptr + o.nbytes) for out in calls for o in out)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))  # no two share a byte
    assert all(o.shape == s for out in calls for o, s in zip(out, plan.output_shapes))
    (program, _), = plan._programs.values()
    assert {o.data.ptr for o in calls[-1]} <= set(int(x) for x in program._table._host)


def test_calls_after_the_first_create_no_events(gpu):
    import cupy_xattn
    cupy = sys.modules["cupy"]
    own = cupy_xattn.plan(1, 64, 77, hidden_size=128, num_heads=2, stream=cupy.cuda.Stream(non_blocking=True))
    plain = cupy_xattn.plan(1, 64, 77, hidden_size=128, num_heads=2)
    calls = [lambda: own(**_inputs(1, 64, 77)), lambda: plain(**_inputs(1, 64, 77)),
             lambda: cupy_xattn.cross_attention_backward(**_inputs(1, 64, 77), num_heads=2)]
    for call in calls:
        call()
    mark = len(gpu)
    for call in calls * 2:
        call()
    assert _run_counts(gpu, mark)["graph"] == 6 and not any(e[0] == "new event" for e in gpu[mark:])


def _last_record(log, event, before):
    """(stream, position) of the last record of ``event`` in ``log`` before position ``before``."""
    return next((entry[1], i) for i, entry in reversed(list(enumerate(log[:before])))
                if entry[0] == "record" and entry[2] is event)


def test_a_plan_without_a_stream_lets_its_last_replay_finish_before_another_stream_rewrites_the_table(gpu):
    import cupy_xattn
    cupy = sys.modules["cupy"]
    plan = cupy_xattn.plan(1, 64, 77, hidden_size=128, num_heads=2)
    plan(**_inputs(1, 64, 77))
    plan(**_inputs(1, 64, 77))
    replay = max(i for i, e in enumerate(gpu) if e == ("graph", 0))
    other = cupy.cuda.Stream(non_blocking=True)
    with other:
        mark = len(gpu)
        plan(**_inputs(1, 64, 77))
    wait = next(i for i in range(mark, len(gpu)) if gpu[i][:2] == ("wait", other.ptr))
    copy = next(i for i in range(mark, len(gpu)) if gpu[i][0] == "copy")
    stream, recorded = _last_record(gpu, gpu[wait][2], wait)
    assert stream == 0 and recorded > replay and wait < copy
    mark = len(gpu)
    with other:
        plan(**_inputs(1, 64, 77))  # the same stream again: no wait
    assert not any(e[0] == "wait" for e in gpu[mark:])


@pytest.mark.parametrize("through", ["plan", "cross_attention_backward"])  # the cache's plans have a fixed stream
def test_calls_on_the_per_thread_default_stream_always_wait_for_the_last_replay(gpu, through):
    import cupy_xattn
    plan = cupy_xattn.plan(1, 64, 77, hidden_size=128, num_heads=2)
    call = plan if through == "plan" else functools.partial(cupy_xattn.cross_attention_backward, num_heads=2)
    for _ in range(2):  # on two threads, the same handle would be two different streams
        with FakeStream(gpu, 2):  # cudaStreamPerThread
            mark = len(gpu)
            call(**_inputs(1, 64, 77))
    wait = next(i for i in range(mark, len(gpu)) if gpu[i][:2] == ("wait", 2))
    copy = next(i for i in range(mark, len(gpu)) if gpu[i][0] == "copy")
    stream, recorded = _last_record(gpu, gpu[wait][2], wait)
    assert stream == 2 and recorded < mark <= wait < copy  # the first call's record, before the table copy


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_the_fast_check_accepts_only_what_the_full_check_accepts_and_agrees_with_it(gpu, data):
    """fast_validate may decline anything (None: the full check runs), but what it accepts the full
    check must accept, with the same sizes and scale, and the addresses must be the arrays'; and
    the arrays must be on the current GPU (the plan cache is per current device)."""
    from cupy_xattn import checks
    from cupy_xattn.grads import INPUT_NAMES, CrossAttentionGrads
    b = data.draw(st.sampled_from([1, 2, 3, checks.MAX_BATCH + 1]), label="B")  # past the grid's limit too
    nv, nt = (data.draw(st.integers(1, 3), label=name) for name in ("Nv", "Nt"))
    gpu.device = data.draw(st.integers(0, 1), label="current device")  # the arrays are on GPU 0
    heads, head_dim = data.draw(st.integers(1, 3), label="heads"), data.draw(st.sampled_from([4, 8]), label="hd")
    inputs = _inputs(b, nv, nt, heads * head_dim)
    arrays = [inputs[name] for name in INPUT_NAMES]
    out = None if data.draw(st.booleans(), label="no out") else [FakeArray(a.shape) for a in arrays[1:]]
    everything = arrays + (out or [])
    for _ in range(data.draw(st.integers(0, 2), label="faults")):  # break a random array a random way
        i = data.draw(st.integers(0, len(everything) - 1), label="which")
        a = everything[i]
        fault = data.draw(st.sampled_from(["shape", "dtype", "layout", "device", "offset", "alias"]), label="fault")
        if fault == "shape":
            bad = FakeArray(a.shape[:-1] + (a.shape[-1] + 1,))
        elif fault == "dtype":
            bad = FakeArray(a.shape, numpy.float16)
        elif fault == "layout":
            bad = FakeArray(a.shape)
            bad._c_contiguous = False
        elif fault == "device":
            bad = FakeArray(a.shape, ptr=a.data.ptr, device=1)
        elif fault == "offset":  # 4 bytes past a 16-byte boundary, in memory of its own
            bad = FakeArray(a.shape, ptr=_alloc(a.nbytes + 16).ptr + 4)
        else:  # the memory of another array (an output over an input, or two outputs over one)
            j = data.draw(st.integers(0, len(everything) - 1), label="over")
            bad = FakeArray(a.shape, ptr=everything[j].data.ptr)
        everything[i] = bad
    arrays, out = everything[:11], (everything[11:] or None)
    # Drawn by index: sampled_from over values that compare equal (3, int64(3), uint8(3); 0, 0.0)
    # replayed its choices inconsistently (hypothesis's FlakyStrategyDefinition).
    num_heads = [heads, heads + 1, numpy.int64(heads), numpy.uint8(heads), 0][
        data.draw(st.integers(0, 4), label="num_heads (index)")]
    scale = [None, 0.5, 2, 0, 0.0, -1.0, float("inf"), True][data.draw(st.integers(0, 7), label="scale (index)")]
    options = dict(scale=scale, num_heads=num_heads, precision="tf32", backend="cupy")
    fast = checks.fast_validate(arrays, **options, out=out)
    try:
        problem = checks.validate(dict(zip(INPUT_NAMES, arrays)), **options,
                                  out=None if out is None else CrossAttentionGrads(*out))
    except (TypeError, ValueError):
        assert fast is None
        return
    assert type(problem.num_heads) is int  # NumPy integers as ints: size products cannot wrap
    if fast is not None:
        assert fast[0] == problem and type(fast[0].num_heads) is int
        assert fast[1] == [a.data.ptr for a in arrays + (out or [])]
        assert all(a.data.device_id == gpu.device for a in arrays + (out or []))


def test_the_fast_check_refuses_outputs_that_overlap_and_allows_an_input_twice(gpu):
    from cupy_xattn import checks
    from cupy_xattn.grads import INPUT_NAMES
    inputs = _inputs()
    arrays = tuple(inputs[name] for name in INPUT_NAMES)
    out = [FakeArray(a.shape) for a in arrays[1:]]
    kwargs = dict(scale=None, num_heads=2, precision="tf32", backend="cupy")
    assert checks.fast_validate(arrays, **kwargs, out=out) is not None
    twice = arrays[:7] + (arrays[5],) + arrays[8:]  # value_weight is key_weight
    assert checks.fast_validate(twice, **kwargs, out=out) is not None
    row_in = FakeArray((128, 128), ptr=inputs["key_weight"].data.ptr + 4 * 128)
    assert checks.fast_validate(arrays, **kwargs, out=out[:4] + [row_in] + out[5:]) is None
    assert checks.fast_validate(arrays, **kwargs, out=out[:6] + [out[4]] + out[7:]) is None
    assert checks.fast_validate(twice, **kwargs, out=out[:6] + [out[4]] + out[7:]) is None


def _shared_bytes_per_block(cubin, kernel):
    """The size of a cubin's ``.nv.shared.<kernel>`` section (ELF64 section headers): the kernel's
    static shared arrays, aligned as placed, plus the 1 KiB the SM reserves for each block."""
    offset, = struct.unpack_from("<Q", cubin, 0x28)
    entry, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", cubin, offset + i * entry) for i in range(count)]
    names = headers[names_index][4]
    sizes = {cubin[names + h[0]:cubin.index(b"\0", names + h[0])].decode(): h[5] for h in headers}
    return sizes[f".nv.shared.{kernel}"]


def test_shared_bytes_per_block_reads_the_static_arrays_and_the_reserve():
    from cupy_xattn import kernels
    source = ('extern "C" __global__ void probe(float* out) { __shared__ float a[100]; a[threadIdx.x] = 1.f; '
              "__syncthreads(); out[threadIdx.x] = a[(threadIdx.x + 1) % 100]; }")
    assert _shared_bytes_per_block(kernels.compile_source(source, "probe.cu", "sm_90"), "probe") == 1024 + 400


def test_attention_builds_fit_the_sm_at_the_blocks_they_plan(gpu, monkeypatch):
    # kernel_choice sizes the dynamic shared memory; the kernels' static arrays (block maxima, bv's
    # columns, as the cubin places them) come on top, and with the SM's 1 KiB reserved per block the
    # fp32 streamed head_dim-128 build had 1 KiB left at two blocks per SM (Session 22). Every build
    # that the backward plans for the two suites, in each mode, on an H200 (132 SMs, 228 KiB per SM,
    # 227 KiB per block): a build that no longer fits loses a block per SM without an error (or
    # fails to launch, past 227 KiB).
    from cupy_xattn import attention_bwd, backward, cases, kernels
    from cupy_xattn.checks import Problem
    builds = {}
    for suite in cases.SUITES:
        hidden, heads = cases.suite_sizes(suite)
        for case in cases.load_suite(suite):
            for precision in ("fp32", "tf32", "fp16"):
                problem = Problem(case.batch_size, case.num_video_tokens, case.num_text_tokens, hidden, heads,
                                  hidden // heads, 0.125)
                attention = backward.Backward(problem, precision, gpu.null, 132)._attention
                blocks = attention_bwd.launch_layout(problem, precision, 132)[4]
                key = (attention._main.name, tuple(sorted(attention._main.defines.items())),
                       "sm_90a" if attention.wgmma else "sm_90")
                builds[key] = max(builds.get(key, (0, 0)), (attention._smem_bytes, blocks))
    monkeypatch.undo()  # the real CuPy again, for NVRTC
    assert len(builds) >= 8, builds  # resident and streamed, fp16 operands and 3xTF32, head_dim 64 and 128
    for (name, defines, arch), (dynamic, blocks) in builds.items():
        block = dynamic + _shared_bytes_per_block(kernels.compile_cubin("attention_bwd.cu", arch, dict(defines)), name)
        per_sm = blocks * -(-block // 128) * 128  # allocated in units of 128 bytes
        assert block - 1024 <= 227 << 10 and per_sm <= 228 << 10, (name, defines, dynamic, block, blocks)


@pytest.mark.parametrize("precision", ["tf32", "fp32", "fp16"])
@pytest.mark.parametrize("shape", [(2, 70, 20), (8, 300, 77), (1, 1, 1), (4, 64, 200), (4, 257, 300), (2, 1024, 77)])
def test_memory_estimate_matches_what_a_recording_allocates(gpu, monkeypatch, shape, precision):
    from cupy_xattn import backward
    from cupy_xattn.checks import Problem
    allocated, alloc = [], _alloc

    def counting_alloc(nbytes):
        allocated.append(nbytes)
        return alloc(nbytes)
    monkeypatch.setattr(sys.modules[__name__], "_alloc", counting_alloc)
    problem = Problem(*shape, 256, 4, 64, 0.125)
    backward.Backward(problem, precision, gpu.null, 132)
    # The estimate leaves out buffers of a few KB (pointer table, constants, fp16 scale state); 4x257x300's
    # tf32 O^T padding alone is 28 KB. 2x1024x77's tf32 attention writes dQ^T and dQ's column sums.
    assert abs(backward.Backward.memory_bytes(problem, precision, 132) - sum(allocated)) <= 16 << 10


def test_out_of_gpu_memory_names_the_bytes_the_shape_needs(gpu, monkeypatch):
    import cupy
    import cupy_xattn

    class OutOfMemoryError(MemoryError):
        pass
    monkeypatch.setattr(cupy.cuda, "memory", types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError), raising=False)
    plan = cupy_xattn.plan(2, 70, 20, hidden_size=128, num_heads=2)
    inputs = _inputs()

    def refuse(*args, **kwargs):
        raise OutOfMemoryError("Out of memory allocating 71,680 bytes")
    empty = cupy.empty
    monkeypatch.setattr(cupy, "empty", refuse)
    with pytest.raises(MemoryError, match=r"B=2, Nv=70, Nt=20, D=128 \(tf32\): it needs about .* MiB \([\d,]+ bytes\)") as err:
        plan(**inputs)
    assert err.value.__context__ is None  # nothing of the half-built recording stays referenced
    assert not plan._programs
    monkeypatch.setattr(cupy, "empty", empty)  # memory again: the same plan records and runs
    out = plan(**inputs)
    monkeypatch.setattr(cupy.cuda, "alloc", refuse)
    with pytest.raises(MemoryError, match=r"the 10 outputs \(.* MiB \([\d,]+ bytes\); pass out="):
        plan(**inputs)
    plan(**inputs, out=out)  # with out=, nothing to allocate


def _lane_run(gpu, program):
    """The log of one direct run of ``program``, and its (main, side, side) stream pointers."""
    mark = len(gpu)
    program.run()
    return gpu[mark:], [lane.ptr for lane in program._lanes]


def _waits_for(entries, waiter, recorder):
    """Indices at which stream ``waiter`` waits for an event last recorded on ``recorder``."""
    recorded_on, found = {}, []
    for i, entry in enumerate(entries):
        if entry[0] == "record":
            recorded_on[id(entry[2])] = entry[1]
        elif entry[0] == "wait" and entry[1] == waiter and recorded_on.get(id(entry[2])) == recorder:
            found.append(i)
    return found


def test_independent_gemms_run_on_three_lanes_forked_and_joined(gpu):
    import cupy_xattn
    plan = cupy_xattn.plan(2, 70, 20, hidden_size=128, num_heads=2)
    plan(**_inputs())
    (program, _), = plan._programs.values()
    entries, (main, side1, side2) = _lane_run(gpu, program)
    gemm_streams = [e[2] for e in entries if e[0] == "gemm"]
    assert gemm_streams[:2] == [main, side2]  # tf32: [Q0 | dO] (one batched GEMM) beside K0|V0 on lane 2
    assert set(gemm_streams[2:]) == {main, side1, side2}
    attention = next(i for i, e in enumerate(entries) if e[:2] == ("kernel", "attn_bwd_resident"))
    assert entries[attention][2] == main
    for side in (side1, side2):
        waits = _waits_for(entries, main, side)
        assert waits and waits[0] < attention  # the attention waits for K0|V0 and dO
        assert waits[-1] > max(i for i, e in enumerate(entries) if e[0] == "gemm")  # joined at the end
        forked = _waits_for(entries, side, main)
        assert forked and forked[0] < min(i for i, e in enumerate(entries) if e[0] == "gemm" and e[2] == side)


def _unbiased_group_size(meta):
    """The tensor count n of a conversion group without a product bias, from its metadata: counts,
    destinations, slots, remainders, column sums, parts and part strides (n each), then the
    product bias's six values, zeros when there is none."""
    n = (len(meta) - 6) // 7
    assert meta[7 * n:] == [0] * 6
    return n


def _table_entries(program, address, count):
    """The ``count`` pointer-table entries (names, or addresses) a cuBLAS pointer array at ``address`` holds."""
    first = (address - program._table.device.data.ptr) // 8
    return program._table._entries[first:first + count]


def _recording_cublas(monkeypatch, sm_targets=None):
    """The list that the arguments of every cuBLAS batched GEMM call will be appended to (and each
    call's sm_target to ``sm_targets``, where given)."""
    from cupy_xattn import backward
    calls = []

    class RecordingHandle(backward._cublas.Handle):
        def gemm_batched(self, *args, sm_target=0):
            calls.append(args)
            if sm_targets is not None:
                sm_targets.append(sm_target)
            super().gemm_batched(*args, sm_target=sm_target)
    monkeypatch.setattr(backward._cublas, "Handle", RecordingHandle)
    return calls


def _recorded_program(gpu, monkeypatch, tn_min_rows, precision="tf32"):
    """A Backward of B, Nv, Nt, D = 2, 70, 20, 128 recorded with _TN_MIN_ROWS = ``tn_min_rows``,
    its lane log of one run, lane pointers and cuBLAS calls."""
    from cupy_xattn import backward
    from cupy_xattn.checks import Problem
    calls = _recording_cublas(monkeypatch)
    monkeypatch.setattr(backward, "_TN_MIN_ROWS", tn_min_rows)
    program = backward.Backward(Problem(2, 70, 20, 128, 2, 64, 0.125), precision, gpu.null, 132)
    return program, *_lane_run(gpu, program), calls


def _weight_grad_operands(program, calls, d):
    """{C entries: (K, lda, ldb, cuBLAS transa, transb, a entries, b entries)} of the batched
    weight-gradient GEMMs (row-major c = op(a) op(b), computed by cuBLAS as c^T = op(b)^T op(a)^T)."""
    def operands(address):
        return _table_entries(program, address, 2)
    return {tuple(operands(args[13])): (args[4], args[8], args[11], *args[:2], operands(args[9]), operands(args[6]))
            for args in calls if args[2:4] == (d, d) and args[15] == d and args[16] == 2}


@pytest.mark.parametrize("attention_writes_dq_t", [True, False])
def test_tf32_weight_gradients_over_many_rows_read_transposes_made_beside_the_attention(gpu, monkeypatch,
                                                                                       attention_writes_dq_t):
    # dQ^T and its column sums come from the attention on long samples (here on short ones too: the
    # threshold is patched) where dQ is whole (one key part), else from a
    # transposed copy after it.
    from cupy_xattn import backward
    from cupy_xattn.transpose import Transposed
    from cupy_xattn.attention_bwd import dq_sums_rows, o_t_stride
    from cupy_xattn.gemm import COMPUTE_32F_FAST_TF32, OP_N, OP_T
    b, nv, nt, d = 2, 70, 20, 128
    if attention_writes_dq_t:  # on these short samples too
        monkeypatch.setattr(backward, "_DQ_T_MIN_VIDEO_TOKENS", nv)
    else:
        monkeypatch.setattr(backward, "_dq_transposed", lambda *args: False)
    program, entries, (main, side1, side2), calls = _recorded_program(gpu, monkeypatch, b * nt)
    assert program._attention.dq_transposed == attention_writes_dq_t
    products = [args for args in calls if args[-1] == COMPUTE_32F_FAST_TF32]
    assert len(products) == 6 and all(args[:2] == (OP_T, OP_N) for args in products)  # row-major a · b^T

    # dWo = dY^T (O^T)^T, dWq = dQ^T (X^T)^T; dWk, dWv = dK^T, dV^T times (T^T)^T, over the padded K.
    ldv, ldt = o_t_stride(b * nv), o_t_stride(b * nt)
    video, text = program._video_t.data.ptr, program._text_t.data.ptr
    x_t, dy_t, dq_t = (video + 4 * i * d * ldv for i in range(3))
    t_t, dk_t, dv_t = (text + 4 * i * d * ldt for i in range(3))
    assert _weight_grad_operands(program, products, d) == {
        ("grad_output_weight", "grad_query_weight"): (ldv, ldv, ldv, OP_T, OP_N, [dy_t, dq_t],
                                                      [program._o.data.ptr, x_t]),
        ("grad_key_weight", "grad_value_weight"): (ldt, ldt, ldt, OP_T, OP_N, [dk_t, dv_t], [t_t, t_t])}

    # The bias gradients: ones-row GEMMs over the column sums by blocks of rows: 64 of B·Nv in the
    # transposes of dY (the second of X^T, dY^T) and of [dK | dV], 16 of a sample's Nv in the
    # attention's dQ (else 64 of B·Nv in dQ^T's transpose). dY's and dQ's sums are one batched GEMM
    # over as many rows as the longer has (dY's past its own are zeros).
    sums = {tuple(_table_entries(program, args[6], 2)): (args[4], args[8])
            for args in calls if args[3] == 1}  # cuBLAS's n = 1: the row-major ones row is our m
    ones, tiles_v, tiles_t = program._ones.data.ptr, -(-b * nv // 64), -(-b * nt // 64)
    video_rows = dq_sums_rows(b, nv) if attention_writes_dq_t else tiles_v
    assert program._video_sums.shape == (2, video_rows, d) and video_rows == (10 if attention_writes_dq_t else 3)
    video_sums, text_sums = program._video_sums.data.ptr, program._text_sums.data.ptr
    dq_sums = video_sums + 4 * video_rows * d
    assert sums == {(video_sums, dq_sums): (video_rows, d), (text_sums, text_sums + 4 * d): (tiles_t, 2 * d)}
    assert all(_table_entries(program, args[9], 1) == [ones] for args in calls if args[3] == 1)
    sum_args = [launch._args[-2:] for _, launch, _ in program._steps if isinstance(launch, Transposed)]
    assert [(int(address), int(first)) for address, first in sum_args if address] == [
        (video_sums, 1)] + [(dq_sums, 0)] * (not attention_writes_dq_t) + [(text_sums, 0)]

    attention = next(i for i, e in enumerate(entries) if e[0] == "kernel" and e[1].startswith("attn_bwd"))
    assert [int(a) for a in entries[attention][3][-2:]] == ([dq_t, dq_sums] if attention_writes_dq_t else [0, 0])
    assert entries[attention][3][4] is program._o
    transposes = [(i, e[2]) for i, e in enumerate(entries) if e[:2] == ("kernel", "transposed_copies")]
    # Wo^T, [Wq^T | Wk^T | Wv^T] (on lane 1, beside K0|V0 on lane 2) before the attention; T^T and
    # X^T, dY^T (lane 2, behind K0|V0) beside it; dQ^T (where the attention does not write it) and
    # [dK | dV]^T after it.
    assert [lane for _, lane in transposes] == [main, side1, side1, side2] + [side2] * (not attention_writes_dq_t) + [
        side1]
    assert transposes[1][0] < attention < transposes[2][0]
    # dX on the main lane reads [Wq^T | Wk^T | Wv^T]: the main lane waits for lane 1 after it, before the attention.
    assert any(transposes[1][0] < i < attention for i in _waits_for(entries, main, side1))
    # What reads the attention's outputs on a side lane waits for it: on lane 2 dQ^T's transpose or
    # else the bias sums, on lane 1 dT.
    first_gemm = lambda lane: next(i for i, e in enumerate(entries)  # noqa: E731
                                   if e[0] == "gemm" and e[2] == lane and i > attention)
    readers = [(side2, first_gemm(side2) if attention_writes_dq_t else transposes[4][0]), (side1, first_gemm(side1))]
    for side, first_reader in readers:
        assert any(attention < i < first_reader for i in _waits_for(entries, side, main))


def test_tf32_weight_gradients_over_few_rows_read_the_row_major_operands(gpu, monkeypatch):
    from cupy_xattn.gemm import OP_N, OP_T
    b, nv, nt, d = 2, 70, 20, 128
    program, entries, _, calls = _recorded_program(gpu, monkeypatch, b * nv + 1)
    assert program._video_t is None and program._text_t is None and program._o.shape == (b * nv, d)  # row-major O
    dkv, o = program._dkv.data.ptr, program._o.data.ptr
    assert _weight_grad_operands(program, calls, d) == {  # dWo = dY^T O, dWq = dQ^T X; dWk, dWv = dK^T T, dV^T T
        ("grad_output_weight", "grad_query_weight"): (b * nv, d, d, OP_N, OP_T, ["grad_output", program._dq.data.ptr],
                                                      [o, "video_latents"]),
        ("grad_key_weight", "grad_value_weight"): (b * nt, d, 2 * d, OP_N, OP_T, [dkv, dkv + 4 * d],
                                                   ["text_embeddings"] * 2)}
    assert [e[2] for e in entries if e[:2] == ("kernel", "transposed_copies")] == [program._lanes[0].ptr,
                                                                                 program._lanes[1].ptr]  # W^T only


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_half_modes_add_up_the_column_sums_their_conversions_write_into_the_bias_gradients(gpu, monkeypatch, precision):
    from cupy_xattn.half_scaling import column_sum_rows
    d = 128
    program, entries, _, calls = _recorded_program(gpu, monkeypatch, 0, precision)
    dy, dq, dkv = program._column_sums  # dY's from before the attention, dQ's and [dK | dV]'s after it
    # The attention writes O's fp16 copy (fp32: and its remainder), so the first group holds bv's copy,
    # whose scale bounds max|bv| for O's, and the second none of O.
    assert [a.shape for a in (dy, dq, dkv)] == [
        (column_sum_rows([140 * d, 40 * d] + [d * d] * 4 + [140 * d, d], [d], 132)[0], d),
        *zip(column_sum_rows([140 * d, 80 * d], [d, 2 * d], 132), (d, 2 * d))]
    sums = sorted((_table_entries(program, args[6], args[16]), args[4], args[8])
                  for args in calls if args[3] == 1)  # cuBLAS's n = 1: the ones row
    # Partial rows past the tensor's rows hold no data: the sums run over at most B·Nv (B·Nt) of them.
    rows_dy, rows_dq, rows_kv = min(dy.shape[0], 140), min(dq.shape[0], 140), min(dkv.shape[0], 40)
    expected = [([dkv.data.ptr, dkv.data.ptr + 4 * d], rows_kv, 2 * d)]
    if rows_dy == rows_dq:
        expected.append(([dy.data.ptr, dq.data.ptr], rows_dy, d))
    else:
        expected += [([dy.data.ptr], rows_dy, d), ([dq.data.ptr], rows_dq, d)]
    assert sums == sorted(expected)
    stage_a, stage_b = (meta.values for meta in program._scaler._groups)  # the copy kernels write them
    n = _unbiased_group_size(stage_b)
    n_a = 8
    assert stage_a[4 * n_a:5 * n_a] == [0] * 6 + [dy.data.ptr, 0]
    assert stage_b[4 * n:5 * n] == [dq.data.ptr, dkv.data.ptr]
    # [dK | dV] is the sum of the attention's two query chunks' partials (no reduction kernel).
    partials = program._attention.partials
    assert partials.shape == (2, 40, 2 * d) and stage_b[5 * n:7 * n] == [1] * (n - 1) + [2] + [0] * (n - 1) + [20 * d]
    copies = [e[3] for e in entries if e[:2] == ("kernel", "half_copy_absmax")]  # (sources, meta, n, ...)
    assert _table_entries(program, int(copies[1][0]), n)[-1] == partials.data.ptr
    # The attention writes O · s_O as fp16 where the copy of O goes (fp32: its remainder where the
    # copy's remainder goes), dWo reads it; the inverse scales of T, [Wk; Wv], bv, dY and O are the
    # scaler's (O's written by the attention, with dWo's alpha).
    from cupy_xattn.backward import _BV, _DY, _O, _T, _WKV
    (o_arg, *scale_args, lo_offset, kv_scale, dq_t, dq_sums), = [e[3][4:5] + e[3][-10:] for e in entries
                                                                 if e[0] == "kernel" and e[1].startswith("attn_bwd")]
    assert int(kv_scale) == 0  # the half modes' K0|V0 scale comes from T's and [Wk; Wv]'s
    assert int(dq_t) == int(dq_sums) == 0  # dQ^T: the tf32 mode's
    halves = stage_b[n:2 * n]  # the copies' destinations
    o_copy = halves[0] - 2 * -(-140 * d // 128) * 128  # the copy just before dQ's
    assert int(o_arg) == o_copy
    assert int(lo_offset) == (0 if precision == "fp16" else program._lo_offset // 2)
    if precision == "fp32":
        assert stage_b[3 * n:4 * n] == [h + program._lo_offset for h in halves]  # dQ's, [dK | dV]'s remainders
    assert scale_args == [program._scaler.inverse_scale(i) for i in (_T, _WKV, _BV, _DY, _O)] + [
        program._alpha_o.data.ptr]
    assert _table_entries(program, int(copies[0][0]), n_a)[-1] == "value_bias"
    dwo = [args for args in calls if _table_entries(program, args[13], args[16]) == ["grad_output_weight"]]
    dy_copy = stage_a[n_a + 6]  # the first group's destinations: X, T, Wq, Wk, Wv, Wo, dY, bv
    lo = [program._lo_offset] if precision == "fp32" else []  # fp32: lo·hi, hi·lo, then hi·hi
    alpha = scale_args[-1]  # hi·lo's: the second float, for O's remainder at its own scale
    assert [(_table_entries(program, args[9], 1), _table_entries(program, args[6], 1), args[5]) for args in dwo] == [
        ([dy_copy + a], [o_copy + b], alpha + 4 * bool(b))
        for a, b in ([(lo[0], 0), (0, lo[0])] if lo else []) + [(0, 0)]]


@pytest.mark.parametrize("precision", ["tf32", "fp16", "fp32"])
@pytest.mark.parametrize("shape", [(2, 256, 77), (1, 528, 77), (1, 529, 77), (1, 128, 528), (1, 128, 529),
                                   (1, 1584, 77), (1, 1585, 77), (1, 2112, 77), (1, 2113, 77), (1, 1000, 528),
                                   (1, 1000, 529), (1, 2112, 264), (1, 2112, 265), (1, 2113, 265), (1, 4096, 1056),
                                   (1, 4096, 1057), (1, 2112, 2112), (1, 2112, 2113), (1, 2113, 1057), (1, 4224, 77),
                                   (1, 4225, 77), (1, 4225, 528), (64, 128, 77), (32, 128, 77), (8, 256, 373),
                                   (1, 2113, 2113), (1, 4224, 4224), (1, 4224, 4225), (1, 4225, 4225), (1, 2112, 1057)])
def test_small_half_mode_problems_give_cublas_its_share_of_the_sms(gpu, monkeypatch, precision, shape):
    # q = 132 · 128² / (4 · D) = 528 rows (Q0's output at most 33 tiles of 128 × 128). fp16, where
    # B·Nv and B·Nt ≤ q: the three projections and dWo plan for a third of the SMs, the four GEMMs
    # of the last two lanes for half; where B·Nt ≤ q and B·Nv ≤ 4q, Q0 and dWo for two thirds,
    # dWq for half; B·Nt ≤ q and larger B·Nv, dWq for two thirds; q < B·Nt ≤ 2q and B·Nv > 4q, Q0
    # and dWq for two thirds; q < B·Nt ≤ 4q and B·Nv ≤ 4q, Q0 and dWo for two thirds, dX for half.
    # fp32, where B·Nt ≤ q: a table of its own where B·Nv ≤ 3q, another where B·Nv ≤ 4q, a third
    # where B·Nv ≤ 8q, a fourth (dWo alone, two thirds) beyond; where q < B·Nt ≤ 4q and B·Nv ≤ 4q a
    # fifth; where q < B·Nt ≤ 2q and B·Nv > 4q a sixth; where 4q < B·Nt ≤ 8q, one where B·Nv ≤ 4q and
    # one where 4q < B·Nv ≤ 8q; where both exceed 8q, dWo and dWq for half. tf32, where B·Nt ≤ q and
    # q < B·Nv ≤ 3q: dX for a third, dT for two thirds; else where q/2 < B·Nt ≤ q and B·Nv ≤ 4q, dT
    # for two thirds; where q < B·Nt ≤ 2q, dX for two thirds; where 2q < B·Nt ≤ 4q and B·Nv ≤ 4q,
    # and where 4q < B·Nt ≤ 8q and 4q < B·Nv ≤ 8q, dT for two thirds. The bias sums and everything else: all (0).
    from cupy_xattn import backward
    from cupy_xattn.checks import Problem
    sm_targets = []
    calls = _recording_cublas(monkeypatch, sm_targets)
    program = backward.Backward(Problem(*shape, 1024, 16, 64, 0.125), precision, gpu.null, 132)
    program.run()
    b, nv, nt = shape
    if precision == "tf32":
        mv, mt = b * nv, b * nt
        if mt <= 528 and 528 < mv <= 1584:
            dx_dt = 44, 88
        elif 264 < mt <= 528 and mv <= 2112 or 1056 < mt <= 2112 and mv <= 2112 or (
                2112 < mt <= 4224 and 2112 < mv <= 4224):
            dx_dt = 0, 88
        else:
            dx_dt = (88, 0) if 528 < mt <= 1056 else (0, 0)
        firsts = [_table_entries(program, args[13], args[16])[0] for args in calls]  # dT's: (name, byte offset)
        outputs = {first[0] if isinstance(first, tuple) else first: target for first, target in zip(firsts, sm_targets)}
        assert (outputs.pop("grad_video_latents"), outputs.pop("grad_text_embeddings")) == dx_dt
        assert set(outputs.values()) == {0}, outputs
        return
    if precision == "fp32" and b * nt <= 528 and b * nv <= 1584:
        targets = 66, 44, 66, 44, 66, 88, 44, 88
    elif precision == "fp32" and b * nt <= 528 and b * nv <= 2112:
        targets = 88, 66, 0, 44, 44, 88, 44, 0
    elif precision == "fp32" and b * nt <= 528 and b * nv <= 4224:
        targets = 88, 0, 0, 66, 88, 88, 66, 0
    elif precision == "fp32" and b * nt <= 528:
        targets = 0, 0, 0, 88, 0, 0, 0, 0
    elif precision == "fp32" and 528 < b * nt <= 2112 and b * nv <= 2112:
        targets = 88, 88, 88, 66, 66, 66, 88, 0
    elif precision == "fp32" and 528 < b * nt <= 1056 and b * nv > 2112:
        targets = 88, 0, 88, 66, 88, 88, 66, 0
    elif precision == "fp32" and 2112 < b * nt <= 4224 and b * nv <= 2112:
        targets = 0, 0, 0, 88, 88, 66, 0, 0
    elif precision == "fp32" and 2112 < b * nt <= 4224 and 2112 < b * nv <= 4224:
        targets = 88, 88, 0, 66, 88, 88, 88, 0
    elif precision == "fp32" and b * nt > 4224 and b * nv > 4224:
        targets = 0, 0, 0, 66, 0, 66, 0, 0
    elif precision == "fp16" and b * nv <= 528 and b * nt <= 528:
        targets = 44, 44, 44, 44, 66, 66, 66, 66
    elif precision == "fp16" and b * nt <= 528 and b * nv <= 2112:
        targets = 88, 0, 0, 88, 0, 66, 0, 0
    elif precision == "fp16" and b * nt <= 528:
        targets = 0, 0, 0, 0, 0, 88, 0, 0
    elif precision == "fp16" and b * nt <= 1056 and b * nv > 2112:
        targets = 88, 0, 0, 0, 0, 88, 0, 0
    elif precision == "fp16" and b * nt <= 2112 and b * nv <= 2112:
        targets = 88, 0, 0, 88, 66, 0, 0, 0
    else:
        targets = (0,) * 8
    outputs = [program._q0.data.ptr, program._kv0.data.ptr, program._dout.data.ptr, "grad_output_weight",
               "grad_video_latents", "grad_query_weight", "grad_text_embeddings", "grad_key_weight"]
    got = {}
    for args, target in zip(calls, sm_targets):
        first = _table_entries(program, args[13], args[16])[0]  # the product's first output
        got.setdefault(first, set()).add(target)
    for _, args, target in gpu.bias_gemms:  # the fp16 mode's Q0 where the lean attention runs: cuBLASLt's
        got.setdefault(args[11], set()).add(target)
    assert all(got.pop(output) == {target} for output, target in zip(outputs, targets)), got
    assert all(targets == {0} for targets in got.values()), got  # the bias sums


def test_tf32_rows_of_the_sm_tables_set_only_the_targets_its_schedule_reads():
    # _record_tf32 passes a target to dX and dT only (its Q0 | dO, [dWo | dWq] and [dWk | dWv] are
    # batched pairs, [K0 | V0] runs beside Q0 | dO): a share set for another product would do nothing.
    from cupy_xattn import backward
    rows = [shares for mode, _, _, shares in backward._SM_TABLES if mode == "tf32"]
    assert rows
    for shares in rows:
        named = dict(zip(backward._GEMM_NAMES, shares))
        assert all(share == backward._ALL for name, share in named.items() if name not in ("dx", "dt")), named


@pytest.mark.parametrize("precision", ["tf32", "fp16", "fp32"])
@pytest.mark.parametrize("shape, hidden, half_in_fp16", [
    ((2, 70, 81), 256, True), ((4, 64, 200), 256, True), ((1, 512, 80), 1024, True),  # streamed; resident key split
    ((64, 128, 77), 1024, True), ((4, 512, 77), 1024, True),  # resident, 2 query tiles a block
    ((8, 512, 77), 1024, False), ((2, 4096, 77), 1024, False)])  # 4 and 8 query tiles a block
def test_the_fp16_mode_gets_k0_v0_in_fp16_where_it_was_measured_faster(gpu, monkeypatch, precision, shape, hidden,
                                                                       half_in_fp16):
    # There: [K0 | V0]'s GEMM writes fp16 at the constant alpha kv_half_alpha(D) (every sum of D
    # products of copies under 2^15 lands under 2^14), and the attention is built to read it; and
    # wherever the lean kernel runs (the fake GPU is an H200: every resident fp16 layout on wgmma).
    from cupy_xattn import attention_bwd, backward
    from cupy_xattn.checks import Problem
    from cupy_xattn.gemm import R_16F, R_32F
    calls = _recording_cublas(monkeypatch)
    program = backward.Backward(Problem(*shape, hidden, hidden // 64, 64, 0.125), precision, gpu.null, 132)
    program.run()
    lean = program._attention.qdo_half
    assert lean == (precision == "fp16" and program._attention.wgmma)
    half = precision == "fp16" and (half_in_fp16 or lean)
    assert program._kv0.dtype == (numpy.float16 if half else numpy.float32)
    assert program._kv0.shape == (shape[0] * shape[2], 2 * hidden)
    kv0 = [args for args in calls if _table_entries(program, args[13], 1)[0] == program._kv0.data.ptr]
    assert len(kv0) == (3 if precision == "fp32" else 1)  # fp32: three fp16 products
    assert {args[14] for args in kv0} == {R_16F if half else R_32F}
    assert _table_entries(program, kv0[0][13], 2)[1] == program._kv0.data.ptr + program._kv0.itemsize * hidden  # V0
    constant = program._constants.data.ptr + 8
    assert all((args[5] == constant) == half for args in kv0)
    for buffer in (program._q0, program._dout) if precision != "tf32" else ():  # (tf32: one batched GEMM)
        # the lean kernel's fp16 dO at that alpha; its Q0 + bq from cuBLASLt (below)
        writes = [args for args in calls if _table_entries(program, args[13], 1)[0] == buffer.data.ptr]
        assert buffer.dtype == (numpy.float16 if lean else numpy.float32)
        assert bool(writes) == (buffer is program._dout or not lean)
        assert {args[14] for args in writes} <= {R_16F if lean else R_32F}
        assert all((args[5] == constant) == lean for args in writes)
    from cupy_xattn.backward import _WQ, _X, _half_elements, _sm_shares
    from cupy_xattn.gemm import OP_N, OP_T
    q_bias, q_out = program._q_bias or (None, None)
    mv, mt = shape[0] * shape[1], shape[0] * shape[2]
    if lean:  # Q0 = X Wq^T + bq (column-major: Wq's copy first), with bq at Q0's scale, alpha and beta on the GPU
        x = program._halves.data.ptr
        wq = x + 2 * sum(_half_elements(mv, mt, hidden)[:2])
        assert [(args, target) for _, args, target in gpu.bias_gemms] == [(
            (OP_T, OP_N, hidden, mv, hidden, q_out.data.ptr, wq, hidden, x, hidden, program._constants.data.ptr,
             program._q0.data.ptr, hidden, q_bias.data.ptr), _sm_shares("fp16", mv, mt, hidden, 132)["q0"])]
    assert bool(gpu.bias_gemms) == lean
    if lean:  # the first group's rescale writes bq at Q0's scale, and Q0's alpha and scale, into them
        stage_a = program._scaler._groups[0].values
        assert stage_a[-6:] == [hidden, _X, _WQ, int(numpy.float32(attention_bwd.kv_half_alpha(hidden)).view(
            numpy.int32)), q_bias.data.ptr, q_out.data.ptr]
        assert q_bias.dtype == numpy.float16 and q_bias.size == hidden and q_out.dtype == numpy.float32
        # its sources are the eight tensors', then bq's
        copies = [e[3] for e in gpu if e[:2] == ("kernel", "half_copy_absmax")]
        assert _table_entries(program, int(copies[0][0]), 9)[-1] == "query_bias"
        (q_scale, inv_wo), = [e[3][-2:] for e in gpu if e[0] == "kernel" and e[1] == "attn_bwd_lean"]
        assert (int(q_scale), int(inv_wo)) == (q_out.data.ptr + 4, program._scaler.inverse_scale(backward._WO))
    # tf32: the streamed kernel reads an fp16 copy that a conversion makes of the fp32 [K0 | V0]
    converted = precision == "tf32" and shape[2] > 80
    assert (program._kv0_half is not None) == converted
    assert program._attention._main.defines["ATTN_KV_HALF"] == int(half or converted)
    labels = [label for label, _, lane in program._steps if "[K0 | V0]" in label and lane == 2]  # after its GEMM
    assert labels == (["[K0 | V0] to fp16", "fp16 rescale [K0 | V0]"] if converted else [])
    if (half or converted) and shape[2] > 80:  # shared memory for two fp16 key/value tiles, not the fp32 staging
        assert program._attention._smem_bytes == attention_bwd.kernel_choice(shape[2], precision, kv_half=True)[3]


@pytest.mark.parametrize("kv_half", [False, True])
def test_the_attention_refuses_a_k0_v0_of_the_other_dtype(gpu, kv_half):
    from cupy_xattn.attention_bwd import AttentionBackward
    from cupy_xattn.checks import Problem
    attention = AttentionBackward(Problem(2, 70, 81, 256, 4, 64, 0.125), "fp16", 132, o_half=True, kv_half=kv_half)
    f32 = lambda *shape: FakeArray(shape)  # noqa: E731
    kv0 = FakeArray((162, 512), numpy.float32 if kv_half else numpy.float16)
    with pytest.raises(ValueError, match="kv0 is float16 with kv_half"):
        attention(f32(140, 256), kv0, 0, f32(140, 256), FakeArray((140, 256), numpy.float16), f32(140, 256),
                  f32(162, 512), o_scales=(0,) * 6)


@pytest.mark.parametrize("qdo_scales", [None, (8, 16, 24), (8,)])
def test_the_lean_fp16_attention_takes_s_q_and_inv_wo(gpu, qdo_scales):
    # attn_bwd_lean's ATTN_QDO_HALF build reads Q0 + bq at the scale its GEMM wrote (s_Q) and dO at
    # [K0 | V0]'s alpha over Wo's copy (inv_wo): two addresses, no more, no fewer.
    from cupy_xattn.attention_bwd import AttentionBackward, half_qdo
    from cupy_xattn.checks import Problem
    problem = Problem(4, 512, 77, 1024, 16, 64, 0.125)
    assert half_qdo(problem, "fp16", 132)  # the fake GPU is an H200
    attention = AttentionBackward(problem, "fp16", 132, o_half=True, kv_half=True, qdo_half=True)
    f16 = lambda *shape: FakeArray(shape, numpy.float16)  # noqa: E731
    f32 = lambda *shape: FakeArray(shape)  # noqa: E731
    call = lambda scales: attention(f16(2048, 1024), f16(308, 2048), 0, f16(2048, 1024), f16(2048, 1024),  # noqa: E731
                                    f32(2048, 1024), f32(308, 2048), o_scales=(0,) * 6, qdo_scales=scales)
    with pytest.raises(ValueError, match=r"qdo_scales \(s_q, inv_wo\)"):
        call(qdo_scales)
    call((8, 16))
    launch, = [entry for entry in gpu if entry[:2] == ("kernel", "attn_bwd_lean")]
    assert [int(a) for a in launch[3][-2:]] == [8, 16]


@pytest.mark.parametrize("precision, kv_half, kv_scale", [("tf32", True, None), ("tf32", False, 64),
                                                           ("fp16", True, 64)])
def test_the_k0_v0_scale_address_goes_with_the_tf32_modes_fp16_k0_v0_only(gpu, precision, kv_half, kv_scale):
    from cupy_xattn.attention_bwd import AttentionBackward
    from cupy_xattn.checks import Problem
    o_half = precision == "fp16"
    attention = AttentionBackward(Problem(2, 70, 81, 256, 4, 64, 0.125), precision, 132, o_half=o_half, kv_half=kv_half)
    f32 = lambda *shape: FakeArray(shape)  # noqa: E731
    kv0 = FakeArray((162, 512), numpy.float16 if kv_half else numpy.float32)
    o = FakeArray((140, 256), numpy.float16) if o_half else f32(140, 256)
    with pytest.raises(ValueError, match="kv_scale"):
        attention(f32(140, 256), kv0, 0, f32(140, 256), o, f32(140, 256), f32(162, 512),
                  o_scales=(0,) * 6 if o_half else None, kv_scale=kv_scale)


@pytest.mark.parametrize("shape, o_transposed", [((2, 70, 77), False), ((2, 70, 77), True), ((2, 70, 81), True)])
def test_the_attention_writes_dq_t_beside_o_t_where_dq_is_whole(gpu, shape, o_transposed):
    # At D = 256: (2, 70, 77) runs the resident kernel (one key part); (2, 70, 81) the streamed one on
    # a grid small enough for dQ to come in key parts.
    from cupy_xattn.attention_bwd import AttentionBackward, launch_layout
    from cupy_xattn.checks import Problem
    problem = Problem(*shape, 256, 4, 64, 0.125)
    whole = launch_layout(problem, "tf32", 132).kv_parts == 1
    assert whole == (shape[2] == 77)
    if not (o_transposed and whole):
        with pytest.raises(ValueError, match="dQ\\^T is written beside O\\^T"):
            AttentionBackward(problem, "tf32", 132, o_transposed=o_transposed, dq_transposed=True)
        return
    attention = AttentionBackward(problem, "tf32", 132, o_transposed=True, dq_transposed=True)
    assert attention._main.defines["ATTN_DQ_TRANSPOSED"] == 1
    f32 = lambda *shape: FakeArray(shape)  # noqa: E731
    args = f32(140, 256), f32(154, 512), 0, f32(140, 256), f32(256, 160), f32(140, 256), f32(154, 512)
    for dq_t, dq_sums in ((None, None), (64, None), (None, 64)):
        with pytest.raises(ValueError, match="dq_t and dq_sums go with dq_transposed"):
            attention(*args, dq_t=dq_t, dq_sums=dq_sums)
    plain = AttentionBackward(problem, "tf32", 132, o_transposed=True)
    assert plain._main.defines["ATTN_DQ_TRANSPOSED"] == 0
    with pytest.raises(ValueError, match="dq_t and dq_sums go with dq_transposed"):
        plain(*args, dq_t=64, dq_sums=64)


@pytest.mark.parametrize("hidden", [1, 2, 64, 1000, 1024, 1025, 5120])
def test_the_fp16_k0_v0_alpha_keeps_every_sum_of_copies_under_2_to_the_14(hidden):
    from cupy_xattn.attention_bwd import kv_half_alpha
    worst = hidden * 2.0 ** 30 * kv_half_alpha(hidden)  # D products of two elements of at most 2^15
    assert 2.0 ** 13 < worst <= 2.0 ** 14


@pytest.mark.parametrize("shape, precision, o_half", [((2, 70, 80), "tf32", False), ((2, 70, 81), "fp32", True),
                                                      ((2, 70, 81), "fp16", False), ((2, 4096, 77), "fp16", True)])
def test_an_fp16_k0_v0_is_only_where_half_kv_says(gpu, monkeypatch, shape, precision, o_half):
    from cupy_xattn.attention_bwd import AttentionBackward
    from cupy_xattn.checks import Problem
    # An sm_80 GPU: no lean kernel (half_qdo), whose fp16 mode takes an fp16 [K0 | V0] everywhere.
    monkeypatch.setattr(sys.modules["cupy"].cuda, "Device", lambda *a: types.SimpleNamespace(compute_capability="80"))
    with pytest.raises(ValueError, match="fp16 \\[K0"):
        AttentionBackward(Problem(*shape, 1024, 16, 64, 0.125), precision, 132, o_half=o_half, kv_half=True)


@pytest.mark.parametrize("block_kv_text, head_dim", [(100, 64), (300, 64), (300, 128)])
def test_the_fp16_k0_v0_tiles_take_less_shared_memory_than_the_fp32_staging(block_kv_text, head_dim):
    # Two fp16 key/value tiles of (head_dim + 8) operands a row in place of the staging's fp32 tile
    from cupy_xattn.attention_bwd import kernel_choice, streamed_block_kv
    staged = kernel_choice(block_kv_text, "fp16", head_dim)[3]
    copied = kernel_choice(block_kv_text, "fp16", head_dim, kv_half=True)[3]
    kv = streamed_block_kv(block_kv_text, "fp16", head_dim)
    assert staged - copied == 4 * 2 * kv * head_dim - 2 * 2 * kv * (head_dim + 8)


@pytest.mark.parametrize("precision", ["tf32", "fp16", "fp32"])
@pytest.mark.parametrize("shape", [(2, 70, 20), (2, 64, 77), (3, 33, 31), (8, 300, 77), (4, 257, 300)])
def test_every_ones_row_gemm_stays_within_the_ones_row(gpu, monkeypatch, precision, shape):
    from cupy_xattn import backward
    from cupy_xattn.checks import Problem
    calls = _recording_cublas(monkeypatch)
    d = 1024 if shape[:2] in ((2, 64), (3, 33)) else 256  # D = 1024: dY's 128 partial rows (> B·Nv = 99 at 3x33)
    program = backward.Backward(Problem(*shape, d, d // 64, 64, 0.125), precision, gpu.null, 132)
    program.run()
    sums = [args for args in calls if args[3] == 1]  # cuBLAS's n = 1: the ones row, K long
    assert len(sums) >= 2 and all(args[4] <= program._ones.size for args in sums)


def test_column_sum_grids_keep_every_thread_on_its_columns():
    from cupy_xattn.half_scaling import _THREADS, _blocks, column_sum_rows
    for sizes, sum_cols in (([12 * 60, 20 * 60], [12, 20]), ([192 * 1000, 320 * 1000], [192, 320]),
                            ([1024 * 8192] * 3, [1024, 1024, 2048]), ([1536 * 77], [1536])):
        blocks = _blocks(sizes, sum_cols, 132)
        assert all(blocks * _THREADS % (cols // 4) == 0 for cols in sum_cols), (sum_cols, blocks)
        assert column_sum_rows(sizes, sum_cols, 132) == [4 * blocks * _THREADS // cols for cols in sum_cols]


def test_copy_grids_give_each_thread_eight_float4s_up_to_two_blocks_per_sm():
    from cupy_xattn.half_scaling import _blocks
    assert _blocks([1024 * 1024, 1024], [], 132) == 128  # a weight: 2^18 float4s at 2^11 a block
    assert _blocks([1024 * 8192, 1024 * 1024], [], 132) == 264
    assert _blocks([1024 * 616], [1024], 132) == 77


@pytest.mark.parametrize("mv, mt, expected", [(8192, 4928, (True, True)), (4096, 616, (True, True)),
                                               (2048, 308, (True, True)), (2048, 154, (True, False)),
                                               (1024, 1172, (True, True)), (512, 422, (False, False)),
                                               (512, 1200, (False, True)), (512, 77, (False, False))])
def test_tf32_weight_gradient_pairs_read_transposes_by_the_measured_rule(mv, mt, expected):
    from cupy_xattn.backward import _weight_grads_tn
    assert _weight_grads_tn("tf32", mv, mt) == expected
    assert _weight_grads_tn("fp16", mv, mt) == _weight_grads_tn("fp32", mv, mt) == (False, False)


def test_the_attention_writes_dq_t_on_the_suite_cases_with_long_samples(gpu):
    # Session 28's A/B: dQ^T from the attention gained on Nv ≥ 1024 and lost elsewhere.
    from cupy_xattn import cases
    from cupy_xattn.backward import _dq_transposed
    from cupy_xattn.checks import Problem
    writes = {(c.batch_size, c.num_video_tokens, c.num_text_tokens) for c in cases.load_suite("sol-execbench")
              if _dq_transposed(Problem(c.batch_size, c.num_video_tokens, c.num_text_tokens, 1024, 16, 64, 0.125),
                                "tf32", 132)}
    assert writes == {(1, 4096, 77), (2, 4096, 77), (2, 2048, 77), (2, 1024, 77)}
    big = Problem(2, 4096, 77, 1024, 16, 64, 0.125)
    assert not _dq_transposed(big, "fp16", 132) and not _dq_transposed(big, "fp32", 132)


def test_transposed_copies_that_would_overlap_are_refused(gpu):
    from cupy_xattn.transpose import Transposed
    Transposed(0, 3, 0, 10, 4, ld=30, dst_step=10)  # side by side
    Transposed(0, 3, 0, 10, 4, ld=16, dst_step=64)  # apart: [4][16] blocks
    for ld, dst_step in ((29, 10), (30, 9), (10, 10), (16, 63)):
        with pytest.raises(ValueError, match="overlap"):
            Transposed(0, 3, 0, 10, 4, ld=ld, dst_step=dst_step)


def test_a_failed_step_still_joins_the_lanes_and_orders_the_callers_stream(gpu):
    import cupy_xattn
    from cupy_xattn import _cublas
    plan = cupy_xattn.plan(2, 70, 20, hidden_size=128, num_heads=2)
    inputs = _inputs()
    plan(**inputs)
    (program, _), = plan._programs.values()
    main, side1, side2 = (lane.ptr for lane in program._lanes)
    gpu.fail_on_stream = side2
    mark = len(gpu)
    with pytest.raises(_cublas.CublasError):
        plan._run_direct(program, gpu.null)
    entries = gpu[mark:]
    failed_at = entries.index(("failed gemm", side2))
    after = {side: [i for i in _waits_for(entries, main, side) if i > failed_at] for side in (side1, side2)}
    assert all(after.values()), after  # the main lane waits for both side lanes after the failure ...
    joined = max(waits[0] for waits in after.values())
    assert any(i > joined for i in _waits_for(entries, gpu.null.ptr, main))  # ... and the caller's stream for it


def test_only_capture_refusals_leave_a_plan_uncaptured(gpu, monkeypatch):
    import cupy_xattn
    plan = cupy_xattn.plan(2, 70, 20, hidden_size=128, num_heads=2)

    def end_capture_out_of_memory(self):
        self.capturing = False
        raise FakeRuntimeError(2)  # cudaErrorMemoryAllocation
    monkeypatch.setattr(FakeStream, "end_capture", end_capture_out_of_memory)
    with pytest.raises(FakeRuntimeError):
        plan(**_inputs())
    assert not plan._programs  # nothing marked uncaptured: the next call tries again


@pytest.mark.parametrize("nt, precision, head_dim, block_kv", [
    (293, "tf32", 64, 64), (373, "fp16", 64, 64), (512, "tf32", 64, 64), (300, "tf32", 64, 64),
    (211, "tf32", 64, 32),   # 4 tiles of 64 would be 32 padded keys more than 7 of 32
    (81, "tf32", 64, 32), (373, "fp32", 64, 32), (512, "tf32", 128, 32)])  # the split and head_dim 128 would spill
def test_streamed_key_tiles_are_wide_where_they_add_no_padding(nt, precision, head_dim, block_kv):
    from cupy_xattn import attention_bwd
    assert attention_bwd.streamed_block_kv(nt, precision, head_dim) == block_kv
    name, keys, rows, smem, blocks = attention_bwd.kernel_choice(nt, precision, head_dim)
    assert (name, keys, rows) == ("attn_bwd", 0, 64)
    # Q, dO, K, V tiles of head_dim + 8 operands a row, P of block_kv + 8 (attn_bwd's carve-up): fp32
    # operands in the fp32 mode; fp16 in the others, plus a dS tile beside P and the next K and V
    # tiles staged as fp32.
    operands = {(64, 64): 23040, (64, 32): 16384, (128, 32): 2 * 64 * 136 + 2 * 32 * 136 + 64 * 40}[head_dim, block_kv]
    staged, ds = 2 * block_kv * head_dim, 64 * (block_kv + 8)
    assert smem == (4 * operands if precision == "fp32" else 2 * (operands + ds) + 4 * staged)
    assert blocks == (3 if (precision, head_dim, block_kv) == ("tf32", 64, 32) else 2)


@pytest.mark.parametrize("shape, hidden, heads, precision, split", [
    ((2, 256, 77), 1024, 16, "tf32", 2), ((1, 512, 77), 1024, 16, "fp16", 2),  # 128 blocks: one tile an SM
    ((2, 70, 20), 128, 2, "tf32", 2),
    ((2, 691, 77), 1024, 16, "tf32", 1), ((64, 128, 77), 1024, 16, "fp16", 1),  # more blocks than SMs
    ((2, 64, 77), 1024, 16, "fp32", 1),  # 3xTF32 operands: no split
    ((2, 256, 211), 1024, 16, "tf32", 1)])  # streamed
def test_resident_keys_are_split_where_the_grid_has_one_block_an_sm(shape, hidden, heads, precision, split):
    from cupy_xattn import attention_bwd
    from cupy_xattn.checks import Problem
    problem = Problem(*shape, hidden, heads, 64, 0.125)
    name, keys, rows, smem, blocks, n_chunks, tiles, got, kv_parts = attention_bwd.launch_layout(problem, precision,
                                                                                              132)
    assert got == split and (kv_parts == 1 or not keys)
    if split > 1:  # keys padded to whole 16-key tiles per warp, one block of 8 warps per SM
        assert keys % 32 == 0 and shape[2] <= keys < shape[2] + 32 and blocks == 1
        assert shape[0] * heads * n_chunks <= 132 and tiles == 1
        assert (name, keys, rows, smem, blocks) == attention_bwd.kernel_choice(shape[2], precision, 64, split)


@pytest.mark.parametrize("shape, precision, kv_parts", [
    ((2, 256, 211), "tf32", 2), ((2, 256, 211), "fp16", 2),  # 128 blocks: 256 of 264 (2 an SM, of 3)
    ((2, 256, 211), "fp32", 2),  # 2 an SM: 256 of 264
    ((4, 256, 293), "tf32", 1), ((4, 256, 293), "fp16", 1),  # 256 blocks (64-key tiles, 2 an SM): 512 > 264
    ((8, 256, 373), "fp32", 1),  # 256 blocks fill the 264 slots
    ((2, 256, 77), "tf32", 1),  # resident: none
    ((1, 100, 512), "fp16", 8), ((1, 100, 512), "fp32", 8),  # 32 blocks: up to the most (8 key tiles of 64, 16 of 32)
    ((1, 100, 96), "fp16", 3), ((1, 256, 160), "tf32", 4)])  # 32 blocks, 3 key tiles; 64 blocks
def test_the_streamed_kernel_splits_its_keys_where_its_grid_leaves_sms_idle(shape, precision, kv_parts):
    from cupy_xattn import attention_bwd
    from cupy_xattn.checks import Problem
    layout = attention_bwd.launch_layout(Problem(*shape, 1024, 16, 64, 0.125), precision, 132)
    name, keys, rows, smem, blocks_per_sm, n_chunks, tiles, key_split, got = layout
    assert got == kv_parts
    if not keys:  # the most parts whose grids fit two blocks an SM
        blocks, slots = shape[0] * 16 * n_chunks, 132 * min(blocks_per_sm, 2)
        assert kv_parts * blocks <= slots
        assert kv_parts == attention_bwd.STREAMED_KV_PARTS or (kv_parts + 1) * blocks > slots or (
            kv_parts == -(-shape[2] // attention_bwd.streamed_block_kv(shape[2], precision)))


def test_key_parts_only_where_a_chunk_is_one_query_tile(monkeypatch):
    # 1x100x512 takes eight parts at one tile a chunk; with its two query tiles in one chunk, none.
    from cupy_xattn import attention_bwd
    from cupy_xattn.checks import Problem
    problem = Problem(1, 100, 512, 1024, 16, 64, 0.125)
    assert attention_bwd.launch_layout(problem, "fp16", 132)[5:] == (2, 1, 1, 8)
    monkeypatch.setattr(attention_bwd, "chunking", lambda *args, **kw: (1, 2))
    assert attention_bwd.launch_layout(problem, "fp16", 132)[5:] == (1, 2, 1, 1)


@pytest.mark.parametrize("precision", ["tf32", "fp16", "fp32"])
def test_streamed_key_parts_leave_dq_in_parts_summed_once(gpu, monkeypatch, precision):
    # B, Nv, Nt, D = 2, 70, 81, 128: 8 blocks of the streamed kernel, each query chunk three (one a
    # key tile). tf32 sums dQ's parts into dQ with the reduction kernel; the half modes' conversion
    # sums them as it reads them, and there is no fp32 dQ.
    from cupy_xattn import backward
    from cupy_xattn.checks import Problem
    program = backward.Backward(Problem(2, 70, 81, 128, 2, 64, 0.125), precision, gpu.null, 132)
    entries, _ = _lane_run(gpu, program)
    attention = program._attention
    parts = attention.dq_partials
    assert attention.kv_parts == 3 and attention._main.defines["ATTN_KV_PARTS"] == 3 and parts.shape == (3, 140, 128)
    (attn_args,), sums = ([e[3] for e in entries if e[:2] == ("kernel", name)] for name in ("attn_bwd", "attn_sum_parts"))
    assert attn_args[5] is parts  # the kernel's dq
    dq_sums = [args for args in sums if args[0] is parts]
    if precision == "tf32":
        (args,) = dq_sums
        assert args[1] is program._dq and (int(args[2]), int(args[3])) == (140 * 128 // 4, 3)
        return
    assert dq_sums == [] and program._dq.size == 0
    stage_b = program._scaler._groups[1].values
    n = _unbiased_group_size(stage_b)
    assert stage_b[5 * n] == 3 and stage_b[6 * n] == 140 * 128 // 4  # dQ's entry: three parts, 140 · 128 apart
    copies = [e[3] for e in entries if e[:2] == ("kernel", "half_copy_absmax")]
    assert _table_entries(program, int(copies[1][0]), n)[0] == parts.data.ptr


@pytest.mark.parametrize("pairs, n_video, blocks_per_sm, expected", [
    ((8, 16), 512, 2, (2, 4)),     # 8x512x77: 256 blocks of 4 tiles in one wave, not 384 of 3 in two
    ((4, 16), 853, 2, (4, 4)),     # 4x853x77: 256 blocks of 4 tiles, not 320 of 3 (1.2 waves)
    ((64, 16), 128, 2, (1, 2)),    # 1024 pairs: no split (3.9 waves of whole pairs)
    ((1, 16), 4096, 2, (16, 4)),   # 256 blocks of 4 tiles: one wave
    ((2, 16), 256, 1, (4, 1)),     # one tile a block, 128 blocks
    ((1, 40), 1560, 2, (13, 2)),   # Wan2.2: 520 blocks of 2 tiles (2 waves), not 280 of 4 (2 waves)
    ((8, 40), 512, 2, (1, 8))])    # 320 pairs fill the 264 slots: no split (each chunk a 160 MiB partial)
def test_query_chunks_minimise_waves_times_block_length(pairs, n_video, blocks_per_sm, expected):
    from cupy_xattn.attention_bwd import chunking
    assert chunking(*pairs, n_video, 132, blocks_per_sm) == expected


@settings(max_examples=500, deadline=None)
@given(st.integers(1, 128), st.integers(1, 64), st.integers(1, 40000), st.integers(1, 4), st.integers(1, 170))
def test_query_chunks_cover_every_tile_once(batch, heads, n_video, blocks_per_sm, sm_count):
    from cupy_xattn.attention_bwd import chunking
    n_chunks, tiles = chunking(batch, heads, n_video, sm_count, blocks_per_sm)
    n_tiles = -(-n_video // 64)
    assert (n_chunks - 1) * tiles < n_tiles <= n_chunks * tiles  # no chunk empty, none past the last tile
    if batch * heads >= blocks_per_sm * sm_count:
        assert n_chunks == 1


@pytest.mark.parametrize("shape, precision, capability, wgmma", [
    ((64, 128, 77), "fp16", "90", True), ((2, 691, 77), "tf32", "90", True),
    ((64, 128, 77), "fp16", "80", False), ((64, 128, 77), "fp32", "90", False),  # sm_80; fp32 operands
    ((2, 256, 77), "fp16", "90", False), ((8, 256, 373), "fp16", "90", False)])  # keys split; streamed
def test_the_resident_kernel_runs_on_wgmma_on_sm_90_with_fp16_operands(shape, precision, capability, wgmma):
    from cupy_xattn import attention_bwd
    from cupy_xattn.checks import Problem
    layout = attention_bwd.launch_layout(Problem(*shape, 1024, 16, 64, 0.125), precision, 132)
    assert attention_bwd.uses_wgmma(layout, precision, capability) == wgmma
    if wgmma:  # unpadded core-matrix tiles: K, V [80][64], Q, dO [64][64], P, dS [64][80], fp16
        smem = attention_bwd.kernel_choice(shape[2], precision, 64, 1, wgmma=True)[3]
        assert smem == 2 * (2 * 80 * 64 + 2 * 64 * 64 + 2 * 64 * 80)


@pytest.mark.parametrize("shape, lean", [
    ((64, 128, 77), True), ((32, 128, 77), True),  # the pairs fill the slots: several waves of two-tile blocks
    ((2, 4096, 77), True), ((8, 512, 77), True), ((4, 853, 77), True),  # blocks of eight, four tiles
    ((2, 512, 77), False), ((4, 512, 77), False), ((2, 691, 77), False), ((2, 1024, 77), False)])  # one, two
def test_the_tf32_modes_lean_kernel_is_where_blocks_are_long_or_the_grid_is_full(shape, lean):
    # perf-notes v64: attn_bwd_lean lost 1–3 µs on one-wave grids of one- and two-tile blocks
    from cupy_xattn import attention_bwd
    from cupy_xattn.checks import Problem
    problem = Problem(*shape, 1024, 16, 64, 0.125)
    layout = attention_bwd.launch_layout(problem, "tf32", 132)
    assert attention_bwd.uses_wgmma(layout, "tf32", "90")
    assert attention_bwd.lean_tf32(problem, layout, 132) == lean


def test_resident_keys_are_not_split_with_128_row_tiles(monkeypatch):
    from cupy_xattn import attention_bwd
    from cupy_xattn.checks import Problem
    monkeypatch.setattr(attention_bwd, "RESIDENT_BLOCK_Q", 128)  # 16 warps would not divide the head-dim tiles
    assert attention_bwd.launch_layout(Problem(2, 256, 77, 1024, 16, 64, 0.125), "tf32", 132)[7] == 1


@pytest.mark.parametrize("precision, o_transposed", [("tf32", False), ("fp32", True), ("fp16", True)])
def test_an_fp16_o_is_only_for_the_half_modes_row_major(precision, o_transposed):
    from cupy_xattn.attention_bwd import AttentionBackward
    from cupy_xattn.checks import Problem
    with pytest.raises(ValueError, match="fp16 O"):
        AttentionBackward(Problem(2, 70, 20, 128, 2, 64, 0.125), precision, 132, o_transposed=o_transposed, o_half=True)


@pytest.mark.parametrize("found", [1, 0])
def test_a_cublaslt_bias_gemm_describes_its_product_and_runs_it_on_its_stream(monkeypatch, found):
    # Handle.bias_gemm: column-major d = alpha · op(a) op(b) + bias over fp16, fp32 accumulation,
    # alpha and beta device pointers; a's layout is the stored one (k × m when op(a) is a^T), the
    # SM target and the bias go to the descriptor, the workspace to the preference and the call.
    from types import SimpleNamespace

    from cupy_xattn import _cublas
    from cupy_xattn.gemm import COMPUTE_32F, OP_N, OP_T, R_16F, R_32F
    calls, handles = [], iter(range(100, 200))

    class FakeLt:
        def __getattr__(self, name):
            def call(*args):
                if name.endswith("Create"):
                    args[0]._obj.value = next(handles)
                if name == "cublasLtMatmulAlgoGetHeuristic":
                    args[-1]._obj.value = found
                plain = [getattr(getattr(a, "_obj", a), "value", getattr(a, "_obj", a)) for a in args]
                calls.append((name, plain))
                return 0
            return call

    monkeypatch.setattr(_cublas, "lt_library", FakeLt)
    monkeypatch.setattr(_cublas, "lt_handle", lambda: "lt")
    stream, workspace = SimpleNamespace(ptr=7), SimpleNamespace(nbytes=1 << 20, data=SimpleNamespace(ptr=4096))
    args = (OP_T, OP_N, 64, 512, 128, 11, 12, 128, 13, 128, 14, 15, 64, 16)  # m, n, k; alpha, a, lda, b, ...
    if not found:
        with pytest.raises(_cublas.CublasError, match="no algorithm"):
            _cublas.LtMatmul(stream, workspace, *args, 44)
        return
    gemm = _cublas.LtMatmul(stream, workspace, *args, 44)
    assert ("cublasLtMatmulDescCreate", [100, COMPUTE_32F, R_32F]) in calls
    attributes = {v[1]: v[2] for n, v in calls if n == "cublasLtMatmulDescSetAttribute"}
    assert attributes == {2: _cublas.POINTER_MODE_DEVICE, 3: OP_T, 4: OP_N, 15: 44, 7: 4, 8: 16}
    layouts = [v[1:] for n, v in calls if n == "cublasLtMatrixLayoutCreate"]
    assert layouts == [[R_16F, 128, 64, 128], [R_16F, 128, 512, 128], [R_16F, 64, 512, 64]]  # a^T: k × m
    assert [v[1:] for n, v in calls if n == "cublasLtMatmulPreferenceSetAttribute"][0][:1] == [1]
    calls.clear()
    gemm()
    (name, values), = calls
    assert name == "cublasLtMatmul"
    assert values[2:10] == [11, 12, 101, 13, 102, 14, 15, 103] and values[10:12] == [15, 103]
    assert values[-3:] == [4096, 1 << 20, 7]  # the workspace and the stream


@pytest.mark.parametrize("n_slots", [0, 257])
def test_a_scaler_holds_1_to_256_slots(n_slots):
    from cupy_xattn.half_scaling import HalfScaler
    with pytest.raises(ValueError, match="slots"):
        HalfScaler(n_slots, 132)


@pytest.mark.parametrize("tensor, match", [((8, 0, 0, 0, 0), "a tensor is"), ((8, 0, 0, 0, 0, 0, 1), "a tensor is"),
                                           ((6, 0, 0, 0, 0, 0), "multiples of 4"),
                                           ((8, 0, 0, 0, 0, 0, 0, 0), "at least one part")])
def test_a_scaler_group_rejects_malformed_tensors(tensor, match):
    from cupy_xattn.half_scaling import HalfScaler
    scaler = HalfScaler.__new__(HalfScaler)  # the checks come before any GPU work
    scaler.n_slots = 1
    with pytest.raises(ValueError, match=match):
        scaler.group(0, [tensor])


@pytest.mark.parametrize("bias, match", [((0, 0, 1, 2.0 ** -26, 8, 8), "positive even length"),
                                         ((1023, 0, 1, 2.0 ** -26, 8, 8), "positive even length"),
                                         ((1024, 0, 2, 2.0 ** -26, 8, 8), "two slots of the group's"),
                                         ((1024, -1, 1, 2.0 ** -26, 8, 8), "two slots of the group's"),
                                         ((1024, 0, 1, 3.0 * 2.0 ** -26, 8, 8), "power of two"),
                                         ((1024, 0, 1, 0.0, 8, 8), "power of two"),
                                         ((1024, 0, 1, 2.0 ** -127, 8, 8), "normal range"),
                                         ((1024, 0, 1, 2.0 ** -26, 0, 8), "4-byte aligned"),
                                         ((1024, 0, 1, 2.0 ** -26, 8, 6), "4-byte aligned")])
def test_a_scaler_group_rejects_a_malformed_product_bias(bias, match):
    # write_product_bias takes pairs of elements, two of its group's slots (whose new scales its
    # rescale knows), alpha's exponent only, and writes fp16 pairs and two floats.
    from cupy_xattn.half_scaling import HalfScaler
    scaler = HalfScaler.__new__(HalfScaler)
    scaler.n_slots = 3
    with pytest.raises(ValueError, match=match):
        scaler.group(0, [(8, 0, 0, 0, 0, 0), (8, 0, 1, 0, 0, 0)], product_bias=bias)


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_dwo_runs_beside_the_second_conversion(gpu, precision):
    """dWo = dY^T O reads the attention's fp16 O (fp32: and its remainder) and the first conversion's
    dY, so it is forked onto lane 2 right after the attention (its alpha written by the attention)."""
    from cupy_xattn import backward
    from cupy_xattn.checks import Problem
    program = backward.Backward(Problem(2, 70, 20, 128, 2, 64, 0.125), precision, gpu.null, 132)
    steps = [(label, lane) for label, _, lane in program._steps]
    attention = steps.index(("attention", 0))
    second_copy = next(i for i in range(attention, len(steps)) if steps[i][0].startswith("to fp16"))
    parts = [""] if precision == "fp16" else [" lo·hi", " hi·lo", " hi·hi"]
    expected = [("fork", 0)] + [("gemm 128x128x140" + part, 2) for part in parts]
    assert steps[attention + 1:second_copy] == expected


def test_every_cublas_call_sets_its_sm_target_first_zero_by_default(monkeypatch):
    # A cuBLAS handle keeps its SM count target: each GEMM must set its own (0: the default, all
    # SMs) right before it, or it would inherit the previous product's.
    from types import SimpleNamespace

    from cupy_xattn import _cublas
    calls = []

    class FakeLibrary:
        def __getattr__(self, name):
            return lambda *args: calls.append((name, args[1] if name == "cublasSetSmCountTarget" else None)) or 0

    fake_cupy = SimpleNamespace(uint8="uint8", empty=lambda n, dtype: SimpleNamespace(data=SimpleNamespace(ptr=64)))
    monkeypatch.setattr(_cublas, "_library", FakeLibrary)
    monkeypatch.setattr(_cublas, "import_cupy", lambda: fake_cupy)
    handle = _cublas.Handle(SimpleNamespace(ptr=1))
    calls.clear()
    gemm = (0, 0, 8, 8, 8, 0, 0, 0, 8, 0, 0, 8, 0, 0, 0, 8, 1, 0)
    handle.gemm_batched(*gemm, sm_target=44)
    handle.gemm_batched(*gemm)
    assert calls == [("cublasSetSmCountTarget", 44), ("cublasGemmBatchedEx", None),
                     ("cublasSetSmCountTarget", 0), ("cublasGemmBatchedEx", None)]
