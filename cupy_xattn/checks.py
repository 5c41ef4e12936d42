"""The checks on the arguments of ``cross_attention_backward``, done before any allocation or launch
(head_dim, which only the GPU kernels limit, is checked when the plan is built: attention_bwd.check_head_dim).

Problems are collected, not raised one at a time: a call with several bad arguments gets one
error naming all of a kind: a TypeError for every type and dtype problem, else a ValueError for
everything else.
"""
import functools
import math
import numbers
import operator
from typing import NamedTuple

import numpy

from ._cupy import import_cupy
from .grads import INPUT_NAMES, CrossAttentionGrads

PRECISIONS = ("fp32", "tf32", "fp16")
BACKENDS = ("cupy", "numpy")

# Shapes in symbols: B batch, Nv video tokens, Nt text tokens, D hidden size.
INPUT_SHAPES = {
    "grad_output": ("B", "Nv", "D"),
    "video_latents": ("B", "Nv", "D"),
    "text_embeddings": ("B", "Nt", "D"),
    "query_weight": ("D", "D"),
    "query_bias": ("D",),
    "key_weight": ("D", "D"),
    "key_bias": ("D",),
    "value_weight": ("D", "D"),
    "value_bias": ("D",),
    "output_weight": ("D", "D"),
    "output_bias": ("D",),
}
# The sizes come from these first, so that the messages blame the other arguments.
_SIZE_SOURCES = ("video_latents", "text_embeddings") + tuple(
    name for name in INPUT_NAMES if name not in ("video_latents", "text_embeddings"))

_FLOAT32 = numpy.dtype(numpy.float32)
#: input and output dtypes (by name: NumPy holds bfloat16 only with ml_dtypes); the work is float32.
DTYPES = ("float32", "float16", "bfloat16")

# Sizes kept below 2**31 elements, so that element counts fit 32-bit signed integers.
INDEX_LIMIT = 2**31
# The GPU backend: batch is a grid dimension (at most 65535 blocks), and the kernels load
# inputs as float4 (the slow path copies an input that starts off a 16-byte boundary).
MAX_BATCH = 65535
INPUT_ALIGNMENT = 16


def batch_limit_problem(batch_size):
    """The GPU backend's complaint about a batch past MAX_BATCH, or None (the full check's and plan()'s)."""
    if batch_size > MAX_BATCH:
        return f"batch size B={batch_size} exceeds {MAX_BATCH}, the GPU backend's limit (a grid dimension)"
    return None


_DLPACK_CPU = 1


class Problem(NamedTuple):
    """The sizes of one validated call; ``scale`` is resolved (None -> 1/sqrt(head_dim))."""

    batch_size: int
    num_video_tokens: int
    num_text_tokens: int
    hidden_size: int
    num_heads: int
    head_dim: int
    scale: float


def _as_array(obj):
    """``obj`` as a NumPy or CuPy array without copying, or None when it is neither."""
    if isinstance(obj, numpy.ndarray):
        return obj
    if hasattr(obj, "__cuda_array_interface__"):  # CuPy arrays included: asarray returns them as they are
        return import_cupy().asarray(obj)
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        if obj.__dlpack_device__()[0] == _DLPACK_CPU:
            return numpy.from_dlpack(obj)
        return import_cupy().from_dlpack(obj)
    return None


def _unsupported(name, obj):
    return (f"{name} is a {type(obj).__name__}; expected a NumPy or CuPy array "
            "(or an object with __cuda_array_interface__ or DLPack)")


def as_arrays(named, caller="cross_attention_backward"):
    """Wrap each value of ``named`` (name -> array-like) as a NumPy or CuPy array, zero-copy.

    Raises
    ------
    TypeError
        Naming every value that is not an array.
    """
    arrays = {name: _as_array(obj) for name, obj in named.items()}
    bad = [_unsupported(name, named[name]) for name, array in arrays.items() if array is None]
    if bad:
        raise TypeError(_message("unsupported array types", bad, caller))
    return arrays


def as_out(out):
    """``out`` (None, a CrossAttentionGrads or a sequence of 10 arrays) as a CrossAttentionGrads of arrays."""
    if out is None:
        return None
    if isinstance(out, (str, bytes)) or not hasattr(out, "__len__") or len(out) != len(CrossAttentionGrads._fields):
        raise TypeError(f"out must be a CrossAttentionGrads or a sequence of 10 arrays, got {type(out).__name__}")
    names = [f"out.{field}" for field in CrossAttentionGrads._fields]
    return CrossAttentionGrads(*as_arrays(dict(zip(names, out))).values())


def _message(title, problems, caller="cross_attention_backward"):
    return f"{caller}: {title}:\n" + "\n".join(f"  - {p}" for p in problems)


def _is_int(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _device_id(array):
    """The GPU of a CuPy-like array, None for host arrays (NumPy's .device is the string 'cpu')."""
    return getattr(getattr(array, "device", None), "id", None)


def _byte_range(array):
    """[first, last) addresses an array may touch; NumPy arrays give None (shares_memory handles them)."""
    if isinstance(array, numpy.ndarray) or array.size == 0:
        return None
    low = high = array.data.ptr
    for extent, stride in zip(array.shape, array.strides):
        step = (extent - 1) * stride
        low, high = (low + step, high) if step < 0 else (low, high + step)
    return low, high + array.itemsize


def _overlap(a, b):
    if isinstance(a, numpy.ndarray) and isinstance(b, numpy.ndarray):
        return numpy.shares_memory(a, b)
    if isinstance(a, numpy.ndarray) or isinstance(b, numpy.ndarray) or _device_id(a) != _device_id(b):
        return False
    range_a, range_b = _byte_range(a), _byte_range(b)
    return range_a is not None and range_b is not None and range_a[0] < range_b[1] and range_b[0] < range_a[1]


def fast_validate(inputs, *, scale, num_heads, precision, backend, out):
    """``(Problem, data pointers of inputs and outputs)`` for the common call, or None to fall
    back on :func:`validate`.

    The common call: backend "cupy", CuPy float32 C-contiguous arrays on one GPU with
    consistent shapes, ``out`` None or 10 such arrays that overlap nothing. Checked with a
    few comparisons, since on a slow host the full check costs more than the GPU work of a
    small case. Whenever anything differs, None: :func:`validate` then explains what is wrong.
    """
    if backend != "cupy" or precision not in PRECISIONS:
        return None
    if type(num_heads) is not int:  # type() first: isinstance against the numbers ABC costs more
        if not _is_int(num_heads):
            return None
        num_heads = int(num_heads)  # a NumPy integer would wrap in the size products below
    if num_heads <= 0:
        return None
    if scale is not None and not (type(scale) in (int, float) and 0 < scale < math.inf):
        return None
    cupy = import_cupy()
    ndarray = getattr(cupy, "ndarray", None)
    x, t = inputs[1], inputs[2]
    if ndarray is None or type(x) is not ndarray or type(t) is not ndarray or x.ndim != 3 or t.ndim != 3:
        return None
    (b, nv, d), nt = x.shape, t.shape[1]
    sizes = _common_sizes(b, nv, nt, d, num_heads, scale)
    if sizes is None:
        return None
    problem, input_shapes, output_shapes, nbytes = sizes
    device = x.data.device_id
    if device != cupy.cuda.runtime.getDevice():  # the plan cache is per current device
        return None
    # The kernels read inputs 16 bytes at a time; cuBLAS writes the outputs, any float32 alignment.
    addresses = _addresses(inputs, input_shapes, ndarray, device, INPUT_ALIGNMENT)
    if addresses is None:
        return None
    if out is not None:
        outputs = (_addresses(out, output_shapes, ndarray, device, 1)
                   if len(out) == len(CrossAttentionGrads._fields) else None)
        if outputs is None or _outputs_overlap(addresses + outputs, len(addresses), nbytes):
            return None
        addresses += outputs
    return problem, addresses


@functools.lru_cache(maxsize=64)
def _common_sizes(b, nv, nt, d, num_heads, scale):
    """(Problem, input shapes, output shapes, byte sizes) when fast_validate takes these sizes, else
    None; a call repeats them, so they are worked out once (a few µs on a slow host)."""
    if (0 in (b, nv, nt, d) or d % num_heads or b > MAX_BATCH
            or max(b * nv * d, b * nt * 2 * d, d * d, b * num_heads * nv * nt) >= INDEX_LIMIT):
        return None
    head_dim = d // num_heads
    problem = Problem(b, nv, nt, d, num_heads, head_dim, 1.0 / math.sqrt(head_dim) if scale is None else float(scale))
    return (problem, *layout(b, nv, nt, d))


def _addresses(arrays, shapes, ndarray, device, alignment):
    """The data pointers of ``arrays``, or None if one is not of the common kind (fast_validate)."""
    addresses = []
    for a, shape in zip(arrays, shapes):
        # _c_contiguous: CuPy's flag itself (``flags`` builds an object per access).
        if type(a) is not ndarray or a.dtype is not _FLOAT32 or not a._c_contiguous or a.shape != shape:
            return None
        data = a.data
        address = data.ptr
        if data.device_id != device or address % alignment:
            return None
        addresses.append(address)
    return addresses


@functools.lru_cache(maxsize=64)
def layout(b, nv, nt, d):
    """(input shapes, output shapes, byte sizes of inputs then outputs), float32, in argument order."""
    dims = {"B": b, "Nv": nv, "Nt": nt, "D": d}
    shapes = tuple(tuple(dims[s] for s in INPUT_SHAPES[name]) for name in INPUT_NAMES)
    return shapes, shapes[1:], tuple(_FLOAT32.itemsize * math.prod(s) for s in shapes + shapes[1:])


def _outputs_overlap(starts, first_output, nbytes):
    """Whether an array from index ``first_output`` on (an output) overlaps any other one; those
    before it (inputs) may overlap each other, as when one array is passed twice."""
    ends = list(map(operator.add, starts, nbytes))
    # Usually none overlap at all, which holds exactly when the i-th lowest end is at most the
    # (i+1)-th lowest start: two sorts and a comparison, without a Python loop.
    if all(map(operator.le, sorted(ends), sorted(starts)[1:])):
        return False
    end_all = end_out = 0  # the furthest end so far, of any array and of outputs
    for start, end, index in sorted(zip(starts, ends, range(len(starts)))):
        is_out = index >= first_output
        if start < (end_all if is_out else end_out):
            return True
        end_all = max(end_all, end)
        if is_out:
            end_out = max(end_out, end)
    return False


def text_lengths(value, batch_size, text_tokens, caller="cross_attention_backward"):
    """``text_lengths`` as a (B,) int32 NumPy array, or None when not given.

    Accepts NumPy or CuPy integer arrays and sequences of ints (a CuPy array is copied to the
    host, which waits for the work that writes it).

    Raises
    ------
    TypeError
        Not an array or sequence of integers.
    ValueError
        Not one length per sample, or a length outside [1, Nt].
    """
    if value is None:
        return None
    array = value
    if not isinstance(value, numpy.ndarray):
        if hasattr(value, "__cuda_array_interface__"):
            array = import_cupy().asnumpy(value)
        elif isinstance(value, (list, tuple)):
            array = numpy.asarray(value)
        else:
            raise TypeError(_message("invalid argument types", [
                f"text_lengths is a {type(value).__name__}; expected an integer array or a sequence of ints"], caller))
    if array.dtype.kind not in "iu":
        raise TypeError(_message("invalid argument types", [f"text_lengths has dtype {array.dtype}; expected integers"],
                                 caller))
    if array.shape != (batch_size,):
        raise ValueError(_message("invalid arguments", [
            f"text_lengths has shape {array.shape}, expected (B,) = ({batch_size},): one length per sample"], caller))
    if batch_size and (array.min() < 1 or array.max() > text_tokens):
        raise ValueError(_message("invalid arguments", [
            f"text_lengths must lie in [1, Nt] = [1, {text_tokens}]; got {array.min()}..{array.max()}"], caller))
    return array.astype(numpy.int32)


def _show(symbols, dims):
    return f"({', '.join(symbols)}{',' if len(symbols) == 1 else ''}) = {tuple(dims.get(s, '?') for s in symbols)}"


def validate(arrays, *, scale, num_heads, precision, backend, out, caller="cross_attention_backward"):
    """Check one call's arguments and return its sizes.

    Parameters
    ----------
    arrays : dict
        Name -> NumPy or CuPy array (anything with ``shape``, ``dtype`` and, on a GPU,
        ``device.id`` and ``data.ptr``): the 11 inputs in the public order (``INPUT_NAMES``), or
        the forward's 10 (all but grad_output).
    caller : the public function named in the messages.
    scale : float or None
    num_heads : int
    precision : {"fp32", "tf32", "fp16"}
    backend : {"cupy", "numpy"}
    out : CrossAttentionGrads of arrays, or None

    Returns
    -------
    Problem

    Raises
    ------
    TypeError
        Dtypes other than float32, float16 and bfloat16, an ``out`` array whose dtype is not
        that of its input, non-integer ``num_heads``, non-real ``scale``;
        one message naming every such argument.
    ValueError
        Everything else (shapes, sizes, options, devices, aliasing ``out``); one message listing all.
    """
    outs = {} if out is None else dict(zip((f"out.{f}" for f in CrossAttentionGrads._fields), out))
    everything = {**arrays, **outs}

    type_problems = [f"{name} has dtype {numpy.dtype(a.dtype)}; supported: {', '.join(DTYPES)}"
                     for name, a in arrays.items() if numpy.dtype(a.dtype).name not in DTYPES]
    type_problems += [f"{out_name} has dtype {numpy.dtype(o.dtype)}, expected {numpy.dtype(arrays[name].dtype)} "
                      f"(that of {name})" for (out_name, o), name in zip(outs.items(), INPUT_NAMES[1:])
                      if numpy.dtype(o.dtype) != numpy.dtype(arrays[name].dtype)]
    if not _is_int(num_heads):
        type_problems.append(f"num_heads must be an integer, got {type(num_heads).__name__}")
    if scale is not None and (not isinstance(scale, numbers.Real) or isinstance(scale, bool)):
        type_problems.append(f"scale must be a real number or None, got {type(scale).__name__}")
    if type_problems:
        raise TypeError(_message("invalid argument types", type_problems, caller))
    num_heads = int(num_heads)  # a NumPy integer would wrap in the size products below

    problems = []
    if precision not in PRECISIONS:
        problems.append(f"precision must be one of {', '.join(map(repr, PRECISIONS))}, got {precision!r}")
    if backend not in BACKENDS:
        problems.append(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")

    dims = {}
    for name in filter(arrays.__contains__, _SIZE_SOURCES):
        symbols, shape = INPUT_SHAPES[name], tuple(arrays[name].shape)
        if len(shape) == len(symbols):
            for symbol, size in zip(symbols, shape):
                dims.setdefault(symbol, size)
    expected = {**INPUT_SHAPES, **{out_name: INPUT_SHAPES[name]
                                   for out_name, name in zip(outs, INPUT_NAMES[1:])}}
    shape_problems = [f"{name} has shape {tuple(a.shape)}, expected {_show(expected[name], dims)}"
                      for name, a in everything.items()
                      if tuple(a.shape) != tuple(dims.get(s) for s in expected[name])]
    if shape_problems:
        problems.append("shapes do not match (B, Nv, D from video_latents; Nt from text_embeddings):\n    "
                        + "\n    ".join(shape_problems))
    empty = [f"{symbol}={size}" for symbol, size in dims.items() if size == 0]
    if empty:
        problems.append(f"empty dimensions: {', '.join(empty)}")

    hidden_size = dims.get("D")
    if num_heads <= 0:
        problems.append(f"num_heads must be positive, got {num_heads}")
    elif hidden_size and hidden_size % num_heads:
        problems.append(f"hidden size D={hidden_size} is not divisible by num_heads={num_heads}")
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        problems.append(f"scale must be finite and positive, got {scale}")

    if len(dims) == 4 and num_heads > 0:
        B, Nv, Nt, D = (dims[s] for s in ("B", "Nv", "Nt", "D"))
        sizes = {"B*Nv*D": B * Nv * D, "B*Nt*2*D (keys|values)": B * Nt * 2 * D, "D*D": D * D,
                 "B*num_heads*Nv*Nt (attention scores)": B * num_heads * Nv * Nt}
        problems += [f"{what} = {size} elements overflows 32-bit indexing (limit {INDEX_LIMIT - 1})"
                     for what, size in sizes.items() if size >= INDEX_LIMIT]

        if backend == "cupy" and (problem := batch_limit_problem(B)):
            problems.append(problem)

    devices = {name: _device_id(a) for name, a in everything.items() if _device_id(a) is not None}
    if len(set(devices.values())) > 1:
        problems.append("arrays are on different GPUs: "
                        + ", ".join(f"{name} on GPU {device}" for name, device in devices.items()))

    for i, (out_name, o) in enumerate(outs.items()):
        if isinstance(o, numpy.ndarray) and not o.flags.writeable:
            problems.append(f"{out_name} is read-only")
        others = list(arrays.items()) + list(outs.items())[i + 1:]
        problems += [f"{out_name} overlaps {name} in memory"
                     for name, a in others if _overlap(o, a)]

    if problems:
        raise ValueError(_message("invalid arguments", problems, caller))

    head_dim = hidden_size // num_heads
    return Problem(dims["B"], dims["Nv"], dims["Nt"], hidden_size, num_heads, head_dim,
                   1.0 / math.sqrt(head_dim) if scale is None else float(scale))
