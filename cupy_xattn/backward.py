"""The CuPy backend: cuBLAS projections around the fused attention-backward kernel.

With Mv = B·Nv video rows and Mt = B·Nt text rows (row-major, heads side by side):

    Q0 = X Wq^T            [K0 | V0] = T [Wk | Wv]^T (one batched GEMM)     dO = dY Wo
    attention kernel → O, dQ, dKV = [dK | dV]                  (biases bq, bk, bv added inside)
    dWo = dY^T O    dX = dQ Wq    dWq = dQ^T X    dT = [dK | dV] [Wk; Wv]    [dWk | dWv] = [dK | dV]^T T
    dbo, dbq, [dbk | dbv] = column sums of dY, dQ, [dK | dV]          (fp32 GEMMs with a ones row)

In the tf32 mode dO, dX and dT read transposed copies of Wo, Wq and [Wk; Wv] (made by
``weights_t.py`` at the start), so that both operands of every such GEMM are K-major.

Every GEMM runs at the mode's precision: tf32 (TF32 tensor cores), fp16 (operands copied to fp16
with per-tensor power-of-two scales, undone by each GEMM's alpha) or fp32 (3xFP16: the fp16
mode's copies and their remainders, each product as three fp16 GEMMs, hi·hi + hi·lo + lo·hi, for
near-fp32 accuracy at fp16 tensor-core speed). The bias sums stay fp32 (FFMA) in every mode.
Nothing uses atomics whose order varies: two calls give bitwise-identical results.

Independent GEMMs run side by side on three lanes (the main stream and two forked ones, each
with its own cuBLAS handle and workspace): Q0, K0|V0 and dO before the attention; after it,
dX then dWo|dWq, dT then dWk|dWv, and the bias sums. On the small shapes one GEMM fills a
fraction of the SMs, so the lanes overlap what would otherwise run one after the other.

A :class:`Backward` is built once per (problem size, precision, stream): it owns every
intermediate buffer, its lanes and their cuBLAS handles, and records its launches as a list of steps. The
caller's arrays are never baked into a step: each step reads their addresses from a device
pointer table (kernels dereference it; cuBLAS takes it through ``cublasGemmBatchedEx``), which
:meth:`Backward.bind` rewrites before every run. So the same steps can be captured once into a
CUDA graph and replayed with new arrays every call (see ``plans.py``).
"""

import numpy

from . import _cublas
from .gemm import COMPUTE_32F as _COMPUTE_32F, COMPUTE_TYPE, OP_N, OP_T, R_16F as _R_16F, R_32F as _R_32F
from ._cupy import import_cupy
from .attention_bwd import AttentionBackward
from .grads import INPUT_NAMES, CrossAttentionGrads
from .half_scaling import HalfScaler
from .weights_t import WeightsTransposed

OUTPUT_NAMES = CrossAttentionGrads._fields

_H2D = 1
_LANES = 3  # the main stream and two forked streams
_DT_SPLIT_ROWS = 96  # tf32 dT runs as two column halves below this many rows B·Nt (see _record)

# fp16 scale slots, one per GEMM operand (Wk and Wv share one: [K0 | V0] is one GEMM, one alpha).
_X, _T, _WQ, _WKV, _WO, _DY, _O, _DQ, _DKV = range(9)
_N_SLOTS = 9


class PointerTable:
    """Device array of addresses, rewritten before each run.

    An entry is either a caller array, by name (str) or as (name, byte offset) for a part of it,
    or a fixed address (int) of a buffer the backward owns. Consecutive entries form the pointer
    arrays of batched GEMMs.
    The device array is allocated up front, so entries have device addresses while recording.
    """

    CAPACITY = 256

    def __init__(self):
        self._entries = []
        self.device = import_cupy().zeros(self.CAPACITY, numpy.uint64)

    def add(self, *entries):
        """Append entries; returns the index of the first."""
        index = len(self._entries)
        if index + len(entries) > self.CAPACITY:
            raise RuntimeError(f"pointer table full ({self.CAPACITY} entries)")
        self._entries.extend(entries)
        return index

    def finalize(self):
        names = {name: i for i, name in enumerate(INPUT_NAMES + OUTPUT_NAMES)}
        caller = {i: (e, 0) if isinstance(e, str) else e
                  for i, e in enumerate(self._entries) if isinstance(e, (str, tuple))}
        self._host = numpy.array([0 if i in caller else e for i, e in enumerate(self._entries)], numpy.uint64)
        self._host_ptr = self._host.ctypes.data  # once: ``ctypes`` builds an object per access
        self._caller_index = numpy.array(list(caller), numpy.intp)
        self._caller_name = numpy.array([names[name] for name, _ in caller.values()], numpy.intp)
        self._caller_offset = numpy.array([offset for _, offset in caller.values()], numpy.uint64)

    def address(self, index):
        return self.device.data.ptr + 8 * index

    def bind(self, addresses, stream):
        """Write the table for the caller arrays at ``addresses`` (uint64, inputs then outputs).

        The copy is from pageable memory, which CUDA stages before returning: the host array
        can change right away, and the copy is ordered on ``stream`` before the run.
        """
        self._host[self._caller_index] = addresses[self._caller_name] + self._caller_offset
        import_cupy().cuda.runtime.memcpyAsync(self.device.data.ptr, self._host_ptr, self._host.nbytes, _H2D,
                                               stream.ptr)


class Backward:
    """The backward of one problem size and precision, recorded as steps on ``stream``.

    Parameters
    ----------
    problem : checks.Problem (its ``scale`` is baked into the attention launch).
    precision : "fp32", "tf32" or "fp16".
    stream : cupy.cuda.Stream the steps are issued (or captured) on.
    sm_count : multiprocessors of the current GPU.
    """

    def __init__(self, problem, precision, stream, sm_count):
        cupy = import_cupy()
        self.problem, self.precision, self.stream = problem, precision, stream
        b, nv, nt, d = (problem.batch_size, problem.num_video_tokens, problem.num_text_tokens,
                        problem.hidden_size)
        mv, mt = b * nv, b * nt
        f32 = lambda *shape: cupy.empty(shape, numpy.float32)  # noqa: E731
        self._attention = AttentionBackward(problem, precision, sm_count)
        self._q0, self._kv0, self._dout = f32(mv, d), f32(mt, 2 * d), f32(mv, d)
        self._o, self._dq, self._dkv = f32(mv, d), f32(mv, d), f32(mt, 2 * d)
        # Text tokens each sample attends to (a buffer the graph reads), rewritten by bind() when the
        # caller pads its texts; _all_keys is the host copy of "no padding".
        self._all_keys = numpy.full(b, nt, numpy.int32)
        self._text_lengths = cupy.full(b, nt, numpy.int32)
        self._padded = False
        self._ones = cupy.ones(max(mv, mt), numpy.float32)
        self._constants = cupy.array([0.0, 1.0], numpy.float32)  # beta = 0, beta = alpha = 1
        self._lanes = [stream] + [cupy.cuda.Stream(non_blocking=True) for _ in range(_LANES - 1)]
        self._handles = [_cublas.Handle(lane) for lane in self._lanes]
        self._events = [cupy.cuda.Event(disable_timing=True) for _ in range(_LANES)]
        self._fork_lanes = _lane_fork(self._lanes, self._events[0])
        self._join_lanes = _lane_join(self._lanes, self._events[1:])
        self._table = PointerTable()
        self._steps = []
        self._compute = COMPUTE_TYPE[precision]  # fp32: with fp16 operands, the 3xFP16 products
        self._scaler = HalfScaler(_N_SLOTS, sm_count) if precision in ("fp16", "fp32") else None
        self._lo_offset = None  # fp32: bytes from an fp16 copy to its remainders (see _record)
        self._record(b, nv, nt, d)
        self._table.finalize()

    @staticmethod
    def memory_bytes(problem, precision, sm_count):
        """GPU memory a Backward of this problem allocates: intermediates, fp16 copies, the
        attention's dK/dV partials and the cuBLAS workspaces (small buffers aside)."""
        b, nv, nt, d = problem.batch_size, problem.num_video_tokens, problem.num_text_tokens, problem.hidden_size
        mv, mt = b * nv, b * nt
        fp32 = 4 * (4 * mv * d + 2 * mt * 2 * d + max(mv, mt))  # Q0, dO, O, dQ; [K0|V0], [dK|dV]; ones
        fp16 = {"fp16": 1, "fp32": 2, "tf32": 0}[precision] * 2 * sum(_half_elements(mv, mt, d))  # fp32: + lo
        transposed = 4 * 4 * d * d if precision == "tf32" else 0  # Wo^T; [Wq^T | Wk^T | Wv^T]
        return (fp32 + fp16 + transposed + AttentionBackward.workspace_bytes(problem, precision, sm_count)
                + _LANES * _cublas.Handle.WORKSPACE_BYTES)

    # -- recording ---------------------------------------------------------------------------

    def _gemm(self, a, b, c, *, m, n, k, lda, ldb, ldc, trans_a=False, trans_b=False,
              data_type=_R_32F, compute=None, alpha=None, accumulate=False, lane=0):
        """Record row-major ``c[i] = alpha · op(a[i]) op(b[i]) (+ c[i])`` for each i of the batch, on ``lane``.

        a, b, c: lists of table entries (one per batch member). cuBLAS is column-major: the
        row-major product is computed as c^T = op(b)^T op(a)^T, so b goes first.
        In the fp32 mode a product at the default compute is three fp16 GEMMs, the small terms
        first: lo(a)·b, a·lo(b), then a·b, with a and b addresses of fp16 copies (see _record).
        """
        label = f"gemm {m}x{n}x{k}" + (f" x{len(c)}" if len(c) > 1 else "")
        if self._lo_offset is None or compute is not None:
            products = [(a, b, "")]
        else:
            lo = lambda entries: [entry + self._lo_offset for entry in entries]  # noqa: E731
            products = [(lo(a), b, " lo·hi"), (a, lo(b), " hi·lo"), (a, b, " hi·hi")]
        compute = self._compute if compute is None else compute
        alpha = self._constants.data.ptr + 4 if alpha is None else alpha
        table, handle = self._table, self._handles[lane]
        for i, (a, b, part) in enumerate(products):
            slot_b, slot_a, slot_c = self._table.add(*b), self._table.add(*a), self._table.add(*c)
            beta = self._constants.data.ptr + 4 * int(accumulate or i > 0)
            self._steps.append((label + part, lambda slot_a=slot_a, slot_b=slot_b, slot_c=slot_c, beta=beta:
                                handle.gemm_batched(
                                    OP_T if trans_b else OP_N, OP_T if trans_a else OP_N, n, m, k, alpha,
                                    table.address(slot_b), data_type, ldb, table.address(slot_a), data_type, lda,
                                    beta, table.address(slot_c), _R_32F, ldc, len(c), compute), lane))

    def _fork(self):
        """Record: the side lanes wait for everything issued so far on the main lane."""
        self._steps.append(("fork", self._fork_lanes, 0))

    def _join(self):
        """Record: the main lane waits for everything issued so far on the side lanes."""
        self._steps.append(("join", self._join_lanes, 0))

    def _gemm_group(self, members, **shape):
        """Record GEMMs of one shape, ``members`` = [(a, b, c, alpha)]: one batched call when
        they share alpha (a batched GEMM has one alpha), else one call each."""
        alphas = {alpha for *_, alpha in members}
        groups = [members] if len(alphas) == 1 else [[m] for m in members]
        for group in groups:
            a, b, c, alpha = zip(*group)
            self._gemm(list(a), list(b), list(c), alpha=alpha[0], **shape)

    def _record(self, b, nv, nt, d):
        cupy = import_cupy()
        mv, mt = b * nv, b * nt
        addr = lambda array, offset=0: array.data.ptr + offset  # noqa: E731
        dk, dv = addr(self._dkv), addr(self._dkv, 4 * d)
        transposed = self.precision == "tf32"

        if self._scaler is None:
            X, T, DY = "video_latents", "text_embeddings", "grad_output"
            WQ, WK, WV, WO = "query_weight", "key_weight", "value_weight", "output_weight"
            O, DK, DV, DQ = addr(self._o), dk, dv, addr(self._dq)
            dtype = _R_32F
            alpha = lambda i, j: None  # noqa: E731
            # The products with a weight on the right (dO, dX, dT) read W^T copies: see
            # kernels_cu/weights_t.cu. The fp16 GEMMs read either layout at full speed.
            self._wo_t, self._wqkv_t = cupy.empty((d, d), numpy.float32), cupy.empty((d, 3 * d), numpy.float32)
            wo_t = WeightsTransposed(self._table.address(self._table.add(WO)), 1, self._wo_t.data.ptr, d)
            wqkv_t = WeightsTransposed(self._table.address(self._table.add(WQ, WK, WV)), 3, self._wqkv_t.data.ptr, d)
        else:
            # fp16 copies (fp32: and their remainders, at lo_offset from each copy), one allocation.
            sizes = _half_elements(mv, mt, d)
            copies = 2 if self.precision == "fp32" else 1
            self._halves = cupy.empty(copies * sum(sizes), numpy.float16)
            if copies == 2:
                self._lo_offset = 2 * sum(sizes)
            X, T, WQ, WK, WO, DY, O, DQ, DK = (self._halves.data.ptr + 2 * start
                                               for start in numpy.cumsum([0] + sizes[:-1]).tolist())
            WV, DV = WK + 2 * d * d, DK + 2 * d  # [Wk; Wv] and [dK | dV] are one copy each
            # (source entry, element count, fp16 destination, scale slot)
            stage_a = [("video_latents", mv * d, X, _X), ("text_embeddings", mt * d, T, _T),
                       ("query_weight", d * d, WQ, _WQ), ("key_weight", d * d, WK, _WKV),
                       ("value_weight", d * d, WV, _WKV), ("output_weight", d * d, WO, _WO),
                       ("grad_output", mv * d, DY, _DY)]
            stage_b = [(addr(self._o), mv * d, O, _O), (addr(self._dq), mv * d, DQ, _DQ),
                       (addr(self._dkv), mt * 2 * d, DK, _DKV)]
            self._record_conversions(stage_a)
            dtype = _R_16F
            alpha = self._scaler.alpha

        gemm = self._gemm
        self._fork()
        gemm([X], [WQ], [addr(self._q0)], m=mv, n=d, k=d, lda=d, ldb=d, ldc=d, trans_b=True,
             data_type=dtype, alpha=alpha(_X, _WQ))
        gemm([T, T], [WK, WV], [addr(self._kv0), addr(self._kv0, 4 * d)], m=mt, n=d, k=d, lda=d, ldb=d,
             ldc=2 * d, trans_b=True, data_type=dtype, alpha=alpha(_T, _WKV), lane=1)
        if transposed:  # dO = dY (Wo^T)^T; [Wq^T | Wk^T | Wv^T] for after the attention
            self._steps.append(("Wo^T", wo_t, 2))
            gemm([DY], [addr(self._wo_t)], [addr(self._dout)], m=mv, n=d, k=d, lda=d, ldb=d, ldc=d, trans_b=True,
                 data_type=dtype, lane=2)
            self._steps.append(("[Wq^T | Wk^T | Wv^T]", wqkv_t, 1))
        else:
            gemm([DY], [WO], [addr(self._dout)], m=mv, n=d, k=d, lda=d, ldb=d, ldc=d, data_type=dtype,
                 alpha=alpha(_DY, _WO), lane=2)
        self._join()

        # Steps close over what they use, not over self: an evicted plan is freed at once
        # (no reference cycle waiting for the garbage collector).
        biases = self._table.address(self._table.add("query_bias", "key_bias", "value_bias"))
        attention, buffers = self._attention, (self._q0, self._kv0, biases, self._dout, self._o, self._dq, self._dkv,
                                               self._text_lengths)
        self._steps.append(("attention", lambda: attention(*buffers), 0))
        if self._scaler is not None:
            self._record_conversions(stage_b)

        self._fork()
        if transposed:
            gemm([DQ], [addr(self._wqkv_t)], ["grad_video_latents"], m=mv, n=d, k=d, lda=d, ldb=3 * d, ldc=d,
                 trans_b=True, data_type=dtype)
        else:
            gemm([DQ], [WQ], ["grad_video_latents"], m=mv, n=d, k=d, lda=d, ldb=d, ldc=d,
                 data_type=dtype, alpha=alpha(_DQ, _WQ))
        # dWo and dWq: the same shape (K = B·Nv, the deepest), batched to fill more SMs when they
        # share alpha (tf32); the fp16 and fp32 modes' scales differ, so two calls there.
        self._gemm_group([(DY, O, "grad_output_weight", alpha(_DY, _O)),
                          (DQ, X, "grad_query_weight", alpha(_DQ, _X))],
                         m=d, n=d, k=mv, lda=d, ldb=d, ldc=d, trans_a=True, data_type=dtype)
        if transposed:
            # dT = [dK | dV] [Wk^T | Wv^T]^T, one GEMM with K = 2D; below _DT_SPLIT_ROWS rows as two
            # batched halves of its columns: for B·Nt = 77 cuBLAS ran 256 × 128 tiles (43 µs against
            # 11 µs halved); from 100 rows on the single product is as fast or faster (perf-notes).
            parts = 2 if mt < _DT_SPLIT_ROWS else 1
            n = d // parts
            gemm([DK] * parts, [addr(self._wqkv_t, 4 * (i * n * 3 * d + d)) for i in range(parts)],
                 [("grad_text_embeddings", 4 * i * n) for i in range(parts)], m=mt, n=n, k=2 * d, lda=2 * d,
                 ldb=3 * d, ldc=d, trans_b=True, data_type=dtype, lane=1)
        else:  # fp16, fp32: [Wk; Wv] is one copy: dT = [dK | dV] [Wk; Wv], one GEMM
            gemm([DK], [WK], ["grad_text_embeddings"], m=mt, n=d, k=2 * d, lda=2 * d, ldb=d, ldc=d,
                 data_type=dtype, alpha=alpha(_DKV, _WKV), lane=1)
        gemm([DK, DV], [T, T], ["grad_key_weight", "grad_value_weight"], m=d, n=d, k=mt,
             lda=2 * d, ldb=d, ldc=d, trans_a=True, data_type=dtype, alpha=alpha(_DKV, _T), lane=1)

        # Bias gradients: fp32 column sums of the fp32 tensors, a ones row times the matrix.
        ones = addr(self._ones)
        fp32 = dict(data_type=_R_32F, compute=_COMPUTE_32F, lane=2)
        gemm([ones, ones], ["grad_output", addr(self._dq)], ["grad_output_bias", "grad_query_bias"],
             m=1, n=d, k=mv, lda=mv, ldb=d, ldc=d, **fp32)
        gemm([ones, ones], [dk, dv], ["grad_key_bias", "grad_value_bias"], m=1, n=d, k=mt,
             lda=mt, ldb=2 * d, ldc=d, **fp32)
        self._join()

    def _record_conversions(self, tensors):
        """Record the scaled fp16 copies of ``tensors`` [(source entry, size, dest address, slot)]
        (fp32: and their remainders, at ``_lo_offset`` from each copy)."""
        first = self._table.add(*(source for source, *_ in tensors))
        lo = self._lo_offset
        copy, rescale = self._scaler.group(self._table.address(first),
                                           [(size, dest, slot, 0 if lo is None else dest + lo)
                                            for _, size, dest, slot in tensors])
        self._steps += [(f"to fp16 x{len(tensors)}", copy, 0), (f"fp16 rescale x{len(tensors)}", rescale, 0),
                        ("fp16 alphas", self._scaler.update_alphas, 0)]

    # -- running -----------------------------------------------------------------------------

    def bind(self, addresses, stream, text_lengths=None):
        """Point the steps at the caller's arrays (addresses: uint64, INPUT_NAMES then OUTPUT_NAMES)
        and, when ``text_lengths`` (validated (B,) int32 NumPy) is given or was last time, write the
        text lengths the attention reads. Both copies are ordered on ``stream`` before the run."""
        self._table.bind(addresses, stream)
        if text_lengths is not None or self._padded:
            lengths = numpy.ascontiguousarray(self._all_keys if text_lengths is None else text_lengths, numpy.int32)
            # From pageable memory: staged before the call returns, so ``lengths`` may go at once.
            import_cupy().cuda.runtime.memcpyAsync(self._text_lengths.data.ptr, lengths.ctypes.data, lengths.nbytes,
                                                   _H2D, stream.ptr)
            self._padded = text_lengths is not None

    def run(self, timer=None):
        """Issue every step on its lane (directly, or into a graph being captured on ``self.stream``).

        ``timer(label, stream, step)``, if given, issues each step instead (e.g. between two
        events recorded on ``stream``, the step's lane).
        """
        try:
            for label, step, lane in self._steps:
                stream = self._lanes[lane]
                with stream:
                    if timer is None:
                        step()
                    else:
                        timer(label, stream, step)
        except BaseException:
            # A step failed: the main lane still waits for what the side lanes were given, so that
            # whoever orders itself after the main lane (and reuses these buffers) is after it too.
            self._join_lanes()
            raise


def _half_elements(mv, mt, d):
    """Sizes (fp16 elements, each rounded up to 256 bytes) of the fp16 copies, in their order in
    the one allocation: X, T, Wq, [Wk; Wv], Wo, dY, O, dQ, [dK | dV]."""
    sizes = [mv * d, mt * d, d * d, 2 * d * d, d * d, mv * d, mv * d, mv * d, 2 * mt * d]
    return [-(-size // 128) * 128 for size in sizes]


def _lane_fork(lanes, event):
    """A function that makes the side lanes wait for everything issued so far on the main lane."""
    main, sides = lanes[0], lanes[1:]

    def fork():
        event.record(main)
        for side in sides:
            side.wait_event(event)
    return fork


def _lane_join(lanes, events):
    """A function that makes the main lane wait for everything issued so far on the side lanes."""
    main, sides = lanes[0], lanes[1:]

    def join():
        for side, event in zip(sides, events):
            event.record(side)
            main.wait_event(event)
    return join
