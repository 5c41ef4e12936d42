"""The CuPy forward: cuBLAS projections around the fused attention-forward kernel.

    Q0 = X Wq^T     [K0 | V0] = T [Wk | Wv]^T     O = attention(Q0 + bq, K0 + bk, V0 + bv)
    Y = O Wo^T + bo

Issued eagerly on the current stream (a training step calls it once per layer; the backward is
the part with a plan). bq is added inside the attention kernel and bv to O there; bk cancels in the softmax.
"""

import numpy

from . import gemm
from ._cupy import import_cupy
from .attention_fwd import AttentionForward

PRECISIONS = ("fp32", "tf32")


def run(problem, inputs, precision, text_lengths=None):
    """Y (B, Nv, D) float32 CuPy array.

    Parameters
    ----------
    problem : checks.Problem
    inputs : the 10 C-contiguous float32 CuPy arrays X, T, Wq, bq, Wk, bk, Wv, bv, Wo, bo.
    precision : "fp32" (FFMA GEMMs, 3xTF32 attention) or "tf32".
    text_lengths : (B,) int32 NumPy array, or None (every text token).
    """
    cupy = import_cupy()
    b, nv, nt, d = problem.batch_size, problem.num_video_tokens, problem.num_text_tokens, problem.hidden_size
    x, t, wq, bq, wk, bk, wv, bv, wo, bo = inputs
    compute = gemm.COMPUTE_TYPE[precision]
    q0, kv0, o = (cupy.empty(shape, numpy.float32) for shape in ((b * nv, d), (b * nt, 2 * d), (b * nv, d)))
    gemm.matmul(x.reshape(b * nv, d), wq, q0, trans_b=True, compute=compute)
    gemm.matmul(t.reshape(b * nt, d), wk, kv0[:, :d], trans_b=True, compute=compute)
    gemm.matmul(t.reshape(b * nt, d), wv, kv0[:, d:], trans_b=True, compute=compute)
    # Small per-call device arrays: freed at return, their memory is reused in stream order.
    biases = cupy.array([bq.data.ptr, bk.data.ptr, bv.data.ptr], numpy.uint64)
    lengths = cupy.full(b, nt, numpy.int32) if text_lengths is None else cupy.asarray(text_lengths, numpy.int32)
    AttentionForward(problem, precision)(q0, kv0, biases.data.ptr, lengths, o)
    y = cupy.empty((b * nv, d), numpy.float32)
    y[...] = bo
    gemm.matmul(o, wo, y, trans_b=True, compute=compute, accumulate=True)
    return y.reshape(b, nv, d)
