"""A naive CuPy composition of the backward: the baseline for accuracy tests and the sweep.

Every product is a cuBLAS call at the mode's precision (fp16: operands cast to fp16 without
scaling, fp32 accumulation); the softmax and its gradient are elementwise CuPy in fp32; the
scores S, P and dS go through global memory. The library's errors are judged against this.
"""

import math

import numpy

from . import gemm
from ._cupy import import_cupy
from .grads import INPUT_NAMES, CrossAttentionGrads


def backward(inputs, *, precision, num_heads=16, scale=None):
    """Gradients of the layer, naively. ``inputs``: dict by name or the 11 arrays in order."""
    cupy = import_cupy()
    if isinstance(inputs, dict):
        inputs = tuple(inputs[name] for name in INPUT_NAMES)
    dy, x, t, wq, bq, wk, bk, wv, bv, wo, _ = (
        cupy.ascontiguousarray(cupy.asarray(a, dtype=numpy.float32)) for a in inputs)
    b, nv, d = x.shape
    nt = t.shape[1]
    h = num_heads
    hd = d // h
    scale = 1.0 / math.sqrt(hd) if scale is None else scale
    compute = gemm.COMPUTE_TYPE[precision]
    operand = (lambda a: a.astype(numpy.float16)) if precision == "fp16" else (lambda a: a)

    def mm(a, bm, trans_a=False, trans_b=False):
        rows = a.shape[1] if trans_a else a.shape[0]
        cols = bm.shape[0] if trans_b else bm.shape[1]
        c = cupy.empty((rows, cols), numpy.float32)
        return gemm.matmul(operand(a), operand(bm), c, trans_a=trans_a, trans_b=trans_b, compute=compute)

    def bmm(a, bm, trans_a=False, trans_b=False):
        rows = a.shape[2] if trans_a else a.shape[1]
        cols = bm.shape[1] if trans_b else bm.shape[2]
        c = cupy.empty((a.shape[0], rows, cols), numpy.float32)
        return gemm.matmul_batched(operand(a), operand(bm), c, trans_a=trans_a, trans_b=trans_b,
                                   compute=compute)

    def heads(m, n):  # (B·n, D) -> (B·H, n, hd)
        return cupy.ascontiguousarray(m.reshape(b, n, h, hd).transpose(0, 2, 1, 3)).reshape(b * h, n, hd)

    def merge(m, n):  # (B·H, n, hd) -> (B·n, D)
        return cupy.ascontiguousarray(m.reshape(b, h, n, hd).transpose(0, 2, 1, 3)).reshape(b * n, d)

    x2, t2, dy2 = x.reshape(-1, d), t.reshape(-1, d), dy.reshape(-1, d)
    qh = heads(mm(x2, wq, trans_b=True) + bq, nv)
    kh = heads(mm(t2, wk, trans_b=True) + bk, nt)
    vh = heads(mm(t2, wv, trans_b=True) + bv, nt)
    s = bmm(qh, kh, trans_b=True) * numpy.float32(scale)
    p = cupy.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    o = merge(bmm(p, vh), nv)
    do_h = heads(mm(dy2, wo), nv)
    dv = merge(bmm(p, do_h, trans_a=True), nt)
    dp = bmm(do_h, vh, trans_b=True)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True)) * numpy.float32(scale)
    dq = merge(bmm(ds, kh), nv)
    dk = merge(bmm(ds, qh, trans_a=True), nt)
    return CrossAttentionGrads(
        grad_video_latents=mm(dq, wq).reshape(b, nv, d),
        grad_text_embeddings=(mm(dk, wk) + mm(dv, wv)).reshape(b, nt, d),
        grad_query_weight=mm(dq, x2, trans_a=True), grad_query_bias=dq.sum(axis=0),
        grad_key_weight=mm(dk, t2, trans_a=True), grad_key_bias=dk.sum(axis=0),
        grad_value_weight=mm(dv, t2, trans_a=True), grad_value_bias=dv.sum(axis=0),
        grad_output_weight=mm(dy2, o, trans_a=True), grad_output_bias=dy2.sum(axis=0))
