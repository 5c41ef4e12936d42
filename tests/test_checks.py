"""Every way a call can be wrong is caught before any work, with one message naming it all."""
import hashlib
import math
import re
import sys
from types import SimpleNamespace

import numpy
import pytest

from cupy_xattn import CrossAttentionGrads, cross_attention_backward
from cupy_xattn.cases import Case, make_inputs
from cupy_xattn.checks import INDEX_LIMIT, INPUT_SHAPES, Problem, as_arrays, as_out, validate

B, NV, NT, D, H = 2, 5, 3, 8, 2


@pytest.fixture
def arrays():
    return make_inputs(Case(B, NV, NT, atol=0.0), hidden_size=D, seed=0)


def _validate(arrays, *, scale=None, num_heads=H, precision="tf32", backend="numpy", out=None):
    return validate(arrays, scale=scale, num_heads=num_heads, precision=precision, backend=backend, out=out)


def _outputs(arrays):
    return CrossAttentionGrads(*(numpy.empty_like(a) for a in list(arrays.values())[1:]))


class FakeGpuArray:
    """Just what validate reads of a CuPy array, so device and size checks run without a GPU."""

    def __init__(self, shape, device=0, ptr=1 << 20, dtype=numpy.float32):
        self.shape, self.dtype = tuple(shape), numpy.dtype(dtype)
        self.device, self.data = SimpleNamespace(id=device), SimpleNamespace(ptr=ptr)
        self.itemsize, self.size = self.dtype.itemsize, math.prod(self.shape)
        self.strides = tuple(self.itemsize * math.prod(self.shape[i + 1:]) for i in range(len(self.shape)))


def _fakes(arrays, **devices):
    """Fake GPU copies of ``arrays`` at disjoint addresses, on device 0 unless named in ``devices``."""
    fakes, ptr = {}, 1 << 20
    for name, a in arrays.items():
        fakes[name] = FakeGpuArray(a.shape, devices.get(name, 0), ptr)
        ptr += a.nbytes + 256
    return fakes


def test_valid_call_gives_the_problem(arrays):
    assert _validate(arrays) == Problem(B, NV, NT, D, H, D // H, 1 / math.sqrt(D // H))
    assert _validate(arrays, scale=0.25, out=_outputs(arrays)).scale == 0.25


def test_dtypes_are_one_type_error_naming_each_argument(arrays):
    arrays["video_latents"] = arrays["video_latents"].astype(numpy.float64)
    arrays["key_bias"] = arrays["key_bias"].astype(numpy.int32)
    arrays["query_bias"] = arrays["query_bias"].astype(numpy.float16)  # supported
    with pytest.raises(TypeError) as error:
        _validate(arrays)
    assert "video_latents has dtype float64; supported: float32, float16, bfloat16" in str(error.value)
    assert "key_bias has dtype int32" in str(error.value) and "query_bias" not in str(error.value)


def test_out_dtype_is_a_type_error(arrays):
    out = list(_outputs(arrays))
    out[3] = out[3].astype(numpy.float64)
    with pytest.raises(TypeError, match="out.grad_query_bias has dtype float64"):
        _validate(arrays, out=out)


@pytest.mark.parametrize("num_heads", [2.0, "2", True])
def test_num_heads_must_be_an_integer(arrays, num_heads):
    with pytest.raises(TypeError, match="num_heads must be an integer"):
        _validate(arrays, num_heads=num_heads)


@pytest.mark.parametrize("scale", ["0.1", True, 1j])
def test_scale_must_be_real(arrays, scale):
    with pytest.raises(TypeError, match="scale must be a real number"):
        _validate(arrays, scale=scale)


def test_shapes_are_one_value_error_listing_every_mismatch(arrays):
    arrays["grad_output"] = numpy.zeros((B, NV, D + 1), numpy.float32)
    arrays["key_weight"] = numpy.zeros((D, D, 1), numpy.float32)
    arrays["value_bias"] = numpy.zeros((D - 1,), numpy.float32)
    with pytest.raises(ValueError) as error:
        _validate(arrays)
    message = str(error.value)
    assert "grad_output has shape (2, 5, 9), expected (B, Nv, D) = (2, 5, 8)" in message
    assert "key_weight has shape (8, 8, 1), expected (D, D) = (8, 8)" in message
    assert "value_bias has shape (7,), expected (D,) = (8,)" in message
    assert "video_latents has" not in message and "text_embeddings has" not in message


def test_batch_and_hidden_sizes_come_from_the_latents_and_text(arrays):
    arrays["text_embeddings"] = numpy.zeros((B + 1, NT, D), numpy.float32)
    with pytest.raises(ValueError, match=r"text_embeddings has shape \(3, 3, 8\), expected \(B, Nt, D\) = \(2, 3, 8\)"):
        _validate(arrays)


def test_out_shapes(arrays):
    out = list(_outputs(arrays))
    out[1] = numpy.empty((B, NT + 1, D), numpy.float32)
    with pytest.raises(ValueError, match=r"out.grad_text_embeddings has shape \(2, 4, 8\), expected"):
        _validate(arrays, out=out)


def test_empty_dimensions(arrays):
    for name in ("grad_output", "video_latents"):
        arrays[name] = numpy.zeros((B, 0, D), numpy.float32)
    with pytest.raises(ValueError, match="empty dimensions: Nv=0"):
        _validate(arrays)


@pytest.mark.parametrize("num_heads, message", [(3, "D=8 is not divisible by num_heads=3"),
                                                (0, "num_heads must be positive"),
                                                (-2, "num_heads must be positive")])
def test_num_heads_values(arrays, num_heads, message):
    with pytest.raises(ValueError, match=message):
        _validate(arrays, num_heads=num_heads)


@pytest.mark.parametrize("scale", [0.0, -0.125, math.inf, math.nan])
def test_scale_must_be_finite_and_positive(arrays, scale):
    with pytest.raises(ValueError, match="scale must be finite and positive"):
        _validate(arrays, scale=scale)


def test_unknown_precision_and_backend_in_one_error(arrays):
    with pytest.raises(ValueError) as error:
        _validate(arrays, precision="bf16", backend="torch")
    assert "precision must be one of 'fp32', 'tf32', 'fp16', got 'bf16'" in str(error.value)
    assert "backend must be one of 'cupy', 'numpy', got 'torch'" in str(error.value)


def test_arrays_on_different_gpus(arrays):
    fakes = _fakes(arrays, text_embeddings=1)
    assert _validate(_fakes(arrays), backend="cupy").hidden_size == D
    with pytest.raises(ValueError, match="different GPUs: .*text_embeddings on GPU 1"):
        _validate(fakes, backend="cupy")


def test_out_on_another_gpu(arrays):
    fakes = _fakes(arrays)
    out = list(_fakes({f"o{i}": a for i, a in enumerate(list(arrays.values())[1:])}).values())
    for o in out:
        o.data.ptr += 1 << 30
    out[0].device.id = 1
    with pytest.raises(ValueError, match="out.grad_video_latents on GPU 1"):
        _validate(fakes, backend="cupy", out=out)


@pytest.mark.parametrize("sizes, what", [((1, 1 << 21, 1, 1024), "B\\*Nv\\*D"),
                                         ((1, 1, 1 << 20, 1024), "B\\*Nt\\*2\\*D"),
                                         ((1, 1, 1, 1 << 16), "D\\*D"),
                                         ((64, 1 << 12, 1 << 9, 1024), "attention scores")])
def test_sizes_that_overflow_32_bit_indexing(sizes, what):
    dims = dict(zip(("B", "Nv", "Nt", "D"), sizes))
    fakes = {name: FakeGpuArray([dims[s] for s in symbols], ptr=(i + 1) << 44)
             for i, (name, symbols) in enumerate(INPUT_SHAPES.items())}
    with pytest.raises(ValueError, match=f"{what}.* overflows 32-bit indexing"):
        _validate(fakes, backend="cupy", num_heads=16)
    assert INDEX_LIMIT == 2**31


def test_gpu_batch_beyond_the_grid_limit():
    dims = {"B": 65536, "Nv": 1, "Nt": 1, "D": 64}
    fakes = {name: FakeGpuArray([dims[s] for s in symbols], ptr=(i + 1) << 44)
             for i, (name, symbols) in enumerate(INPUT_SHAPES.items())}
    with pytest.raises(ValueError, match="batch size B=65536 exceeds 65535"):
        _validate(fakes, backend="cupy", num_heads=1)
    assert _validate(fakes, backend="numpy", num_heads=1).batch_size == 65536  # the reference has no such limit


def test_out_may_not_alias_inputs_or_each_other(arrays):
    out = list(_outputs(arrays))
    out[0] = arrays["video_latents"]
    out[9] = out[7] = numpy.empty(D, numpy.float32)
    out[2] = arrays["query_weight"][::-1]  # a view overlaps too
    with pytest.raises(ValueError) as error:
        _validate(arrays, out=out)
    message = str(error.value)
    assert "out.grad_video_latents overlaps video_latents" in message
    assert "out.grad_query_weight overlaps query_weight" in message
    assert "out.grad_value_bias overlaps out.grad_output_bias" in message


def test_gpu_out_aliasing_is_by_address_range(arrays):
    fakes = _fakes(arrays)
    out = [FakeGpuArray(a.shape, ptr=(i + 1) << 40) for i, a in enumerate(list(arrays.values())[1:])]
    assert _validate(fakes, backend="cupy", out=out)
    out[4].data.ptr = fakes["key_weight"].data.ptr + 4 * D  # one row in: overlaps
    out[5].data.ptr = fakes["key_bias"].data.ptr + 4 * D  # just past the end: does not
    with pytest.raises(ValueError) as error:
        _validate(fakes, backend="cupy", out=out)
    assert "out.grad_key_weight overlaps key_weight" in str(error.value)
    assert "key_bias" not in str(error.value)


def test_gpu_out_starting_on_an_inputs_last_element_overlaps_it(arrays):
    # One shared element: an input's range must end past its last element, not at its start.
    fakes = _fakes(arrays)
    out = [FakeGpuArray(a.shape, ptr=(i + 1) << 40) for i, a in enumerate(list(arrays.values())[1:])]
    out[5].data.ptr = fakes["key_bias"].data.ptr + 4 * (D - 1)
    with pytest.raises(ValueError, match="out.grad_key_bias overlaps key_bias"):
        _validate(fakes, backend="cupy", out=out)


def test_read_only_out(arrays):
    out = _outputs(arrays)
    out.grad_output_bias.flags.writeable = False
    with pytest.raises(ValueError, match="out.grad_output_bias is read-only"):
        _validate(arrays, out=out)


def test_non_arrays_are_one_type_error():
    with pytest.raises(TypeError) as error:
        as_arrays({"video_latents": [[1.0]], "key_bias": 3.0, "query_bias": numpy.zeros(2)})
    assert "video_latents is a list" in str(error.value) and "key_bias is a float" in str(error.value)


@pytest.mark.parametrize("out, message", [
    (numpy.zeros(10), "out.grad_video_latents is a float64; expected a NumPy or CuPy array"),  # ten, not arrays
    ("abcdefghij", "out must be a CrossAttentionGrads or a sequence of 10 arrays, got str"),
    ([numpy.zeros(1)] * 9, "out must be a CrossAttentionGrads or a sequence of 10 arrays, got list"),
    (5, "out must be a CrossAttentionGrads or a sequence of 10 arrays, got int")])
def test_out_must_be_ten_arrays(out, message):
    with pytest.raises(TypeError, match=re.escape(message)):
        as_out(out)


def test_dlpack_host_objects_are_wrapped_without_copy():
    source = numpy.arange(6, dtype=numpy.float32)

    class Capsule:  # an array known only through DLPack
        def __dlpack__(self, **kwargs):
            return source.__dlpack__(**kwargs)

        def __dlpack_device__(self):
            return source.__dlpack_device__()

    wrapped = as_arrays({"x": Capsule()})["x"]
    assert numpy.shares_memory(wrapped, source)


def _digest(arrays):
    return {name: hashlib.sha256(numpy.ascontiguousarray(a).tobytes()).hexdigest() for name, a in arrays.items()}


def test_errors_come_before_any_work_and_inputs_stay_untouched(arrays, monkeypatch):
    before = _digest(arrays)
    bad = dict(arrays, value_weight=arrays["value_weight"][:, :3])
    with pytest.raises(ValueError, match="value_weight has shape"):
        cross_attention_backward(*bad.values(), num_heads=H, backend="numpy")
    # backend="cupy" would need a GPU; it is validated before CuPy is even imported: here CuPy (and
    # cupyx, cupy_backends) is neither imported nor importable (an import raises ImportError).
    blocked = lambda name: name.partition(".")[0] in ("cupy", "cupyx", "cupy_backends")  # noqa: E731

    class NoCupy:
        def find_spec(self, name, path=None, target=None):
            if blocked(name):
                raise ImportError(f"{name} blocked by the test")

    for name in [n for n in sys.modules if blocked(n)]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [NoCupy(), *sys.meta_path])
    with pytest.raises(ValueError, match="value_weight has shape"):
        cross_attention_backward(*bad.values(), num_heads=H, backend="cupy")
    assert _digest(arrays) == before


def test_the_fast_overlap_test_agrees_with_comparing_every_pair():
    from cupy_xattn.checks import _outputs_overlap
    rng = numpy.random.default_rng(0)
    for _ in range(3000):
        n, first_output = int(rng.integers(2, 8)), int(rng.integers(1, 6))
        starts = [int(s) for s in rng.integers(0, 40, n)]
        nbytes = [int(s) for s in rng.integers(1, 12, n)]
        ends = [s + size for s, size in zip(starts, nbytes)]
        pairs = [(i, j) for i in range(n) for j in range(i + 1, n) if max(i, j) >= first_output]
        expected = any(starts[i] < ends[j] and starts[j] < ends[i] for i, j in pairs)
        assert _outputs_overlap(starts, first_output, nbytes) == expected, (starts, nbytes, first_output)
