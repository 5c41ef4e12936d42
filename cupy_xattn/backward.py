"""The CuPy backend: cuBLAS projections around the fused attention-backward kernel.

With Mv = B·Nv video rows, Mt = B·Nt text rows and Wkv = [Wk; Wv] (2D × D):

    Q0 = X Wq^T      KV0 = T Wkv^T      dO = dY Wo                    (biases added in the kernel)
    attention kernel → O, dQ, dKV = [dK | dV]
    dWo = dY^T O     dX = dQ Wq     dWq = dQ^T X     dT = dKV Wkv     [dWk; dWv] = dKV^T T
    dbo, dbq, [dbk | dbv] = column sums of dY, dQ, dKV                (fp32 GEMMs with a ones row)

Every GEMM runs at the mode's precision: fp32 (IEEE FFMA), tf32 (TF32 tensor cores) or fp16
(operands copied to fp16 with per-tensor power-of-two scales, undone by each GEMM's alpha).
The bias sums stay in fp32 in every mode. No step uses atomics whose order varies, so two
calls give bitwise-identical results.
"""

import functools

import numpy

from . import gemm
from ._cupy import import_cupy
from .attention_bwd import attention_backward
from .grads import CrossAttentionGrads
from .half_scaling import HalfScaler

# Scale slots of the fp16 mode, one per GEMM operand.
_X, _T, _WQ, _WKV, _WO, _DY, _O, _DQ, _DKV = range(9)
_N_SLOTS = 9


@functools.lru_cache(maxsize=None)
def _sm_count(device_id):
    return import_cupy().cuda.runtime.getDeviceProperties(device_id)["multiProcessorCount"]


_ones_cache = {}  # device id -> CuPy ones vector, grown on demand (rows of the bias sums)


def _ones(cupy, n):
    device = cupy.cuda.Device().id
    ones = _ones_cache.get(device)
    if ones is None or ones.size < n:
        ones = _ones_cache[device] = cupy.ones(max(n, 4096), numpy.float32)
    return ones[:n].reshape(1, n)


class _Operands:
    """GEMM operands of one precision mode: the fp32 arrays themselves, or scaled fp16 copies."""

    def __init__(self, precision, sm_count):
        self.compute = gemm.COMPUTE_TYPE[precision]
        self.scaler = HalfScaler(_N_SLOTS, sm_count) if precision == "fp16" else None

    def add(self, x, slot):
        return (x if self.scaler is None else self.scaler.convert(x, slot)), slot

    def ready(self):
        """Make the alphas of the operands added so far available to the GEMMs that follow."""
        if self.scaler is not None:
            self.scaler.update_alphas()

    def matmul(self, a, b, c, **kwargs):
        (a, i), (b, j) = a, b
        alpha_device = None if self.scaler is None else self.scaler.alpha(i, j)
        gemm.matmul(a, b, c, compute=self.compute, alpha_device=alpha_device, **kwargs)


def allocate_grads(problem):
    """Fresh outputs; dWk and dWv are adjacent so that one GEMM writes both."""
    cupy = import_cupy()
    b, nv, nt, d = (problem.batch_size, problem.num_video_tokens, problem.num_text_tokens,
                    problem.hidden_size)
    empty = functools.partial(cupy.empty, dtype=numpy.float32)
    w_kv = empty((2, d, d))
    return CrossAttentionGrads(
        grad_video_latents=empty((b, nv, d)), grad_text_embeddings=empty((b, nt, d)),
        grad_query_weight=empty((d, d)), grad_query_bias=empty(d),
        grad_key_weight=w_kv[0], grad_key_bias=empty(d),
        grad_value_weight=w_kv[1], grad_value_bias=empty(d),
        grad_output_weight=empty((d, d)), grad_output_bias=empty(d))


def run(problem, inputs, *, precision, out=None):
    """Compute the 10 gradients on the GPU.

    Parameters
    ----------
    problem : checks.Problem of a validated call.
    inputs : the 11 arrays in the public argument order, C-contiguous float32 CuPy arrays.
    precision : "fp32", "tf32" or "fp16".
    out : CrossAttentionGrads of C-contiguous float32 CuPy arrays to fill, or None.

    Returns
    -------
    CrossAttentionGrads of CuPy arrays (``out`` itself when given).
    """
    cupy = import_cupy()
    dy, x, t, wq, bq, wk, bk, wv, bv, wo, _ = inputs
    b, nv, nt, d = (problem.batch_size, problem.num_video_tokens, problem.num_text_tokens,
                    problem.hidden_size)
    mv, mt = b * nv, b * nt
    g = allocate_grads(problem) if out is None else out
    empty = functools.partial(cupy.empty, dtype=numpy.float32)
    sm_count = _sm_count(cupy.cuda.Device().id)

    ops = _Operands(precision, sm_count)
    X, T = ops.add(x.reshape(mv, d), _X), ops.add(t.reshape(mt, d), _T)
    WQ, WO = ops.add(wq, _WQ), ops.add(wo, _WO)
    WKV = ops.add(cupy.concatenate((wk, wv)), _WKV)
    DY = ops.add(dy.reshape(mv, d), _DY)
    ops.ready()

    q0, kv0, dout = empty((mv, d)), empty((mt, 2 * d)), empty((mv, d))
    ops.matmul(X, WQ, q0, trans_b=True)
    ops.matmul(T, WKV, kv0, trans_b=True)
    ops.matmul(DY, WO, dout)

    o, dq, dkv = empty((mv, d)), empty((mv, d)), empty((mt, 2 * d))
    attention_backward(problem, q0, kv0, dout, bq, bk, bv, o=o, dq=dq, dkv=dkv, precision=precision)
    del q0, kv0, dout

    O, DQ, DKV = ops.add(o, _O), ops.add(dq, _DQ), ops.add(dkv, _DKV)
    ops.ready()
    ops.matmul(DY, O, g.grad_output_weight, trans_a=True)
    ops.matmul(DQ, WQ, g.grad_video_latents.reshape(mv, d))
    ops.matmul(DQ, X, g.grad_query_weight, trans_a=True)
    ops.matmul(DKV, WKV, g.grad_text_embeddings.reshape(mt, d))
    w_k, w_v = g.grad_key_weight, g.grad_value_weight
    if w_v.data.ptr == w_k.data.ptr + w_k.nbytes:  # adjacent: [dWk; dWv] in one GEMM
        w_kv = cupy.ndarray((2 * d, d), numpy.float32, memptr=w_k.data)
        ops.matmul(DKV, T, w_kv, trans_a=True)
    else:
        dkv_op, slot = DKV
        ops.matmul((dkv_op[:, :d], slot), T, w_k, trans_a=True)
        ops.matmul((dkv_op[:, d:], slot), T, w_v, trans_a=True)

    # Bias gradients: column sums in fp32 (a ones row times the matrix).
    fp32 = gemm.COMPUTE_32F
    ones_v, ones_t = _ones(cupy, mv), _ones(cupy, mt)
    gemm.matmul(ones_v, dy.reshape(mv, d), g.grad_output_bias.reshape(1, d), compute=fp32)
    gemm.matmul(ones_v, dq, g.grad_query_bias.reshape(1, d), compute=fp32)
    gemm.matmul(ones_t, dkv[:, :d], g.grad_key_bias.reshape(1, d), compute=fp32)
    gemm.matmul(ones_t, dkv[:, d:], g.grad_value_bias.reshape(1, d), compute=fp32)
    return g
