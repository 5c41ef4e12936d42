"""Tell initcheck's reports about our kernels from reports about what wrote their inputs.

initcheck flags a read of global memory that no tracked write initialised. Two probes, each run
under initcheck, e.g. ``PYTHONPATH=. compute-sanitizer --tool initcheck python3
scripts/initcheck_probe.py kernels 1x100x93``:

    gemm       C = A @ B by cuBLAS (TF32, the backward's GEMM shape class), then a CuPy
               reduction reads C. A report here is about how cuBLAS wrote C, not about the reader.
    kernels    every kernel of ours alone, on each shape (BxNvxNt or BxNvxNt:D:H, default
               2x64x77): the fused attention kernels (backward, then forward) with every text
               token and with padded lengths (and the backward reading an fp16 [K0 | V0] where
               attention_bwd.half_kv says, and fp16 Q0 and dO too where half_qdo says: the lean
               kernel's fp16 build; in tf32 also writing O^T, and O^T with dQ^T and dQ's
               column sums where dQ is whole), then the fp16 scaling (copies and remainders,
               and bq's copy at Q0's scale, as the fp16 mode's first group writes it) and
               the tf32 mode's transposes (weights side by side, X^T and dY^T apart, [dK | dV]^T)
               on tensors of the backward's sizes; inputs copied from the
               host (cudaMemcpy), outputs poisoned first. A report here is a read of memory our
               code never wrote. scripts/sanitize.sh runs racecheck on this probe too.
"""
import argparse
import itertools

import cupy
import numpy

import sanitize
from cupy_xattn import attention_bwd, attention_fwd, gemm
from cupy_xattn.checks import Problem
from cupy_xattn.half_scaling import HalfScaler, column_sum_rows
from cupy_xattn.transpose import Transposed


def probe_gemm():
    rng = numpy.random.default_rng(0)
    a = cupy.asarray(rng.standard_normal((512, 1024), dtype=numpy.float32))
    b = cupy.asarray(rng.standard_normal((1024, 1024), dtype=numpy.float32))
    c = cupy.empty((512, 1024), numpy.float32)
    gemm.matmul(a, b, c, trans_b=True)
    print("gemm: sum of C =", float(c.sum()), flush=True)


def probe_attention(shape, precision):
    """Both attention kernels of one shape (BxNvxNt or BxNvxNt:D:H), every text token and then
    padded lengths (sanitize.padded_lengths); the dK/dV reduction runs when the query rows are
    chunked, dQ's when the keys are (the streamed kernel's key parts)."""
    case, hidden, heads = sanitize.parse(shape)
    b, nv, nt = case.batch_size, case.num_video_tokens, case.num_text_tokens
    rng = numpy.random.default_rng(0)
    host = lambda *shape: cupy.asarray(rng.standard_normal(shape, dtype=numpy.float32))  # noqa: E731
    q0, kv0, dout = host(b * nv, hidden), host(b * nt, 2 * hidden), host(b * nv, hidden)
    biases = [host(hidden) for _ in range(3)]
    table = cupy.array([x.data.ptr for x in biases], numpy.uint64)
    sm_count = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["multiProcessorCount"]
    problem = Problem(b, nv, nt, hidden, heads, hidden // heads, (hidden // heads) ** -0.5)
    # As the backward runs it: tf32 writes O^T (D rows of stride o_t_stride(B·Nv), the first B·Nv
    # columns) from 1024 video rows, O below; both here, whatever the shape. fp16 and fp32 write O as
    # fp16 (fp32: and its remainder) at a scale from a bound on |V| (inverse scales of T, the weights
    # and bv: 2^-15, 2^-10, 2^-12 bound max|V| by hidden · 32 + 8 here); inv_o, alpha_o (fp32: two) written.
    o_half = precision != "tf32"
    inv_dy = 2.0 ** -3
    o_scales = (cupy.array([2.0 ** -15, 2.0 ** -10, 2.0 ** -12, inv_dy] + [numpy.nan] * 3, numpy.float32)
                if o_half else None)
    forward = attention_fwd.AttentionForward(problem, "fp32" if precision == "fp32" else "tf32")
    # K0 | V0 in fp16 too where the backward reads it so (attention_bwd.half_kv): at s_KV = alpha /
    # (inv_t · inv_w) in the fp16 mode, at a given 1 / s_KV in tf32 (as the conversion leaves it).
    half = attention_bwd.half_kv(problem, precision, sm_count)
    kv0_half, kv_scale = None, None
    if half:
        s_kv = (attention_bwd.kv_half_alpha(hidden) / float(o_scales[0] * o_scales[1]) if o_half
                else 2.0 ** (13 - numpy.floor(numpy.log2(float(cupy.abs(kv0).max())))))
        kv0_half = (kv0 * s_kv).astype(numpy.float16)
        kv_scale = None if o_half else cupy.array([1 / s_kv], numpy.float32)
    # tf32's O^T also with dQ^T and dQ's column sums (dq_transposed) where dQ is whole, whatever
    # the samples' length (the backward asks for them on long ones: backward._dq_transposed).
    whole_dq = attention_bwd.launch_layout(problem, precision, sm_count).kv_parts == 1
    layouts = [(False, False)] + ([(True, False)] + [(True, True)] * whole_dq if precision == "tf32" else [])
    variants = [(o_t, dq_t, kv_half, False) for (o_t, dq_t), kv_half in
                itertools.product(layouts, (False, True) if half else (False,))]
    # attn_bwd_lean's fp16 build where the backward runs it (half_qdo): Q0 + bq and dO in fp16 too,
    # at s_Q (given: 2^-5 here) and kv_half_alpha / (inv_dy · inv_wo) (inverse scales 2^-3 and
    # 2^-20 here). The tf32 mode's lean build is its plain one where lean_tf32 holds for the
    # shape (e.g. 2x4096x77).
    qdo = attention_bwd.half_qdo(problem, precision, sm_count)
    if qdo:
        variants.append((False, False, True, True))
        s_q, inv_wo = 2.0 ** -5, 2.0 ** -20
        qdo_scales = cupy.array([s_q, inv_wo], numpy.float32)
        alpha = attention_bwd.kv_half_alpha(hidden)
        q0_half = ((q0 + biases[0]) * s_q).astype(numpy.float16)
        dout_half = (dout * (alpha / (inv_dy * inv_wo))).astype(numpy.float16)
    for (o_transposed, dq_transposed, kv_half, qdo_half), lengths in itertools.product(
            variants, (numpy.full(b, nt, numpy.int32), *sanitize.padded_lengths(b, nt))):
        backward = attention_bwd.AttentionBackward(problem, precision, sm_count, o_transposed=o_transposed,
                                                   o_half=o_half, kv_half=kv_half, dq_transposed=dq_transposed,
                                                   qdo_half=qdo_half)
        o_shape = (hidden, attention_bwd.o_t_stride(b * nv)) if o_transposed else q0.shape
        lengths = cupy.asarray(lengths)
        o, dq, dkv, y = (cupy.full(shape, numpy.nan, numpy.float32)
                         for shape in (o_shape, q0.shape, kv0.shape, q0.shape))  # poisoned
        dq_t, dq_sums = ((cupy.full(o_shape, numpy.nan, numpy.float32),
                          cupy.full((attention_bwd.dq_sums_rows(b, nv), hidden), numpy.nan, numpy.float32))
                         if dq_transposed else (None, None))
        o_lo = None
        if o_half:
            o = o.astype(numpy.float16)
            o_lo = o.copy() if precision == "fp32" else None
        backward(q0_half if qdo_half else q0, kv0_half if kv_half else kv0, table.data.ptr,
                 dout_half if qdo_half else dout, o, dq, dkv, lengths,
                 o_scales=None if o_scales is None else tuple(o_scales.data.ptr + 4 * i for i in range(6)),
                 o_lo=None if o_lo is None else o_lo.data.ptr,
                 kv_scale=kv_scale.data.ptr if kv_half and kv_scale is not None else None,
                 dq_t=None if dq_t is None else dq_t.data.ptr, dq_sums=None if dq_sums is None else dq_sums.data.ptr,
                 qdo_scales=tuple(qdo_scales.data.ptr + 4 * i for i in range(2)) if qdo_half else None)
        forward(q0, kv0, table.data.ptr, lengths, y)
        outputs = ((o[:, :b * nv] if o_transposed else o, dq, dkv, y) + (() if o_lo is None else (o_lo,))
                   + (() if dq_t is None else (dq_t[:, :b * nv], dq_sums)))
        finite = all(bool(cupy.isfinite(x).all()) for x in outputs)
        print(f"attention {shape} {precision}{' fp16 K0|V0' if kv_half else ''}{' and Q0, dO (lean)' if qdo_half else ''}"
              f"{' dQ^T' if dq_transposed else ''}: "
              f"outputs finite: {finite}", flush=True)
        if not finite:  # an output the kernels left unwritten keeps its NaN poison
            raise SystemExit(1)


def probe_conversions(shape):
    """fp16 copies and remainders of one shape's X, T, Wq, Wk, Wv, Wo, dY, O, dQ, [dK | dV] (the sum
    of two chunks' partials, as the half modes take it), with the partial column sums of dY, dQ and
    [dK | dV], and bq's copy at the scale of X Wq^T (the rescale's product bias); the tf32 mode's
    transposes of the weights (side by side), of X and dY and of [dK | dV] (rows padded as there),
    with column sums of dY and [dK | dV]."""
    case, d, _ = sanitize.parse(shape)
    mv, mt = case.batch_size * case.num_video_tokens, case.batch_size * case.num_text_tokens
    sizes = [mv * d, mt * d, d * d, d * d, d * d, d * d, mv * d, mv * d, mv * d, 2 * mt * d]
    rng = numpy.random.default_rng(0)
    parts = [1] * 9 + [2]
    sources = [cupy.asarray(rng.standard_normal(n * size, dtype=numpy.float32)) for n, size in zip(parts, sizes)]
    bq = cupy.asarray(rng.standard_normal(d, dtype=numpy.float32))  # Q0's bias, as the fp16 mode's first group
    table = cupy.array([x.data.ptr for x in sources] + [bq.data.ptr], numpy.uint64)
    sm_count = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["multiProcessorCount"]
    halves = [(cupy.full(size, numpy.nan, numpy.float16), cupy.full(size, numpy.nan, numpy.float16)) for size in sizes]
    scaler = HalfScaler(len(sizes), sm_count)
    bq_half, bq_out = cupy.full(d, numpy.nan, numpy.float16), cupy.full(2, numpy.nan, numpy.float32)
    row_lengths = [0] * 6 + [d, 0, d, 2 * d]  # column sums of dY, dQ, [dK | dV]
    sum_rows = iter(column_sum_rows(sizes, [c for c in row_lengths if c], sm_count))
    sums = [cupy.full((next(sum_rows), c), numpy.nan, numpy.float32) if c else None for c in row_lengths]
    copy, rescale = scaler.group(table.data.ptr, [(size, hi.data.ptr, i, lo.data.ptr, s.data.ptr if c else 0, c, n,
                                                   size) for i, (size, (hi, lo), s, c, n)
                                                  in enumerate(zip(sizes, halves, sums, row_lengths, parts))],
                                  (d, 0, 2, attention_bwd.kv_half_alpha(d), bq_half.data.ptr, bq_out.data.ptr))
    copy(), rescale()
    weights_t = cupy.full((d, 4 * d), numpy.nan, numpy.float32)
    x_t = cupy.full((2, d, attention_bwd.o_t_stride(mv)), numpy.nan, numpy.float32)  # X^T, dY^T apart
    dkv_t = cupy.full((2 * d, attention_bwd.o_t_stride(mt)), numpy.nan, numpy.float32)
    Transposed(table.data.ptr + 8 * 2, 4, weights_t.data.ptr, d, d)()
    video = cupy.array([sources[0].data.ptr, sources[6].data.ptr], numpy.uint64)
    dy_t_sums = cupy.full((Transposed.row_tiles(mv), d), numpy.nan, numpy.float32)
    dkv_t_sums = cupy.full((Transposed.row_tiles(mt), 2 * d), numpy.nan, numpy.float32)
    Transposed(video.data.ptr, 2, x_t.data.ptr, mv, d, ld=x_t.shape[2], dst_step=d * x_t.shape[2],
               sums=dy_t_sums.data.ptr, sum_from=1)()
    Transposed(table.data.ptr + 8 * 9, 1, dkv_t.data.ptr, mt, 2 * d, ld=dkv_t.shape[1], sums=dkv_t_sums.data.ptr)()
    finite = all(bool(cupy.isfinite(x).all())
                 for x in [*(x for pair in halves for x in pair), *(s for s in sums if s is not None), bq_half, bq_out,
                           weights_t,
                           x_t[:, :, :mv], dkv_t[:, :mt], dy_t_sums, dkv_t_sums])
    print(f"conversions {shape}: outputs finite: {finite}", flush=True)
    if not finite:
        raise SystemExit(1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("probe", choices=["gemm", "kernels"])
    parser.add_argument("shapes", nargs="*", default=["2x64x77"], help="BxNvxNt[:D:H] of the kernels probe")
    parser.add_argument("--precision", default="tf32", choices=["fp32", "tf32", "fp16"])
    args = parser.parse_args()
    if args.probe == "gemm":
        probe_gemm()
    else:
        for shape in args.shapes:
            probe_attention(shape, args.precision)
            probe_conversions(shape)


if __name__ == "__main__":
    main()
