"""The fused attention kernel alone against the float64 reference attention (marker ``gpu``)."""
import numpy
import pytest

from cupy_xattn import attention_bwd, reference
from cupy_xattn.checks import Problem

pytestmark = pytest.mark.gpu

# Relative max error of O, dQ, dK, dV: TF32 products (10-bit mantissa) vs the 3xTF32 split.
TOLERANCE = {"tf32": 5e-3, "fp32": 2e-5}


@pytest.mark.parametrize("precision, o_transposed", [("tf32", False), ("tf32", True), ("fp32", False)])
@pytest.mark.parametrize("resident_rows", [64, 128])
@pytest.mark.parametrize("batch_size, n_video, n_text", [
    (1, 1, 1), (2, 64, 77), (2, 691, 77), (1, 4096, 77), (8, 256, 373), (1, 100, 512), (3, 33, 31),
    (2, 130, attention_bwd.RESIDENT_MAX_KEYS), (2, 130, attention_bwd.RESIDENT_MAX_KEYS + 1)])
def test_attention_kernel_matches_reference(batch_size, n_video, n_text, precision, o_transposed, resident_rows,
                                            monkeypatch):
    import cupy
    monkeypatch.setattr(attention_bwd, "RESIDENT_BLOCK_Q", resident_rows)
    heads, hidden = 16, 1024
    rng = numpy.random.default_rng(n_video * 1000 + n_text)
    q0 = rng.standard_normal((batch_size * n_video, hidden), dtype=numpy.float32)
    kv0 = rng.standard_normal((batch_size * n_text, 2 * hidden), dtype=numpy.float32)
    dout = rng.standard_normal((batch_size * n_video, hidden), dtype=numpy.float32)
    bq, bk, bv = (rng.standard_normal(hidden, dtype=numpy.float32) for _ in range(3))
    problem = Problem(batch_size, n_video, n_text, hidden, heads, 64, 0.125)

    poison = lambda shape: cupy.full(shape, numpy.nan, numpy.float32)  # noqa: E731
    rows = batch_size * n_video
    o = poison((hidden, attention_bwd.o_t_stride(rows))) if o_transposed else poison(q0.shape)  # tf32's O^T
    dq, dkv = poison(q0.shape), poison(kv0.shape)
    biases = [cupy.asarray(b) for b in (bq, bk, bv)]
    bias_table = cupy.array([b.data.ptr for b in biases], numpy.uint64)
    sm_count = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["multiProcessorCount"]
    kernel = attention_bwd.AttentionBackward(problem, precision, sm_count, o_transposed=o_transposed)
    kernel(cupy.asarray(q0), cupy.asarray(kv0), bias_table.data.ptr, cupy.asarray(dout), o, dq, dkv)

    f64 = lambda a, n: a.astype(numpy.float64).reshape(batch_size, n, -1)  # noqa: E731
    q = f64(q0, n_video) + bq
    k = f64(kv0[:, :hidden], n_text) + bk
    v = f64(kv0[:, hidden:], n_text) + bv
    do = f64(dout, n_video)
    ref_o = reference.attention(q, k, v, 0.125, num_heads=heads)
    ref_dq, ref_dk, ref_dv = reference.attention_backward(do, q, k, v, 0.125, num_heads=heads)
    got_dkv = cupy.asnumpy(dkv).reshape(batch_size, n_text, 2 * hidden)
    got_o = cupy.asnumpy(o)[:, :rows].T if o_transposed else cupy.asnumpy(o)
    pairs = {"O": (got_o, ref_o), "dQ": (cupy.asnumpy(dq), ref_dq),
             "dK": (got_dkv[..., :hidden], ref_dk), "dV": (got_dkv[..., hidden:], ref_dv)}
    scale_dq = numpy.abs(ref_dv).max()  # dQ and dK are exactly 0 when n_text = 1
    errors = {}
    for name, (got, ref) in pairs.items():
        size = max(numpy.abs(ref).max(), 1e-9 * scale_dq) if n_text > 1 else scale_dq
        errors[name] = float(numpy.abs(got.reshape(ref.shape) - ref).max() / size)
    assert all(e <= TOLERANCE[precision] for e in errors.values()), errors
