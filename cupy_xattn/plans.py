"""Plans: the backward of one shape, captured once into a CUDA graph and replayed per call.

On a slow host a CuPy call costs 10–40 µs and the backward is 11–17 steps (fp16: ~16, fp32: ~31) of
one or more launches, so issuing them one by one costs more than the GPU work on small shapes. A plan
records the steps once (``backward.Backward``), runs them directly on its first call, captures
them into a CUDA graph, and from then on costs one small host-to-device copy (the pointer table
with the new arrays' addresses) and one graph launch per call. The caller's arrays are read
where they are: no staging copies (the fp16 mode's scaled fp16 operands are its own work).

``cross_attention_backward`` keeps a small LRU cache of plans, keyed by shape, precision,
device and stream, so plain callers get the same replay.
"""

import collections
import contextlib
import math
import threading

import numpy

from ._cupy import import_cupy, require_gpu
from .backward import Backward
from . import checks, graphs
from .checks import PRECISIONS, Problem
from .grads import CrossAttentionGrads

#: plans kept by ``cross_attention_backward`` (each holds its intermediates on the GPU).
CACHE_SIZE = 8
#: scales one plan keeps a recording and graph for (the scale is baked into the attention launch).
SCALES_PER_PLAN = 2
_UNCAPTURED = "uncaptured"  # the graph slot of a plan that cuBLAS would not let us capture
# cudaErrorStreamCaptureUnsupported, cudaErrorStreamCaptureInvalidated: what a library call that
# may not be captured leaves at the end of the capture.
_CAPTURE_REFUSED = (900, 901)
_FLOAT32 = numpy.dtype(numpy.float32)  # cupy.ndarray takes a dtype object faster than numpy.float32


class Plan:
    """``cross_attention_backward`` for one (B, Nv, Nt) shape, replayed from a CUDA graph.

    Create with :func:`plan`. Calling it takes the arguments of ``cross_attention_backward``
    (CuPy float32 arrays of the plan's shape; anything else, and any call with ``text_lengths``,
    which are checked on the host and written by a second small copy, goes through full
    validation and conversion first) and returns a ``CrossAttentionGrads`` of CuPy arrays (NumPy when every
    input is NumPy, as ``cross_attention_backward``), bitwise equal to the first (uncaptured) run of
    the same steps. Work is ordered on ``stream`` if one was given,
    else on the stream current at each call. Thread-safe; one call at a time per plan.
    """

    def __init__(self, batch_size, num_video_tokens, num_text_tokens, *, hidden_size=1024, num_heads=16,
                 precision="tf32", stream=None):
        cupy = require_gpu()
        sizes = dict(batch_size=batch_size, num_video_tokens=num_video_tokens, num_text_tokens=num_text_tokens,
                     hidden_size=hidden_size, num_heads=num_heads)
        bad = [f"{k}={v!r}" for k, v in sizes.items() if not isinstance(v, (int, numpy.integer)) or v < 1]
        if bad:
            raise ValueError(f"plan sizes must be positive integers: {', '.join(bad)}")
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
        if problem := checks.batch_limit_problem(batch_size):  # every call would fail the full check
            raise ValueError(problem)
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}; expected one of {', '.join(PRECISIONS)}")
        self.batch_size, self.num_video_tokens, self.num_text_tokens = batch_size, num_video_tokens, num_text_tokens
        self.hidden_size, self.num_heads, self.precision = hidden_size, num_heads, precision
        self.head_dim = hidden_size // num_heads
        self.stream = stream
        self.device = cupy.cuda.Device().id
        self.input_shapes, self.output_shapes, nbytes = checks.layout(batch_size, num_video_tokens,
                                                                      num_text_tokens, hidden_size)
        self._sizes = (batch_size, num_video_tokens, num_text_tokens, hidden_size, num_heads)
        offsets = numpy.cumsum((0,) + nbytes[len(self.input_shapes):]).tolist()
        self._output_bytes = offsets[-1]
        self._output_layout = tuple(zip(self.output_shapes, offsets))  # (shape, byte offset) of each output
        self._sm_count = cupy.cuda.runtime.getDeviceProperties(self.device)["multiProcessorCount"]
        self._capture_stream = cupy.cuda.Stream(non_blocking=True)
        self._programs = {}   # scale -> (Backward, graph), least recently used first
        self._lock = threading.Lock()
        # Events are reused (recorded again each call) rather than created per call: a wait
        # already issued keeps the record it saw. Both are used only under the lock.
        self._handoff = cupy.cuda.Event(disable_timing=True)  # ordering between streams within a call
        # After the last launch when no stream is fixed, or when it ran on the per-thread default stream.
        self._done = cupy.cuda.Event(disable_timing=True)
        self._last_stream = None  # pointer of the stream of that launch
        self._problem(1.0 / math.sqrt(self.head_dim))  # fail now on an unsupported head_dim

    def _problem(self, scale):
        problem = Problem(self.batch_size, self.num_video_tokens, self.num_text_tokens, self.hidden_size,
                          self.num_heads, self.head_dim, scale)
        from .attention_bwd import check_head_dim
        check_head_dim(problem)
        return problem

    def matches(self, problem, precision):
        """Whether this plan computes ``problem`` at ``precision`` on the current GPU."""
        return (problem[:5] == self._sizes and precision == self.precision  # (B, Nv, Nt, D, H)
                and import_cupy().cuda.runtime.getDevice() == self.device)

    def __call__(self, grad_output, video_latents, text_embeddings, query_weight, query_bias, key_weight,
                 key_bias, value_weight, value_bias, output_weight, output_bias, scale=None, *,
                 num_heads=None, precision=None, backend="cupy", out=None, text_lengths=None):
        if num_heads not in (None, self.num_heads) or precision not in (None, self.precision) or backend != "cupy":
            raise ValueError(f"this plan computes num_heads={self.num_heads}, precision={self.precision!r} on "
                             f"backend 'cupy'; got num_heads={num_heads!r}, precision={precision!r}, "
                             f"backend={backend!r}")
        from . import api  # the same checks, fast path and conversions as any call, on this plan
        return api.run((grad_output, video_latents, text_embeddings, query_weight, query_bias, key_weight,
                        key_bias, value_weight, value_bias, output_weight, output_bias),
                       scale=scale, num_heads=self.num_heads, precision=self.precision, backend="cupy", out=out,
                       text_lengths=text_lengths, plan=self)

    def launch(self, inputs, scale, out=None, addresses=None, text_lengths=None):
        """Run on validated C-contiguous float32 CuPy ``inputs``; fills ``out`` or fresh arrays.

        ``addresses``: the inputs' data pointers (then the outputs', with ``out``), if the caller
        has them already. ``text_lengths``: validated (B,) int32 NumPy array, or None (no padding).
        """
        cupy = import_cupy()
        if addresses is None:
            addresses = [a.data.ptr for a in inputs] + ([] if out is None else [o.data.ptr for o in out])
        if out is None:
            out, out_addresses = self._allocate(cupy)
            addresses = addresses + out_addresses
        addresses = numpy.fromiter(addresses, numpy.uint64, len(addresses))  # faster than numpy.array
        current = cupy.cuda.get_current_stream()
        stream = self.stream or current
        with self._lock, _on_device(cupy, self.device):
            if stream.ptr != current.ptr:  # a plan with its own stream: after the caller's work, and before it
                self._wait(stream, current)
            # The per-thread default stream's handle names each calling thread's own stream, so a
            # replay on it may have run on another thread's stream (the cache keys plans by handle).
            per_thread = stream.ptr == cupy.cuda.runtime.streamPerThread
            if self._last_stream is not None and (self._last_stream != stream.ptr or per_thread):
                # The pointer table is rewritten below: let the last replay finish reading it.
                stream.wait_event(self._done)
            program, graph = self._programs.pop(scale, (None, None))
            if program is None:
                # Allocated on the stream that runs it: CuPy's pool reuses a freed block only in the
                # order of that stream, so an evicted recording cannot be overwritten mid-replay.
                with stream:
                    program = self._record(scale)
            program.bind(addresses, stream, text_lengths)
            if graph is None:
                graph = self._first_run(program, stream)
            elif graph is _UNCAPTURED:
                self._run_direct(program, stream)
            else:
                graph.launch(stream)
            self._programs[scale] = (program, graph)  # most recent last
            while len(self._programs) > SCALES_PER_PLAN:
                self._programs.pop(next(iter(self._programs)))
            if self.stream is None or per_thread:
                self._done.record(stream)
                self._last_stream = stream.ptr
            if stream.ptr != current.ptr:
                self._wait(current, stream)
        return out

    def _wait(self, waiter, producer):
        """Order ``waiter`` after the work issued so far on ``producer``."""
        self._handoff.record(producer)
        waiter.wait_event(self._handoff)

    def _record(self, scale):
        """A new recording (``Backward``) for ``scale``; out of GPU memory, a MemoryError that says
        how much this shape needs. Whatever was allocated before the failure is freed with it."""
        cupy = import_cupy()
        problem = self._problem(scale)
        try:
            return Backward(problem, self.precision, self._capture_stream, self._sm_count)
        except cupy.cuda.memory.OutOfMemoryError as exc:
            message = (f"cupy_xattn: not enough GPU memory for the backward of B={self.batch_size}, "
                       f"Nv={self.num_video_tokens}, Nt={self.num_text_tokens}, D={self.hidden_size} "
                       f"({self.precision}): it needs about "
                       f"{_megabytes(Backward.memory_bytes(problem, self.precision, self._sm_count))} of "
                       f"intermediates and workspace, plus {_megabytes(self._output_bytes)} for the "
                       f"outputs unless out= is given ({exc})")
        # Raised outside the handler: the error keeps no traceback of the half-built recording,
        # whose buffers are freed now rather than when the caller drops the error.
        raise MemoryError(message)

    def _run_direct(self, program, stream):
        """Issue the steps one by one on the plan's own stream, ordered after and before ``stream``."""
        self._wait(self._capture_stream, stream)
        try:
            program.run()
        finally:
            # Also when a step fails: the recording is dropped then, and its buffers go back to the
            # pool in ``stream``'s order, so ``stream`` must wait for the work already issued.
            self._wait(stream, self._capture_stream)

    def _first_run(self, program, stream):
        """Run the steps directly (loading every kernel and cuBLAS's), then capture them (the edges
        into the library's kernels made programmatic where the GPU has them: graphs.py).

        cuBLAS refuses capture for some degenerate shapes (seen on the H200: B·Nv = 1 with TF32,
        where it takes another path for a single row); such a plan stays uncaptured and issues
        its steps on every call instead, with the same results. Any other error (out of memory,
        a capture left unjoined) is raised, not taken for a refusal.
        """
        from cupy_backends.cuda.api.runtime import CUDARuntimeError
        from ._cublas import CublasError

        self._run_direct(program, stream)
        try:
            self._capture_stream.begin_capture()
            try:
                program.run()
            finally:
                graph = self._capture_stream.end_capture()
        except CublasError:
            return _UNCAPTURED
        except CUDARuntimeError as exc:
            if exc.status not in _CAPTURE_REFUSED:
                raise
            return _UNCAPTURED
        return graphs.programmatic(graph)

    def _allocate(self, cupy):
        """Fresh outputs and their addresses, every call: arrays laid over one new allocation.

        ``cupy.ndarray`` over a pointer costs about half of a slice and a reshape of one array.
        """
        try:
            memory = cupy.cuda.alloc(self._output_bytes)
        except cupy.cuda.memory.OutOfMemoryError as exc:
            raise MemoryError(f"cupy_xattn: not enough GPU memory for the 10 outputs "
                              f"({_megabytes(self._output_bytes)}; pass out= to reuse buffers) ({exc})") from None
        out = CrossAttentionGrads._make([cupy.ndarray(shape, _FLOAT32, memory + offset)
                                         for shape, offset in self._output_layout])
        return out, [memory.ptr + offset for _, offset in self._output_layout]


def _megabytes(n):
    return f"{n / 2**20:,.1f} MiB ({n:,} bytes)"


def _on_device(cupy, device):
    """A context on ``device``; free when it is already current (the usual case)."""
    return contextlib.nullcontext() if cupy.cuda.runtime.getDevice() == device else cupy.cuda.Device(device)


def plan(batch_size, num_video_tokens, num_text_tokens, *, hidden_size=1024, num_heads=16, precision="tf32",
         stream=None):
    """A reusable, graph-replayed ``cross_attention_backward`` for one shape.

    Parameters
    ----------
    batch_size, num_video_tokens, num_text_tokens : int
        B, Nv, Nt of the calls it will serve.
    hidden_size, num_heads : int
        D and H (head_dim = D / H must be 64 or 128 for the CuPy backend).
    precision : "fp32", "tf32" or "fp16"
    stream : cupy.cuda.Stream, optional
        Stream to order the work on; default: the current stream at each call.

    Returns
    -------
    Plan
        Callable with the signature of ``cross_attention_backward``.
    """
    return Plan(batch_size, num_video_tokens, num_text_tokens, hidden_size=hidden_size, num_heads=num_heads,
                precision=precision, stream=stream)


_cache = collections.OrderedDict()
_cache_lock = threading.Lock()


def cached(problem, precision):
    """The cache's plan for this shape and precision on the current device and stream (LRU)."""
    cupy = require_gpu()
    stream = cupy.cuda.get_current_stream()
    key = (problem.batch_size, problem.num_video_tokens, problem.num_text_tokens, problem.hidden_size,
           problem.num_heads, precision, cupy.cuda.runtime.getDevice(), stream.ptr)
    with _cache_lock:
        found = _cache.get(key)
        if found is not None:
            _cache.move_to_end(key)
            return found
    made = Plan(problem.batch_size, problem.num_video_tokens, problem.num_text_tokens,
                hidden_size=problem.hidden_size, num_heads=problem.num_heads, precision=precision, stream=stream)
    with _cache_lock:
        made = _cache.setdefault(key, made)
        _cache.move_to_end(key)
        while len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
    return made
