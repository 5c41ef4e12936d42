"""Plans and the backward's recording, run on a fake CuPy without a GPU.

The fake records what would reach the GPU (kernel launches, cuBLAS calls, copies, events), so
the orchestration — steps, pointer table, first run and capture, replay, scale eviction,
stream ordering, device checks, the uncaptured fallback — is tested in CI. The numbers are the
GPU tests' business (tests/test_gpu_*.py).
"""
import itertools
import sys
import types

import numpy
import pytest

_addresses = itertools.count(1 << 32, 1 << 24)  # 16 MiB apart, 16-byte aligned


class FakeArray:
    """What the library reads of a CuPy array."""

    def __init__(self, shape, dtype=numpy.float32, ptr=None, device=0):
        self.shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        self.dtype = numpy.dtype(dtype)
        self.size = int(numpy.prod(self.shape))
        self.nbytes = self.size * self.dtype.itemsize
        self.data = types.SimpleNamespace(ptr=next(_addresses) if ptr is None else ptr, device_id=device)
        self._c_contiguous = True
        self.ndim = len(self.shape)

    def __getitem__(self, rows):  # rows of a C-contiguous array (wkv_h[:d], buffer[1:])
        start, stop, _ = rows.indices(self.shape[0])
        row_bytes = self.nbytes // self.shape[0]
        return FakeArray((stop - start,) + self.shape[1:], self.dtype, self.data.ptr + start * row_bytes)

    def reshape(self, *shape):
        return FakeArray(shape[0] if len(shape) == 1 else shape, self.dtype, self.data.ptr)


class FakeEvent:
    pass


class FakeStream:
    def __init__(self, log, ptr):
        self.log, self.ptr, self.capturing = log, ptr, False

    def record(self):
        event = FakeEvent()
        self.log.append(("record", self.ptr, event))
        return event

    def wait_event(self, event):
        self.log.append(("wait", self.ptr, event))

    def begin_capture(self):
        self.capturing = True

    def end_capture(self):
        self.capturing = False
        if self.log.invalidated:
            self.log.invalidated = False
            raise FakeRuntimeError("cudaErrorStreamCaptureInvalidated")
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
    pass


class Log(list):
    """Everything the fake GPU was asked to do, in order."""

    def __init__(self):
        super().__init__()
        self.current, self.invalidated, self.device, self.refuse_in_capture = [], False, 0, False

    def count(self, kind):
        return sum(1 for entry in self if entry[0] == kind)


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

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    runtime = types.SimpleNamespace(
        getDevice=lambda: log.device,
        getDeviceProperties=lambda device: {"multiProcessorCount": 132},
        memcpyAsync=lambda dst, src, size, kind, stream: log.append(("copy", stream, dst, size)),
        memsetAsync=lambda ptr, value, size, stream: log.append(("memset", stream)))
    cuda = types.SimpleNamespace(
        Stream=lambda non_blocking=False: FakeStream(log, next(streams)), get_current_stream=get_current_stream,
        Device=Device, runtime=runtime)
    fake = types.SimpleNamespace(
        ndarray=FakeArray, cuda=cuda, is_available=lambda: True, float16=numpy.float16, uint8=numpy.uint8,
        empty=lambda shape, dtype=numpy.float32: FakeArray(shape, dtype),
        zeros=lambda shape, dtype=numpy.float32: FakeArray(shape, dtype),
        ones=lambda shape, dtype=numpy.float32: FakeArray(shape, dtype),
        array=lambda values, dtype: FakeArray(len(values), dtype))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    runtime_module = types.ModuleType("cupy_backends.cuda.api.runtime")
    runtime_module.CUDARuntimeError = FakeRuntimeError
    monkeypatch.setitem(sys.modules, "cupy_backends.cuda.api.runtime", runtime_module)

    from cupy_xattn import _cublas, backward, kernels, plans

    class FakeKernel:
        max_dynamic_shared_size_bytes = 0
        preferred_shared_memory_carveout = -1

        def __init__(self, name):
            self.name = name

        def __call__(self, grid, block, args, shared_mem=0):
            log.append(("kernel", self.name, get_current_stream().ptr))

    class FakeHandle:
        def __init__(self, stream):
            self.stream = stream

        def gemm_batched(self, *args):
            if log.refuse_in_capture and self.stream.capturing:
                log.invalidated = True
                raise _cublas.CublasError("refused during capture")
            log.append(("gemm", args[-2]))  # batch count

    monkeypatch.setattr(kernels, "get_kernel", lambda filename, name, defines=None: FakeKernel(name))
    monkeypatch.setattr(backward._cublas, "Handle", FakeHandle)
    monkeypatch.setattr(plans, "_cache", type(plans._cache)())
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


# Kernels: the attention and its dK|dV chunk reduction (70 rows = 2 query tiles, split in 2);
# fp16 adds absmax, convert and alphas for each of its two groups of tensors.
@pytest.mark.parametrize("precision, gemms, kernels", [("tf32", 10, 2), ("fp32", 10, 2), ("fp16", 11, 8)])
def test_first_call_runs_then_captures_later_calls_replay(gpu, precision, gemms, kernels):
    import cupy_xattn
    plan = cupy_xattn.plan(2, 70, 20, hidden_size=128, num_heads=2, precision=precision)
    out = plan(**_inputs())
    assert len(out) == 10 and out.grad_text_embeddings.shape == (2, 20, 128)
    # Direct run plus the capture: every step issued twice, nothing replayed yet.
    assert _run_counts(gpu) == {"gemm": 2 * gemms, "kernel": 2 * kernels, "graph": 0, "copy": 1}
    mark = len(gpu)
    plan(**_inputs(), out=out)
    assert _run_counts(gpu, mark) == {"gemm": 0, "kernel": 0, "graph": 1, "copy": 1}


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
    assert _run_counts(gpu, mark) == {"gemm": 10, "kernel": 1, "graph": 0, "copy": 1}


def test_misaligned_inputs_leave_the_fast_path(gpu):
    from cupy_xattn import checks
    inputs = _inputs()
    shifted = dict(inputs, query_bias=FakeArray((128,), ptr=inputs["query_bias"].data.ptr + 4))
    kwargs = dict(scale=None, num_heads=2, precision="tf32", backend="cupy", out=None)
    assert checks.fast_validate(tuple(inputs.values()), **kwargs) is not None
    assert checks.fast_validate(tuple(shifted.values()), **kwargs) is None
