"""The public call: backends, array types, out=, and the hand-off to the GPU code (mocked here)."""
import hashlib
import subprocess
import sys
import types

import numpy
import pytest

import cupy_xattn
from cupy_xattn import CrossAttentionGrads, cross_attention_backward, reference
from cupy_xattn._cupy import NoGPUError
from cupy_xattn.cases import Case, make_inputs
from cupy_xattn.checks import Problem

H = 4


@pytest.fixture
def inputs():
    return make_inputs(Case(2, 7, 5, atol=0.0), hidden_size=16, seed=0)


def _expected(inputs, scale=None):
    return [g.astype(numpy.float32) for g in reference.backward(*inputs.values(), scale, num_heads=H)]


def _digest(arrays):
    return [hashlib.sha256(numpy.ascontiguousarray(a).tobytes()).hexdigest() for a in arrays]


def _assert_equal(got, expected):
    for name, g, e in zip(CrossAttentionGrads._fields, got, expected):
        assert isinstance(g, numpy.ndarray) and g.dtype == numpy.float32, name
        numpy.testing.assert_array_equal(g, e, err_msg=name)


def test_numpy_backend_is_the_reference_in_float32(inputs):
    before = _digest(inputs.values())
    grads = cross_attention_backward(*inputs.values(), 0.3, num_heads=H, backend="numpy")
    assert isinstance(grads, CrossAttentionGrads)
    _assert_equal(grads, _expected(inputs, 0.3))
    assert _digest(inputs.values()) == before


def test_keywords_and_non_contiguous_inputs(inputs):
    # Same values, other layouts: Fortran-ordered weights, latents read with a stride.
    strided = numpy.empty((2, 14, 16), numpy.float32)
    strided[:, ::2] = inputs["video_latents"]
    odd = dict(inputs, video_latents=strided[:, ::2], query_weight=numpy.asfortranarray(inputs["query_weight"]))
    before = _digest(odd.values())
    grads = cross_attention_backward(**odd, num_heads=H, backend="numpy")
    _assert_equal(grads, _expected(inputs))
    assert _digest(odd.values()) == before


def test_out_buffers_are_filled_and_returned(inputs):
    out = CrossAttentionGrads(*(numpy.full_like(a, numpy.nan) for a in list(inputs.values())[1:]))
    grads = cross_attention_backward(*inputs.values(), num_heads=H, backend="numpy", out=out)
    assert all(g is o for g, o in zip(grads, out))
    _assert_equal(out, _expected(inputs))


def test_out_may_be_a_list_of_strided_views(inputs):
    wide = [numpy.zeros(a.shape[:-1] + (2 * a.shape[-1],), numpy.float32) for a in list(inputs.values())[1:]]
    out = [w[..., ::2] for w in wide]
    grads = cross_attention_backward(*inputs.values(), num_heads=H, backend="numpy", out=out)
    assert all(g is o for g, o in zip(grads, out))
    _assert_equal(out, _expected(inputs))
    assert all(not w[..., 1::2].any() for w in wide)


@pytest.fixture
def mocked_gpu(monkeypatch):
    """A 'GPU' made of NumPy: fake CuPy functions and a fake plan cache that records its launches."""
    fake_cupy = types.SimpleNamespace(ndarray=numpy.ndarray, asarray=numpy.asarray,
                                      ascontiguousarray=numpy.ascontiguousarray)
    calls = []

    class FakePlan:
        def __init__(self, problem, precision):
            self.problem, self.precision = problem, precision

        def launch(self, inputs, scale, out=None, addresses=None, text_lengths=None):  # Plan.launch's signature
            calls.append((self.problem, inputs, self.precision, out, text_lengths))
            grads = _expected(dict(zip(cupy_xattn.grads.INPUT_NAMES, inputs)), scale)
            if out is None:
                return CrossAttentionGrads(*grads)
            for buffer, grad in zip(out, grads):
                buffer[...] = grad
            return out

    monkeypatch.setattr(cupy_xattn.api, "require_gpu", lambda: fake_cupy)
    monkeypatch.setattr(cupy_xattn.plans, "cached", FakePlan)
    return calls


def test_gpu_backend_gets_the_problem_and_contiguous_inputs(inputs, mocked_gpu):
    odd = dict(inputs, key_weight=numpy.asfortranarray(inputs["key_weight"]))
    before = _digest(odd.values())
    grads = cross_attention_backward(**odd, num_heads=H, precision="fp16")
    _assert_equal(grads, _expected(inputs))
    [(problem, gpu_inputs, precision, out, lengths)] = mocked_gpu
    assert problem == Problem(2, 7, 5, 16, H, 4, 0.5)
    assert precision == "fp16" and out is None and lengths is None
    assert len(gpu_inputs) == 11 and all(a.flags.c_contiguous and a.dtype == numpy.float32 for a in gpu_inputs)
    assert _digest(odd.values()) == before


def test_gpu_backend_copies_inputs_that_start_off_a_16_byte_boundary(inputs, mocked_gpu):
    # The kernels load inputs as float4: a contiguous input 4 bytes past a boundary is copied,
    # an aligned one is passed as it is.
    bias = inputs["query_bias"]
    buffer = numpy.empty(bias.size + 4, numpy.float32)
    start = next(i for i in range(4) if buffer[i:].ctypes.data % 16 == 4)
    shifted = buffer[start:start + bias.size]
    shifted[...] = bias
    cross_attention_backward(**dict(inputs, query_bias=shifted), num_heads=H)
    [(_, gpu_inputs, _, _, _)] = mocked_gpu
    assert all(a.ctypes.data % 16 == 0 for a in gpu_inputs)
    numpy.testing.assert_array_equal(gpu_inputs[4], bias)
    assert gpu_inputs[1] is inputs["video_latents"]


def test_gpu_backend_writes_straight_into_contiguous_out(inputs, mocked_gpu):
    out = CrossAttentionGrads(*(numpy.empty_like(a) for a in list(inputs.values())[1:]))
    grads = cross_attention_backward(*inputs.values(), num_heads=H, out=out)
    assert all(b is o for b, o in zip(mocked_gpu[0][3], out)) and all(g is o for g, o in zip(grads, out))
    _assert_equal(out, _expected(inputs))


def test_gpu_backend_copies_into_strided_out(inputs, mocked_gpu):
    out = [numpy.zeros(a.shape[:-1] + (2 * a.shape[-1],), numpy.float32)[..., ::2] for a in list(inputs.values())[1:]]
    grads = cross_attention_backward(*inputs.values(), num_heads=H, out=out)
    assert mocked_gpu[0][3] is None and all(g is o for g, o in zip(grads, out))
    _assert_equal(out, _expected(inputs))


def test_gpu_work_without_cupy_names_the_extras(inputs, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` fail
    with pytest.raises(ImportError, match=r"cupy-xattn\[cuda12\].*cupy-xattn\[cuda13\]"):
        cross_attention_backward(*inputs.values(), num_heads=H)


def test_gpu_work_without_a_gpu_says_so(inputs, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(is_available=lambda: False))
    with pytest.raises(NoGPUError, match="no CUDA GPU"):
        cross_attention_backward(*inputs.values(), num_heads=H)


def test_import_needs_neither_cupy_nor_a_gpu():
    code = ("import sys; sys.modules['cupy'] = None\n"
            "import cupy_xattn, cupy_xattn.cli, cupy_xattn.kernels, cupy_xattn.cases, cupy_xattn.reference\n"
            "print(cupy_xattn.__version__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == cupy_xattn.__version__


def test_text_lengths_make_each_sample_attend_to_its_own_text_only(inputs):
    lengths = [3, 5]
    padded = cross_attention_backward(*inputs.values(), num_heads=H, backend="numpy", text_lengths=lengths)
    # The same as each sample alone with its text cut to its length; weight gradients add up.
    alone = []
    for b, n in enumerate(lengths):
        sample = {name: a[b:b + 1] if a.ndim == 3 else a for name, a in inputs.items()}
        sample["text_embeddings"] = sample["text_embeddings"][:, :n]
        alone.append(cross_attention_backward(*sample.values(), num_heads=H, backend="numpy"))
    for name, got, first, second in zip(CrossAttentionGrads._fields, padded, *alone):
        if name == "grad_video_latents":
            want = numpy.concatenate([first, second])
        elif name == "grad_text_embeddings":  # padded text tokens get zero gradients
            want = numpy.concatenate([numpy.pad(first, ((0, 0), (0, 2), (0, 0))), second])
        else:
            want = first + second
        numpy.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)


def test_text_lengths_reach_the_gpu_code_as_int32(inputs, mocked_gpu):
    cross_attention_backward(*inputs.values(), num_heads=H, text_lengths=(3, 5))
    lengths = mocked_gpu[0][4]
    assert lengths.dtype == numpy.int32 and lengths.tolist() == [3, 5]


@pytest.mark.parametrize("lengths, error, message", [
    ([0, 5], ValueError, r"lie in \[1, Nt\] = \[1, 5\]; got 0..5"),
    ([3, 6], ValueError, r"lie in \[1, Nt\] = \[1, 5\]; got 3..6"),
    ([3], ValueError, r"shape \(1,\), expected \(B,\) = \(2,\)"),
    ([3.0, 5.0], TypeError, "dtype float64; expected integers"),
    ("35", TypeError, "text_lengths is a str"),
])
def test_bad_text_lengths_are_refused(inputs, lengths, error, message):
    with pytest.raises(error, match=message):
        cross_attention_backward(*inputs.values(), num_heads=H, backend="numpy", text_lengths=lengths)


def _halved(inputs, names):
    return {name: a.astype(numpy.float16) if name in names else a for name, a in inputs.items()}


def test_float16_inputs_give_gradients_in_their_own_dtype(inputs):
    activations = ("grad_output", "video_latents", "text_embeddings")
    half = _halved(inputs, activations)  # a mixed-precision call: fp16 activations, fp32 weights
    grads = cross_attention_backward(*half.values(), num_heads=H, backend="numpy")
    # The work is float32 on the fp16 values; each gradient is cast to its input's dtype.
    float32 = cross_attention_backward(*(a.astype(numpy.float32) for a in half.values()), num_heads=H,
                                       backend="numpy")
    for name, got, want in zip(CrossAttentionGrads._fields, grads, float32):
        dtype = half[name.removeprefix("grad_")].dtype
        assert got.dtype == dtype, name
        numpy.testing.assert_array_equal(got, want.astype(dtype), err_msg=name)
    out = CrossAttentionGrads(*(numpy.full_like(g, numpy.nan) for g in grads))
    returned = cross_attention_backward(*half.values(), num_heads=H, backend="numpy", out=out)
    assert all(r is o for r, o in zip(returned, out))
    _assert_halves_equal(out, grads)


def _assert_halves_equal(got, want):
    for name, g, w in zip(CrossAttentionGrads._fields, got, want):
        assert g.dtype == w.dtype, name
        numpy.testing.assert_array_equal(g, w, err_msg=name)


def test_out_must_have_the_dtype_of_its_input(inputs):
    half = _halved(inputs, ("video_latents",))
    out = [numpy.empty(a.shape, numpy.float32) for a in list(half.values())[1:]]
    with pytest.raises(TypeError, match=r"out.grad_video_latents has dtype float32, expected float16 \(that of "
                                        r"video_latents\)"):
        cross_attention_backward(*half.values(), num_heads=H, backend="numpy", out=out)


def test_float16_inputs_reach_the_gpu_code_as_float32_and_come_back_float16(inputs, mocked_gpu):
    half = _halved(inputs, tuple(inputs))
    grads = cross_attention_backward(*half.values(), num_heads=H)
    [(_, gpu_inputs, _, out, _)] = mocked_gpu
    assert out is None and all(a.dtype == numpy.float32 for a in gpu_inputs)
    assert all(g.dtype == numpy.float16 for g in grads)


def test_bfloat16_where_numpy_holds_it(inputs):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = {name: a.astype(ml_dtypes.bfloat16) for name, a in inputs.items()}
    grads = cross_attention_backward(*bf16.values(), num_heads=H, backend="numpy")
    # The work is float32 on the bfloat16 values; each gradient is rounded to bfloat16.
    float32 = cross_attention_backward(*(a.astype(numpy.float32) for a in bf16.values()), num_heads=H,
                                       backend="numpy")
    for name, got, want in zip(CrossAttentionGrads._fields, grads, float32):
        assert numpy.dtype(got.dtype).name == "bfloat16", name
        numpy.testing.assert_array_equal(got, want.astype(ml_dtypes.bfloat16), err_msg=name)
