"""The CuPy backend: cuBLAS projections around the fused attention-backward kernel.

With Mv = B·Nv video rows and Mt = B·Nt text rows (row-major, heads side by side):

    Q0 = X Wq^T            [K0 | V0] = T [Wk | Wv]^T (one batched GEMM)     dO = dY Wo
    attention kernel → O, dQ, dKV = [dK | dV]                  (bq added inside or by Q0's GEMM, bv to O; bk and bv
                                 cancel elsewhere; fp16 mode, where attention_bwd.half_kv says: [K0 | V0]
                                 written as fp16 by its GEMM, ATTN_KV_HALF; and where half_qdo says,
                                 Q0 and dO too, ATTN_QDO_HALF: attn_bwd_lean, Q0's GEMM then adding bq
                                 by cuBLASLt's bias epilogue)
    dWo = dY^T O    dX = dQ Wq    dWq = dQ^T X    dT = [dK | dV] [Wk; Wv]    [dWk | dWv] = [dK | dV]^T T
    dbo, dbq, [dbk | dbv] = column sums of dY, dQ, [dK | dV]          (fp32 GEMMs with a ones row,
                                                 mostly over partial sums that other kernels write)

In the tf32 mode the projections read both operands K-major, what sm_90's TF32 tensor cores read
at full speed (``transpose.py``): dO, dX and dT read transposed copies of Wo, Wq and [Wk; Wv],
and the weight-gradient pairs over enough rows (``_weight_grads_tn``) read dY^T, O^T (written so
by the attention kernel), dQ^T (the kernel's too, with its column sums, on long samples where dQ
is whole: ``_dq_transposed``), X^T, [dK | dV]^T and T^T, as dWo = dY^T (O^T)^T and so on.

Every GEMM runs at the mode's precision: tf32 (TF32 tensor cores), fp16 (operands copied to fp16
with per-tensor power-of-two scales, undone by each GEMM's alpha) or fp32 (3xFP16: the fp16
mode's copies and their remainders, each product as three fp16 GEMMs, hi·hi + hi·lo + lo·hi, for
near-fp32 accuracy at fp16 tensor-core speed). The bias sums stay fp32 (FFMA) in every mode.
Nothing uses atomics whose order varies: two calls on the same inputs give bitwise-identical
results (a call on other inputs in between may leave an fp16 scale a power of two off, which
changes only the last bits of fp16-subnormal elements: half_scaling.cu).

Independent GEMMs run side by side on three lanes (the main stream and two forked ones, each
with its own cuBLAS handle and workspace): Q0, K0|V0 and dO before the attention; after it,
dX then dWo|dWq, dT then dWk|dWv, and the bias sums (fp16, fp32: dWo beside the second conversion,
as it reads the attention's fp16 O; tf32: dX; dQ^T (where the attention does not write it),
dbo|dbq then dWo|dWq; dT, [dK | dV]^T, dbk|dbv then dWk|dWv, with K0|V0 on lane 2 and
[Wq^T | Wk^T | Wv^T] on lane 1 before the attention, and the transposes of the inputs issued
beside it; a pair without transposes has its bias sums on the main lane). On the small shapes
one GEMM fills a fraction of the SMs, so the lanes overlap what would otherwise run one after the
other.

A :class:`Backward` is built once per (problem size, precision, stream): it owns every
intermediate buffer, its lanes and their cuBLAS handles, and records its launches as a list of steps. The
caller's arrays are never baked into a step: each step reads their addresses from a device
pointer table (kernels dereference it; cuBLAS takes it through ``cublasGemmBatchedEx``), which
:meth:`Backward.bind` rewrites before every run. So the same steps can be captured once into a
CUDA graph and replayed with new arrays every call (see ``plans.py``).
"""

import math

import numpy

from . import _cublas
from .gemm import COMPUTE_32F as _COMPUTE_32F, COMPUTE_TYPE, OP_N, OP_T, R_16F as _R_16F, R_32F as _R_32F
from ._cupy import import_cupy
from .attention_bwd import (AttentionBackward, dq_sums_rows, half_kv, half_qdo, kv_half_alpha, launch_layout,
                            o_t_stride)
from .grads import INPUT_NAMES, CrossAttentionGrads
from .half_scaling import HalfScaler, column_sum_rows
from .transpose import Transposed

OUTPUT_NAMES = CrossAttentionGrads._fields

_H2D = 1
_LANES = 3  # the main stream and two forked streams
_DT_SPLIT_ROWS = 96  # tf32 dT runs as two column halves below this many rows B·Nt (see _record)
_TN_MIN_ROWS = 1024  # tf32 weight gradients over at least this many rows B·N read transposes (_record_tf32)
_TN_MIN_TEXT_ROWS = 256  # ... and [dWk | dWv] from this many B·Nt, when [dWo | dWq] read transposes
_DQ_T_MIN_VIDEO_TOKENS = 1024  # the attention writes dQ^T on samples this long (_dq_transposed)


def _weight_grads_tn(precision, mv, mt):
    """Whether tf32's [dWo | dWq] (over mv = B·Nv rows) and [dWk | dWv] (over mt = B·Nt rows) read
    transposed operands ("tn"). Measured on the H200: below _TN_MIN_ROWS rows cuBLAS's "nt" product
    was as fast as the transposes plus the "tn" one; text pairs from 256 rows gained 10–14 µs when the
    video pair was "tn" (B = 8 Nv = 512, B = 4 Nv = 512 and 853 with Nt = 77) and lost 33 µs when
    it was not (B = 2, Nv = 256, Nt = 211)."""
    video = precision == "tf32" and mv >= _TN_MIN_ROWS
    return video, video and mt >= _TN_MIN_TEXT_ROWS or precision == "tf32" and mt >= _TN_MIN_ROWS


def _half_mode(precision):
    """Whether ``precision`` runs its GEMMs on fp16 copies (fp16, fp32: hi and lo). Then the attention
    writes O's fp16 copy itself (fp32: and its remainder), at a scale from a bound on |V| whose bias
    term needs bv's scale, so that O is neither kept in fp32 nor converted and dWo = dY^T O runs
    beside the second conversion; and that conversion sums the attention's dK/dV partials of its
    query chunks (and dQ's of its key parts) as it reads them, so that no reduction kernel runs and
    no fp32 [dK | dV] (nor dQ, with key parts) is kept."""
    return precision != "tf32"


def _o_shape(precision, video_tn, mv, d):
    """O's float32 buffer: O^T with rows padded to o_t_stride where [dWo | dWq] read transposes,
    none where the attention writes O's fp16 copy itself (_half_mode), else O."""
    if _half_mode(precision):
        return (0,)
    return (d, o_t_stride(mv)) if video_tn else (mv, d)


def _summed_shape(precision, n_parts, shape):
    """The float32 buffer of ``shape`` for an attention output that comes in ``n_parts`` partials
    (dQ by key part, [dK | dV] by query chunk): none where the conversion sums several
    (AttentionBackward(reduce_parts=False))."""
    return (0,) if _half_mode(precision) and n_parts > 1 else shape


def _dq_transposed(problem, precision, sm_count):
    """Whether the attention writes dQ^T and dQ's column sums itself (AttentionBackward's
    dq_transposed): the tf32 mode where [dWo | dWq] read transposes, with dQ whole (one key part),
    on samples of at least _DQ_T_MIN_VIDEO_TOKENS. The attention then runs 4–11 µs longer (the DRAM
    time of the bytes it adds), which delays everything after it; the dQ^T transpose it saves is
    on the path only where the video lane ([dWo | dWq]) ends last, as on long samples with short
    texts (perf-notes Session 28: 1x4096x77 −5.3, 2x4096x77 −5.1, 2x2048x77 −2.2, 2x1024x77 −1.9 µs;
    on every sample size 32x128x77 +5.4, 4x853x77 +4.8, 4x256x293 +2.0, 2x691x77 +1.8)."""
    video_tn = _weight_grads_tn(precision, problem.batch_size * problem.num_video_tokens,
                                problem.batch_size * problem.num_text_tokens)[0]
    return (video_tn and problem.num_video_tokens >= _DQ_T_MIN_VIDEO_TOKENS
            and launch_layout(problem, precision, sm_count).kv_parts == 1)


def _tf32_shapes(mv, mt, d, dq_sum_rows=0):
    """The tf32 schedule's own float32 buffers (_record_tf32), name -> shape, None where the
    pairs that _weight_grads_tn leaves "nt" need none. ``dq_sum_rows``: the rows of dQ's column
    sums where the attention writes them (dq_sums_rows), beside dY's by the transpose's row blocks."""
    video_tn, text_tn = _weight_grads_tn("tf32", mv, mt)
    tiles_v, tiles_t = Transposed.row_tiles(mv), Transposed.row_tiles(mt)
    return {"wo_t": (d, d), "wqkv_t": (d, 3 * d),
            "video_t": (3, d, o_t_stride(mv)) if video_tn else None,  # X^T, dY^T, dQ^T
            "text_t": (3 * d, o_t_stride(mt)) if text_tn else None,  # T^T, then [dK | dV]^T
            "video_sums": (2, max(tiles_v, dq_sum_rows), d) if video_tn else None,  # partial column sums of dY, dQ
            "text_sums": (tiles_t, 2 * d) if text_tn else None}  # ... of [dK | dV]


_GEMM_NAMES = ("q0", "kv0", "dout", "dwo", "dx", "dwq", "dt", "dwkv")
_ALL, _THIRD, _HALF, _TWO_THIRDS = (0, 1), (1, 3), (1, 2), (2, 3)  # shares of the SMs (0: all)
_INF = float("inf")
# (mode, B·Nt range, B·Nv range, targets of q0, kv0, dout, dwo, dx, dwq, dt, dwkv): the first row whose
# ranges (lo, hi], in units of _sm_shares' q, hold the problem. Found one product at a time
# (scripts/sm_share_probe.py), then A/B'd as a table (perf-notes, the versions named).
_SM_TABLES = [
    ("fp32", (0, 1), (0, 3), (_HALF, _THIRD, _HALF, _THIRD, _HALF, _TWO_THIRDS, _THIRD, _TWO_THIRDS)),  # v45
    ("fp32", (0, 1), (3, 4), (_TWO_THIRDS, _HALF, _ALL, _THIRD, _THIRD, _TWO_THIRDS, _THIRD, _ALL)),  # v46
    ("fp32", (0, 1), (4, 8), (_TWO_THIRDS, _ALL, _ALL, _HALF, _TWO_THIRDS, _TWO_THIRDS, _HALF, _ALL)),  # v56
    ("fp32", (0, 1), (8, _INF), (_ALL, _ALL, _ALL, _TWO_THIRDS, _ALL, _ALL, _ALL, _ALL)),  # v59
    # v60, the next three rows
    ("fp32", (4, 8), (0, 4), (_ALL, _ALL, _ALL, _TWO_THIRDS, _TWO_THIRDS, _HALF, _ALL, _ALL)),
    ("fp32", (4, 8), (4, 8), (_TWO_THIRDS, _TWO_THIRDS, _ALL, _HALF, _TWO_THIRDS, _TWO_THIRDS, _TWO_THIRDS, _ALL)),
    ("fp32", (8, _INF), (8, _INF), (_ALL, _ALL, _ALL, _HALF, _ALL, _HALF, _ALL, _ALL)),
    ("fp32", (1, 4), (0, 4), (_TWO_THIRDS, _TWO_THIRDS, _TWO_THIRDS, _HALF, _HALF, _HALF, _TWO_THIRDS, _ALL)),  # v55
    ("fp32", (1, 2), (4, _INF), (_TWO_THIRDS, _ALL, _TWO_THIRDS, _HALF, _TWO_THIRDS, _TWO_THIRDS, _HALF, _ALL)),  # v55
    ("tf32", (0, 1), (1, 3), (_ALL, _ALL, _ALL, _ALL, _THIRD, _ALL, _TWO_THIRDS, _ALL)),  # v53
    ("tf32", (0.5, 1), (0, 4), (_ALL, _ALL, _ALL, _ALL, _ALL, _ALL, _TWO_THIRDS, _ALL)),  # v54
    ("tf32", (1, 2), (0, _INF), (_ALL, _ALL, _ALL, _ALL, _TWO_THIRDS, _ALL, _ALL, _ALL)),  # v54
    ("tf32", (2, 4), (0, 4), (_ALL, _ALL, _ALL, _ALL, _ALL, _ALL, _TWO_THIRDS, _ALL)),  # v61
    ("tf32", (4, 8), (4, 8), (_ALL, _ALL, _ALL, _ALL, _ALL, _ALL, _TWO_THIRDS, _ALL)),  # v61
    ("fp16", (0, 1), (0, 1), (_THIRD, _THIRD, _THIRD, _THIRD, _HALF, _HALF, _HALF, _HALF)),  # v44, v52
    ("fp16", (0, 1), (1, 4), (_TWO_THIRDS, _ALL, _ALL, _TWO_THIRDS, _ALL, _HALF, _ALL, _ALL)),  # v52
    ("fp16", (0, 1), (4, _INF), (_ALL, _ALL, _ALL, _ALL, _ALL, _TWO_THIRDS, _ALL, _ALL)),  # v54
    ("fp16", (1, 2), (4, _INF), (_TWO_THIRDS, _ALL, _ALL, _ALL, _ALL, _TWO_THIRDS, _ALL, _ALL)),  # v54
    ("fp16", (1, 4), (0, 4), (_TWO_THIRDS, _ALL, _ALL, _TWO_THIRDS, _HALF, _ALL, _ALL, _ALL)),  # v54
]


def _sm_shares(precision, mv, mt, d, sm_count):
    """SMs cuBLAS is told to plan each product for (cublasSetSmCountTarget; 0: all), by name: the
    projections q0, kv0, dout; dwo beside the second conversion; dx then dwq, dt then dwkv on the
    two lanes after it (half modes; tf32's own schedule, _record_tf32, reads only dx and dt).
    Planned for every SM, a product takes tiles small enough to fill them all, against the GEMMs
    beside it. The tables (_SM_TABLES) are by B·Nt = mt and B·Nv = mv in units of q, the rows of a
    D-wide output that holds a quarter as many 128 × 128 tiles as there are SMs (528 on the H200 at
    D = 1024). What each row gained is in perf-notes (v44–v46, v52–v56, v59–v61; at B·Nv > 8q with
    B·Nt ≤ q, fp32's whole tables of v46 and v56 lost 38 and 42 µs, dWo alone gained 22). Where
    no row holds a problem, all: measured there, no single target gained beyond the drift (tf32 at
    B·Nv ≤ q with B·Nt ≤ q/2, tf32 at B·Nt > 8q or at B·Nt > 4q with B·Nv ≤ 4q, fp16 at
    B·Nt > 4q); other problems are untried."""
    q = sm_count * 128 * 128 / (4 * d)
    for mode, (t_lo, t_hi), (v_lo, v_hi), shares in _SM_TABLES:
        if mode == precision and t_lo * q < mt <= t_hi * q and v_lo * q < mv <= v_hi * q:
            return dict(zip(_GEMM_NAMES, (sm_count * num // den for num, den in shares)))
    return dict.fromkeys(_GEMM_NAMES, 0)


# fp16 scale slots, one per GEMM operand (Wk and Wv share one: [K0 | V0] is one GEMM, one alpha).
_X, _T, _WQ, _WKV, _WO, _DY, _O, _DQ, _DKV, _BV = range(10)  # _BV: for max|bv| (the O bound)
_VIDEO_BIASES, _TEXT_BIASES = ["grad_output_bias", "grad_query_bias"], ["grad_key_bias", "grad_value_bias"]
_N_SLOTS = 10


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
        self._o_half = None  # fp16, fp32: (O's fp16 copy, o_scales, its remainder or None) (see _record)
        b, nv, nt, d = (problem.batch_size, problem.num_video_tokens, problem.num_text_tokens,
                        problem.hidden_size)
        mv, mt = b * nv, b * nt
        f32 = lambda *shape: cupy.empty(shape, numpy.float32)  # noqa: E731
        # tf32 "tn": the attention writes O^T, an operand of dWo = dY^T O read K-major, whose padding
        # columns stay zero (the weight gradients run over the padded K: see _record_tf32).
        video_tn = _weight_grads_tn(precision, mv, mt)[0]
        kv_half, qdo_half = half_kv(problem, precision, sm_count), half_qdo(problem, precision, sm_count)
        self._attention = AttentionBackward(problem, precision, sm_count, o_transposed=video_tn,
                                            o_half=_half_mode(precision), reduce_parts=not _half_mode(precision),
                                            kv_half=kv_half, dq_transposed=_dq_transposed(problem, precision, sm_count),
                                            qdo_half=qdo_half)
        self._dq_t = None, None  # dQ^T and dQ's column sums where the attention writes them (_record_tf32)
        self._qdo_scales = None  # qdo_half: the addresses of s_Q and inv_wo (see _record)
        self._q_bias = None  # qdo_half: bq's fp16 copy at Q0's scale and [alpha, s_Q], for Q0's GEMM (see _record)
        qdo_type = numpy.float16 if qdo_half else numpy.float32  # Q0, dO (qdo_half: fp16, from their GEMMs)
        self._q0, self._dout = cupy.empty((mv, d), qdo_type), cupy.empty((mv, d), qdo_type)
        kv0_dtype, kv0_copy = _kv0_buffers(precision, kv_half)
        self._kv0 = cupy.empty((mt, 2 * d), kv0_dtype)
        self._kv0_half = cupy.empty((mt, 2 * d), numpy.float16) if kv0_copy else None
        self._kv_scaler = HalfScaler(1, sm_count) if kv0_copy else None  # the copy's one scale
        o_shape = _o_shape(precision, video_tn, mv, d)
        self._o = cupy.zeros(o_shape, numpy.float32) if video_tn else f32(*o_shape)
        # dQ and [dK | dV] in fp32: not written where the half modes' conversion sums the partials.
        self._dq = f32(*_summed_shape(precision, self._attention.kv_parts, (mv, d)))
        self._dkv = f32(*_summed_shape(precision, self._attention.n_chunks, (mt, 2 * d)))
        # Text tokens each sample attends to (a buffer the graph reads), rewritten by bind() when the
        # caller pads its texts; _all_keys is the host copy of "no padding".
        self._all_keys = numpy.full(b, nt, numpy.int32)
        self._text_lengths = cupy.full(b, nt, numpy.int32)
        self._padded = False
        self._ones = cupy.ones(max(mv, mt), numpy.float32)
        # beta = 0, beta = alpha = 1, the alpha of the fp16 [K0 | V0]
        self._constants = cupy.array([0.0, 1.0, kv_half_alpha(d)], numpy.float32)
        self._lanes = [stream] + [cupy.cuda.Stream(non_blocking=True) for _ in range(_LANES - 1)]
        self._handles = [_cublas.Handle(lane) for lane in self._lanes]
        self._events = [cupy.cuda.Event(disable_timing=True) for _ in range(_LANES)]
        self._fork_lanes = _lane_fork(self._lanes, self._events[0])
        self._join_lanes = _lane_join(self._lanes, self._events[1:])
        self._table = PointerTable()
        self._steps = []
        self._compute = COMPUTE_TYPE[precision]  # fp32: with fp16 operands, the 3xFP16 products
        self._scaler = HalfScaler(_N_SLOTS, sm_count) if _half_mode(precision) else None
        self._lo_offset = None  # fp32: bytes from an fp16 copy to its remainders (see _record)
        self._sm_count, self._column_sums = sm_count, []  # the conversions' partial column sums
        self._record(b, nv, nt, d)
        self._table.finalize()

    @staticmethod
    def memory_bytes(problem, precision, sm_count):
        """GPU memory a Backward of this problem allocates: intermediates, fp16 copies, the
        attention's dK/dV and dQ partials and the cuBLAS workspaces (small buffers aside)."""
        b, nv, nt, d = problem.batch_size, problem.num_video_tokens, problem.num_text_tokens, problem.hidden_size
        mv, mt = b * nv, b * nt
        video_tn = _weight_grads_tn(precision, mv, mt)[0]
        layout = launch_layout(problem, precision, sm_count)
        n_chunks, kv_parts = layout.n_chunks, layout.kv_parts
        fp32 = (2 if half_qdo(problem, precision, sm_count) else 4) * 2 * mv * d  # Q0, dO
        fp32 += 4 * (math.prod(_summed_shape(precision, kv_parts, (mv, d)))
                    + math.prod(_o_shape(precision, video_tn, mv, d))
                    + math.prod(_summed_shape(precision, n_chunks, (mt, 2 * d)))
                    + max(mv, mt))  # dQ; O (or O^T); [dK|dV]; ones
        kv0_dtype, kv0_copy = _kv0_buffers(precision, half_kv(problem, precision, sm_count))
        fp32 += (numpy.dtype(kv0_dtype).itemsize + 2 * kv0_copy) * mt * 2 * d  # [K0|V0] and its fp16 copy
        fp16 = {"fp16": 1, "fp32": 2, "tf32": 0}[precision] * 2 * sum(_half_elements(mv, mt, d))  # fp32: + lo
        if _half_mode(precision):  # the conversions' partial column sums of dY; dQ, [dK | dV]
            fp16 += 4 * sum(rows * cols for stage in _conversion_shapes(mv, mt, d)
                            for rows, cols in _column_sum_shapes(stage, sm_count))
        dq_sum_rows = dq_sums_rows(b, nv) if _dq_transposed(problem, precision, sm_count) else 0
        transposed = (4 * sum(math.prod(shape) for shape in _tf32_shapes(mv, mt, d, dq_sum_rows).values() if shape)
                      if precision == "tf32" else 0)
        return (fp32 + fp16 + transposed + AttentionBackward.workspace_bytes(problem, precision, sm_count)
                + _LANES * _cublas.Handle.WORKSPACE_BYTES)

    # -- recording ---------------------------------------------------------------------------

    def _gemm(self, a, b, c, *, m, n, k, lda, ldb, ldc, trans_a=False, trans_b=False,
              data_type=_R_32F, out_type=_R_32F, compute=None, alpha=None, alpha_lo_b=None, accumulate=False,
              lane=0, sm_target=0):
        """Record row-major ``c[i] = alpha · op(a[i]) op(b[i]) (+ c[i])`` for each i of the batch, on ``lane``.

        a, b, c: lists of table entries (one per batch member). cuBLAS is column-major: the
        row-major product is computed as c^T = op(b)^T op(a)^T, so b goes first.
        In the fp32 mode a product at the default compute is three fp16 GEMMs, the small terms
        first: lo(a)·b, a·lo(b), then a·b, with a and b addresses of fp16 copies (see _record);
        a·lo(b) takes ``alpha_lo_b`` where b's remainder has a scale of its own (O's: _record).
        ``sm_target``: the SMs cuBLAS plans the product for (_sm_shares; 0: all).
        """
        label = f"gemm {m}x{n}x{k}" + (f" x{len(c)}" if len(c) > 1 else "")
        alpha = self._constants.data.ptr + 4 if alpha is None else alpha
        if self._lo_offset is None or compute is not None:
            products = [(a, b, alpha, "")]
        else:
            lo = lambda entries: [entry + self._lo_offset for entry in entries]  # noqa: E731
            products = [(lo(a), b, alpha, " lo·hi"), (a, lo(b), alpha_lo_b or alpha, " hi·lo"),
                        (a, b, alpha, " hi·hi")]
        compute = self._compute if compute is None else compute
        table, handle = self._table, self._handles[lane]
        for i, (a, b, alpha, part) in enumerate(products):
            slot_b, slot_a, slot_c = self._table.add(*b), self._table.add(*a), self._table.add(*c)
            beta = self._constants.data.ptr + 4 * int(accumulate or i > 0)
            self._steps.append((label + part, lambda slot_a=slot_a, slot_b=slot_b, slot_c=slot_c, alpha=alpha,
                                beta=beta: handle.gemm_batched(
                                    OP_T if trans_b else OP_N, OP_T if trans_a else OP_N, n, m, k, alpha,
                                    table.address(slot_b), data_type, ldb, table.address(slot_a), data_type, lda,
                                    beta, table.address(slot_c), out_type, ldc, len(c), compute,
                                    sm_target=sm_target), lane))

    def _fork(self):
        """Record: the side lanes wait for everything issued so far on the main lane."""
        self._steps.append(("fork", self._fork_lanes, 0))

    def _join(self):
        """Record: the main lane waits for everything issued so far on the side lanes."""
        self._steps.append(("join", self._join_lanes, 0))

    def _record(self, b, nv, nt, d):
        mv, mt = b * nv, b * nt
        addr = lambda array, offset=0: array.data.ptr + offset  # noqa: E731
        if self._scaler is None:
            self._record_tf32(mv, mt, d, addr)
            return
        # fp16 copies (fp32: and their remainders, at lo_offset from each copy), one allocation.
        cupy = import_cupy()
        sizes = _half_elements(mv, mt, d)
        copies = 2 if self.precision == "fp32" else 1
        self._halves = cupy.empty(copies * sum(sizes), numpy.float16)
        if copies == 2:
            self._lo_offset = 2 * sum(sizes)
        X, T, WQ, WK, WO, DY, O, DQ, DK, BV = (self._halves.data.ptr + 2 * start
                                               for start in numpy.cumsum([0] + sizes[:-1]).tolist())
        WV, DV = WK + 2 * d * d, DK + 2 * d  # [Wk; Wv] and [dK | dV] are one copy each
        # (source entry, fp16 destination, scale slot), in the order of _conversion_shapes
        stage_a = [("video_latents", X, _X), ("text_embeddings", T, _T), ("query_weight", WQ, _WQ),
                   ("key_weight", WK, _WKV), ("value_weight", WV, _WKV), ("output_weight", WO, _WO),
                   ("grad_output", DY, _DY), ("value_bias", BV, _BV)]
        # The attention writes O's copy itself (fp32: and its remainder), so the second group is dQ and dK|dV:
        # the sums of the attention's partials (dQ's by key part, [dK | dV]'s by query chunk) where it has several.
        def summed(array, partials, dest, slot):
            if partials is None:
                return addr(array), dest, slot
            return addr(partials), dest, slot, partials.shape[0], partials.size // partials.shape[0]

        stage_b = [summed(self._dq, self._attention.dq_partials, DQ, _DQ),
                   summed(self._dkv, self._attention.partials, DK, _DKV)]
        shapes_a, shapes_b = _conversion_shapes(mv, mt, d)
        qdo_half = self._q0.dtype == numpy.float16
        # There Q0's GEMM adds bq (cuBLASLt's bias epilogue), at the alpha and scale that the first
        # group's rescale writes with bq's fp16 copy: [alpha, s_Q] (half_scaling.cu's write_product_bias).
        if qdo_half:  # kept alive here: the steps hold only their addresses
            self._q_bias = cupy.empty(d, numpy.float16), cupy.empty(2, numpy.float32)
        q_bias, q_out = self._q_bias or (None, None)
        product_bias = ("query_bias", (d, _X, _WQ, kv_half_alpha(d), addr(q_bias), addr(q_out))) if qdo_half else None
        (dy_sums, rows_a), = self._record_conversions(stage_a, shapes_a, product_bias)
        gemm, alpha = self._gemm, self._scaler.alpha
        half = dict(data_type=_R_16F)
        sms = _sm_shares(self.precision, mv, mt, d, self._sm_count)

        def output(buffer, slot_a, slot_b):  # the attention's inputs: fp16 ones at alpha kv_half_alpha, every
            # element under 2^14 (attention_bwd), fp32 ones at the alpha that undoes the copies' scales
            if buffer.dtype == numpy.float16:
                return dict(alpha=addr(self._constants, 8), out_type=_R_16F)
            return dict(alpha=alpha(slot_a, slot_b))

        self._fork()
        if qdo_half:  # the buffers are the plan's own: no pointer table needed
            self._steps.append((f"gemm {mv}x{d}x{d} + bias", self._handles[0].bias_gemm(
                OP_T, OP_N, d, mv, d, addr(q_out), WQ, d, X, d, addr(self._constants), addr(self._q0), d,
                addr(q_bias), sm_target=sms["q0"]), 0))
        else:
            gemm([X], [WQ], [addr(self._q0)], m=mv, n=d, k=d, lda=d, ldb=d, ldc=d, trans_b=True,
                 sm_target=sms["q0"], **output(self._q0, _X, _WQ), **half)
        gemm([T, T], [WK, WV], [addr(self._kv0), addr(self._kv0, self._kv0.itemsize * d)], m=mt, n=d, k=d, lda=d,
             ldb=d, ldc=2 * d, trans_b=True, lane=1, sm_target=sms["kv0"], **output(self._kv0, _T, _WKV), **half)
        gemm([DY], [WO], [addr(self._dout)], m=mv, n=d, k=d, lda=d, ldb=d, ldc=d, lane=2, sm_target=sms["dout"],
             **output(self._dout, _DY, _WO), **half)
        self._join()
        # dWo's alpha, written by the attention (see below); fp32: and the alpha of the product of
        # O's remainder, which the attention writes at a scale of its own
        inv, self._alpha_o = self._scaler.inverse_scale, cupy.empty(2, numpy.float32)
        self._o_half = (numpy.uint64(O), (inv(_T), inv(_WKV), inv(_BV), inv(_DY), inv(_O), addr(self._alpha_o)),
                        None if self._lo_offset is None else O + self._lo_offset)
        if qdo_half:
            self._qdo_scales = addr(q_out, 4), inv(_WO)
        self._record_attention()
        # dWo = dY^T O reads the attention's fp16 O and the first group's dY: it runs beside the
        # second conversion (the large cases overlap its products with the copy's bandwidth),
        # with the alpha the attention leaves, not the one that conversion's rescale sets.
        self._fork()
        gemm([DY], [O], ["grad_output_weight"], m=d, n=d, k=mv, lda=d, ldb=d, ldc=d, trans_a=True,
             alpha=addr(self._alpha_o), alpha_lo_b=addr(self._alpha_o, 4), lane=2, sm_target=sms["dwo"], **half)
        (dq_sums, rows_b), (dkv_sums, rows_kv) = self._record_conversions(stage_b, shapes_b)

        self._fork()
        gemm([DQ], [WQ], ["grad_video_latents"], m=mv, n=d, k=d, lda=d, ldb=d, ldc=d, alpha=alpha(_DQ, _WQ),
             sm_target=sms["dx"], **half)
        gemm([DQ], [X], ["grad_query_weight"], m=d, n=d, k=mv, lda=d, ldb=d, ldc=d, trans_a=True,
             alpha=alpha(_DQ, _X), sm_target=sms["dwq"], **half)
        # [Wk; Wv] is one copy: dT = [dK | dV] [Wk; Wv], one GEMM
        gemm([DK], [WK], ["grad_text_embeddings"], m=mt, n=d, k=2 * d, lda=2 * d, ldb=d, ldc=d,
             alpha=alpha(_DKV, _WKV), lane=1, sm_target=sms["dt"], **half)
        gemm([DK, DV], [T, T], ["grad_key_weight", "grad_value_weight"], m=d, n=d, k=mt,
             lda=2 * d, ldb=d, ldc=d, trans_a=True, alpha=alpha(_DKV, _T), lane=1, sm_target=sms["dwkv"], **half)
        # Bias gradients: the partial column sums the conversions wrote (of the fp32 tensors), added up.
        if rows_a == rows_b:
            self._record_column_sums([dy_sums, dq_sums], _VIDEO_BIASES, rows_a, d, lane=2)
        else:
            for sums, rows, bias in ((dy_sums, rows_a, _VIDEO_BIASES[:1]), (dq_sums, rows_b, _VIDEO_BIASES[1:])):
                self._record_column_sums([sums], bias, rows, d, lane=2)
        self._record_column_sums([dkv_sums, dkv_sums + 4 * d], _TEXT_BIASES, rows_kv, 2 * d, lane=2)
        self._join()

    def _record_tf32(self, mv, mt, d, addr):
        """The tf32 schedule: GEMMs read both operands K-major where it pays (transpose.cu says why).

        W^T copies for dO, dX and dT. The weight-gradient pairs that _weight_grads_tn picks read
        the transposes of both operands: O^T from the attention kernel (and dQ^T with its column
        sums, on long samples where dQ is whole: _dq_transposed), X^T, dY^T and T^T made beside
        the attention (they read inputs only), [dK | dV]^T (and dQ^T elsewhere) after it, each on
        the lane of the GEMM that reads it. Their K runs over the padded length (a multiple of 32,
        zeros past B·N): cuBLAS's "tn" kernels for B·N ≡ 2 (mod 4) took 1.5-2× as long.
        The transposes of dY, dQ and [dK | dV] (and the attention, with dQ^T) also write column
        sums by blocks of rows, which ones-row GEMMs (fp32) add up to the bias gradients; without
        them, ones-row GEMMs over the tensors themselves.
        """
        cupy = import_cupy()
        ldv, ldt = o_t_stride(mv), o_t_stride(mt)
        dq_transposed = self._attention.dq_transposed
        p = self.problem
        shapes = _tf32_shapes(mv, mt, d, dq_sums_rows(p.batch_size, p.num_video_tokens) if dq_transposed else 0)

        def buffer(name, make=cupy.empty):  # None where the schedule needs none (shape None)
            return None if shapes[name] is None else make(shapes[name], numpy.float32)

        self._wo_t, self._wqkv_t = buffer("wo_t"), buffer("wqkv_t")
        # The transposes' padding columns stay zero (the "tn" products run over the padded K).
        self._video_t, self._text_t = buffer("video_t", cupy.zeros), buffer("text_t", cupy.zeros)
        # dY's partial sums fill the first Transposed.row_tiles(B·Nv) rows; the rest stay zero.
        self._video_sums, self._text_sums = buffer("video_sums", cupy.zeros), buffer("text_sums")
        video_tn, text_tn = self._video_t is not None, self._text_t is not None
        tiles_t = Transposed.row_tiles(mt)
        O, DQ, DKV = addr(self._o), addr(self._dq), addr(self._dkv)
        table = self._table
        at = lambda *entries: table.address(table.add(*entries))  # noqa: E731
        step = lambda label, launch, lane: self._steps.append((label, launch, lane))  # noqa: E731
        gemm = self._gemm

        self._fork()
        # Q0 = X Wq^T and dO = dY (Wo^T)^T have the same shape: one batched GEMM, twice the tiles
        # of either (the small cases' single GEMMs fill one wave at a third of the tensor rate).
        step("Wo^T", Transposed(at("output_weight"), 1, addr(self._wo_t), d, d), 0)
        gemm(["video_latents", "grad_output"], ["query_weight", addr(self._wo_t)], [addr(self._q0), addr(self._dout)],
             m=mv, n=d, k=d, lda=d, ldb=d, ldc=d, trans_b=True)
        # K0|V0 on lane 2, where X^T, dY^T (issued after the join) then start behind it, not at once
        # beside Q0|dO; dX and dT read [Wq^T | Wk^T | Wv^T], made on lane 1 beside K0|V0 (the join
        # before the attention waits for the two side by side, not in series).
        gemm(["text_embeddings"] * 2, ["key_weight", "value_weight"], [addr(self._kv0), addr(self._kv0, 4 * d)],
             m=mt, n=d, k=d, lda=d, ldb=d, ldc=2 * d, trans_b=True, lane=2)
        step("[Wq^T | Wk^T | Wv^T]", Transposed(at("query_weight", "key_weight", "value_weight"), 3,
                                                addr(self._wqkv_t), d, d), 1)
        if self._kv0_half is not None:  # the streamed attention's fp16 [K0 | V0] (attention_bwd.half_kv)
            copy, rescale = self._kv_scaler.group(at(addr(self._kv0)), [(mt * 2 * d, addr(self._kv0_half), 0, 0, 0, 0)])
            step("[K0 | V0] to fp16", copy, 2)
            step("fp16 rescale [K0 | V0]", rescale, 2)
        self._join()
        if video_tn:
            X_T, DY_T, DQ_T = (addr(self._video_t, 4 * i * d * ldv) for i in range(3))
            sum_rows = self._video_sums.shape[1]
            DY_SUMS, DQ_SUMS = (addr(self._video_sums, 4 * i * sum_rows * d) for i in range(2))
            if dq_transposed:
                self._dq_t = DQ_T, DQ_SUMS
        self._record_attention()
        # Beside the attention (issued after the join, so it does not wait for them); only their own
        # lanes read them, after the fork below.
        if text_tn:
            T_T, DK_T, DV_T = (addr(self._text_t, 4 * i * d * ldt) for i in range(3))
            step("T^T", Transposed(at("text_embeddings"), 1, T_T, mt, d, ld=ldt), 1)
        if video_tn:
            step("X^T, dY^T", Transposed(at("video_latents", "grad_output"), 2, X_T, mv, d, ld=ldv,
                                         dst_step=d * ldv, sums=DY_SUMS, sum_from=1), 2)

        self._fork()
        sms = _sm_shares("tf32", mv, mt, d, self._sm_count)
        gemm([DQ], [addr(self._wqkv_t)], ["grad_video_latents"], m=mv, n=d, k=d, lda=d, ldb=3 * d, ldc=d,
             trans_b=True, sm_target=sms["dx"])
        if video_tn:  # dWo = dY^T (O^T)^T, dWq = dQ^T (X^T)^T
            if not dq_transposed:  # else the attention wrote dQ^T and its sums
                step("dQ^T", Transposed(at(DQ), 1, DQ_T, mv, d, ld=ldv, sums=DQ_SUMS), 2)
            self._record_column_sums([DY_SUMS, DQ_SUMS], _VIDEO_BIASES, sum_rows, d, lane=2)
            gemm([DY_T, DQ_T], [O, X_T], ["grad_output_weight", "grad_query_weight"], m=d, n=d, k=ldv,
                 lda=ldv, ldb=ldv, ldc=d, trans_b=True, lane=2)
        else:
            gemm(["grad_output", DQ], [O, "video_latents"], ["grad_output_weight", "grad_query_weight"], m=d, n=d,
                 k=mv, lda=d, ldb=d, ldc=d, trans_a=True, lane=2)
            self._record_column_sums(["grad_output", DQ], _VIDEO_BIASES, mv, d, lane=0)
        # dT = [dK | dV] [Wk^T | Wv^T]^T, one GEMM with K = 2D; below _DT_SPLIT_ROWS rows as two
        # batched halves of its columns: for B·Nt = 77 cuBLAS ran 256 × 128 tiles (43 µs against
        # 11 µs halved); from 100 rows on the single product is as fast or faster (perf-notes).
        parts = 2 if mt < _DT_SPLIT_ROWS else 1
        n = d // parts
        gemm([DKV] * parts, [addr(self._wqkv_t, 4 * (i * n * 3 * d + d)) for i in range(parts)],
             [("grad_text_embeddings", 4 * i * n) for i in range(parts)], m=mt, n=n, k=2 * d, lda=2 * d,
             ldb=3 * d, ldc=d, trans_b=True, lane=1, sm_target=sms["dt"])
        if text_tn:  # [dWk | dWv] = [dK | dV]^T (T^T)^T
            step("[dK | dV]^T", Transposed(at(DKV), 1, DK_T, mt, 2 * d, ld=ldt, sums=addr(self._text_sums)), 1)
            self._record_column_sums([addr(self._text_sums), addr(self._text_sums, 4 * d)], _TEXT_BIASES, tiles_t,
                                     2 * d, lane=1)
            gemm([DK_T, DV_T], [T_T, T_T], ["grad_key_weight", "grad_value_weight"], m=d, n=d, k=ldt,
                 lda=ldt, ldb=ldt, ldc=d, trans_b=True, lane=1)
        else:
            gemm([DKV, addr(self._dkv, 4 * d)], ["text_embeddings"] * 2, ["grad_key_weight", "grad_value_weight"],
                 m=d, n=d, k=mt, lda=2 * d, ldb=d, ldc=d, trans_a=True, lane=1)
            self._record_column_sums([DKV, addr(self._dkv, 4 * d)], _TEXT_BIASES, mt, 2 * d, lane=0)
        self._join()

    def _record_attention(self):
        """Record the attention kernel on the main lane. Steps close over what they use, not over
        self: an evicted plan is freed at once (no reference cycle waiting for the garbage collector)."""
        biases = self._table.address(self._table.add("query_bias", "key_bias", "value_bias"))
        o, o_scales, o_lo = self._o_half or (self._o, None, None)
        kv0, kv_scale = self._kv0, None
        if self._kv0_half is not None:
            kv0, kv_scale = self._kv0_half, self._kv_scaler.inverse_scale(0)
        attention, buffers = self._attention, (self._q0, kv0, biases, self._dout, o, self._dq, self._dkv,
                                               self._text_lengths, o_scales, o_lo, kv_scale, *self._dq_t)
        qdo_scales = self._qdo_scales
        self._steps.append(("attention", lambda: attention(*buffers, qdo_scales=qdo_scales), 0))

    def _record_column_sums(self, sources, outputs, rows, ld, lane):
        """Bias gradients: fp32 column sums of [rows][D] fp32 matrices (row stride ``ld``), a ones row
        times each (one batched GEMM)."""
        d = self.problem.hidden_size
        self._gemm([self._ones.data.ptr] * len(sources), sources, outputs, m=1, n=d, k=rows, lda=rows, ldb=ld, ldc=d,
                   data_type=_R_32F, compute=_COMPUTE_32F, lane=lane)

    def _record_conversions(self, tensors, shapes, product_bias=None):
        """Record the scaled fp16 copies of ``tensors`` [(source entry, dest address, slot[, parts,
        part_stride])] (HalfScaler.group: a source may be a sum of parts) of ``shapes`` [(elements,
        cols)] (fp32: and their remainders, at ``_lo_offset`` from each copy), and where
        ``product_bias`` is (source entry, HalfScaler.group's product_bias), that GEMM's bias,
        with the partial column sums of those given a row length ``cols``: [(address, rows)] of
        those, in order, where rows counts only the partial rows that can hold data (at most the
        tensor's rows: the rest are zeros, and the ones row that adds them up is only
        max(B·Nv, B·Nt) long)."""
        cupy = import_cupy()
        first = self._table.add(*(source for source, *_ in tensors), *product_bias[:1] if product_bias else ())
        lo = self._lo_offset
        sums = [cupy.empty(shape, numpy.float32) for shape in _column_sum_shapes(shapes, self._sm_count)]
        self._column_sums += sums
        addresses = iter(s.data.ptr for s in sums)
        copy, rescale = self._scaler.group(self._table.address(first),
                                           [(size, dest, slot, 0 if lo is None else dest + lo,
                                             next(addresses) if cols else 0, cols, *parts)
                                            for (size, cols), (_, dest, slot, *parts) in zip(shapes, tensors)],
                                           product_bias[1] if product_bias else None)
        self._steps += [(f"to fp16 x{len(tensors)}", copy, 0), (f"fp16 rescale x{len(tensors)}", rescale, 0)]
        summed_rows = [size // cols for size, cols in shapes if cols]
        return [(s.data.ptr, min(s.shape[0], rows)) for s, rows in zip(sums, summed_rows)]

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


def _kv0_buffers(precision, kv_half):
    """[K0 | V0]: the dtype its GEMM writes, and whether an fp16 copy of it is made. Where kv_half
    (attention_bwd.half_kv), the attention reads it as fp16 and copies its tiles as they are: the
    fp16 mode's GEMM writes fp16 (at alpha kv_half_alpha); the tf32 mode's TF32 GEMM can only write
    fp32, so a conversion at the scale of its own max makes the fp16 copy."""
    return (numpy.float16 if kv_half and precision == "fp16" else numpy.float32), kv_half and precision == "tf32"


def _conversion_shapes(mv, mt, d):
    """(element count, row length of its column sums or 0) of the tensors converted to fp16 before
    the attention (X, T, Wq, Wk, Wv, Wo, dY, and bv, whose scale bounds max|bv| for the attention's
    O) and after it (dQ, [dK | dV]): the bias gradients are the column sums of dY, dQ and [dK | dV]."""
    return ([(mv * d, 0), (mt * d, 0), (d * d, 0), (d * d, 0), (d * d, 0), (d * d, 0), (mv * d, d), (d, 0)],
            [(mv * d, d), (2 * mt * d, 2 * d)])


def _column_sum_shapes(shapes, sm_count):
    """Shapes of the partial column sums that one conversion group of ``shapes`` writes, one per
    tensor with a row length (see half_scaling.column_sum_rows)."""
    sizes = [size for size, _ in shapes]
    sum_cols = [cols for _, cols in shapes if cols]
    return list(zip(column_sum_rows(sizes, sum_cols, sm_count), sum_cols))


def _half_elements(mv, mt, d):
    """Sizes (fp16 elements, each rounded up to 256 bytes) of the fp16 copies, in their order in
    the one allocation: X, T, Wq, [Wk; Wv], Wo, dY, O, dQ, [dK | dV], bv."""
    sizes = [mv * d, mt * d, d * d, 2 * d * d, d * d, mv * d, mv * d, mv * d, 2 * mt * d, d]
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
