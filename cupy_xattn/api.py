"""The public entry point: ``cross_attention_backward``."""
import contextlib
import sys

import numpy

from . import checks, forward, plans
from ._cupy import import_cupy, require_gpu, to_numpy
from .grads import INPUT_NAMES, CrossAttentionGrads

__all__ = ["cross_attention_backward", "cross_attention_forward", "CrossAttentionGrads"]


def cross_attention_backward(grad_output, video_latents, text_embeddings, query_weight, query_bias,
                             key_weight, key_bias, value_weight, value_bias, output_weight, output_bias,
                             scale=None, *, num_heads=16, precision="tf32", backend="cupy", out=None,
                             text_lengths=None):
    """Backward pass of cross-attention from video latents (queries) to text embeddings (keys, values).

    Forward, recomputed here (nothing is saved from a forward pass)::

        Q = X Wq^T + bq    K = T Wk^T + bk    V = T Wv^T + bv       (num_heads heads)
        Y = softmax(scale Q K^T) V Wo^T + bo

    Parameters
    ----------
    grad_output : (B, Nv, D)
        dY, gradient of the loss with respect to Y.
    video_latents : (B, Nv, D)
        X.
    text_embeddings : (B, Nt, D)
        T.
    query_weight, key_weight, value_weight, output_weight : (D, D)
        (out, in) weights, applied as ``x @ W.T``.
    query_bias, key_bias, value_bias, output_bias : (D,)
    scale : float, optional
        Softmax scale; defaults to 1/sqrt(D / num_heads).
    num_heads : int
        H; D must be divisible by it.
    precision : {"tf32", "fp32", "fp16"}
        Matrix-unit precision of the GPU backend (accumulation is always fp32).
        Ignored by the numpy backend.
    backend : {"cupy", "numpy"}
        "cupy" runs on the current GPU (or that of the CuPy inputs); "numpy" runs the float64
        reference on the host and returns float32.
    out : CrossAttentionGrads or sequence of 10 arrays, optional
        Preallocated outputs, each of its input's dtype; results are written into exactly these
        and returned. They may not overlap the inputs or each other.
    text_lengths : (B,) ints, optional
        Text tokens each sample attends to, 1..Nt: the rest are padding, with zero attention
        and zero gradients. NumPy or a sequence is cheapest; a CuPy array is copied to the host
        for the check (it waits for the work that writes it).

    All arrays are NumPy or CuPy (or anything ``cupy.asarray`` takes zero-copy:
    ``__cuda_array_interface__``, DLPack), float32, float16 or bfloat16 (where NumPy/CuPy hold
    it), in any mix. The work is float32 (float16/bfloat16 inputs are copied to float32 first;
    the fast path is for float32), and each gradient comes in the dtype of its input. Inputs are
    never modified; non-contiguous ones are copied.

    Returns
    -------
    CrossAttentionGrads
        Each of its input's dtype; NumPy when every input is a NumPy array, CuPy otherwise (or ``out``).

    Raises
    ------
    TypeError
        Wrong dtypes or argument types.
    ValueError
        Inconsistent shapes, bad options, arrays on different GPUs, aliasing ``out``.
    ImportError
        backend="cupy" without CuPy installed.
    cupy_xattn._cupy.NoGPUError
        backend="cupy" without a usable GPU.
    MemoryError
        backend="cupy": the GPU cannot hold what the shape needs (the message says how much).
    """
    return run((grad_output, video_latents, text_embeddings, query_weight, query_bias, key_weight, key_bias,
                value_weight, value_bias, output_weight, output_bias),
               scale=scale, num_heads=num_heads, precision=precision, backend=backend, out=out,
               text_lengths=text_lengths)


def cross_attention_forward(video_latents, text_embeddings, query_weight, query_bias, key_weight, key_bias,
                            value_weight, value_bias, output_weight, output_bias, scale=None, *, num_heads=16,
                            precision="tf32", backend="cupy", text_lengths=None):
    """Forward pass of the layer whose gradients ``cross_attention_backward`` computes::

        Q = X Wq^T + bq    K = T Wk^T + bk    V = T Wv^T + bv       (num_heads heads)
        Y = softmax(scale Q K^T) V Wo^T + bo

    Arguments as in ``cross_attention_backward`` (without ``grad_output`` and ``out``);
    ``precision`` is "tf32" or "fp32" on the CuPy backend (the fused attention never writes P).

    Returns
    -------
    (B, Nv, D) array of video_latents' dtype: NumPy when every input is a NumPy array, CuPy
    otherwise.

    Raises
    ------
    TypeError, ValueError, ImportError, cupy_xattn._cupy.NoGPUError
        As ``cross_attention_backward``; ValueError also for a precision other than "tf32" or
        "fp32" on the CuPy backend, or a head_dim it does not support.
    """
    caller = "cross_attention_forward"
    arrays = checks.as_arrays(dict(zip(INPUT_NAMES[1:], (
        video_latents, text_embeddings, query_weight, query_bias, key_weight, key_bias, value_weight, value_bias,
        output_weight, output_bias))), caller)
    problem = checks.validate(arrays, scale=scale, num_heads=num_heads, precision=precision, backend=backend,
                              out=None, caller=caller)
    if backend == "cupy" and precision not in forward.PRECISIONS:
        raise ValueError(f"{caller}: precision {precision!r} is not supported by the forward; use one of "
                         f"{', '.join(map(repr, forward.PRECISIONS))}")
    lengths = checks.text_lengths(text_lengths, problem.batch_size, problem.num_text_tokens, caller)
    on_host = all(isinstance(a, numpy.ndarray) for a in arrays.values())
    dtype = arrays["video_latents"].dtype
    if backend == "numpy":
        from . import reference
        y = reference.forward(*map(to_numpy, _as_float32(arrays).values()), problem.scale, num_heads=num_heads,
                              text_lengths=lengths).astype(dtype)
        return y if on_host else import_cupy().asarray(y)
    cupy = require_gpu()
    from .attention_bwd import check_head_dim
    check_head_dim(problem)  # before any GPU work
    with _on_callers_gpu(arrays.values()):
        inputs = tuple(_contiguous_aligned(cupy, a) for a in _as_float32(arrays).values())
        y = forward.run(problem, inputs, precision, lengths).astype(dtype, copy=False)
        return cupy.asnumpy(y) if on_host else y


def run(inputs, *, scale, num_heads, precision, backend, out, text_lengths=None, plan=None):
    """``cross_attention_backward`` on the 11 ``inputs`` in argument order.

    ``plan`` (a ``plans.Plan``) runs the GPU work instead of the cache's plan for the shape.
    """
    if "cupy" in sys.modules and text_lengths is None:  # CuPy arrays only exist once CuPy is imported
        problem = checks.fast_validate(inputs, scale=scale, num_heads=num_heads, precision=precision,
                                       backend=backend, out=out)
        if problem is not None and (plan is None or plan.matches(problem[0], precision)):
            problem, addresses = problem
            plan = plan if plan is not None else plans.cached(problem, precision)
            if out is not None and type(out) is not CrossAttentionGrads:
                out = CrossAttentionGrads(*out)
            return plan.launch(inputs, problem.scale, out, addresses)
    arrays = checks.as_arrays(dict(zip(INPUT_NAMES, inputs)))
    out = checks.as_out(out)
    problem = checks.validate(arrays, scale=scale, num_heads=num_heads, precision=precision,
                              backend=backend, out=out)
    lengths = checks.text_lengths(text_lengths, problem.batch_size, problem.num_text_tokens)
    on_host = all(isinstance(a, numpy.ndarray) for a in arrays.values())
    # Each gradient is returned in the dtype of its input (float16/bfloat16 ones are worked on as
    # float32 copies).
    result_dtypes = [numpy.dtype(arrays[name].dtype) for name in INPUT_NAMES[1:]]
    halves = any(a.dtype != numpy.float32 for a in arrays.values())
    with _on_callers_gpu((*arrays.values(), *(out or ()))):
        arrays = _as_float32(arrays)
        if backend == "numpy":
            from . import reference
            grads = reference.backward(*map(to_numpy, arrays.values()), problem.scale, num_heads=num_heads,
                                       text_lengths=lengths)
            results = CrossAttentionGrads(*(g.astype(numpy.float32) for g in grads))
        else:
            results = _run_on_gpu(problem, arrays, precision, None if halves else out, plan, lengths)
        if halves:
            results = CrossAttentionGrads(*(r if r.dtype == dtype else r.astype(dtype)
                                            for r, dtype in zip(results, result_dtypes)))

        if out is not None:
            for buffer, result in zip(out, results):
                if buffer is not result:
                    _copy_into(buffer, result)
            return out
        if on_host:
            return CrossAttentionGrads(*map(to_numpy, results))
        return CrossAttentionGrads(*map(import_cupy().asarray, results))


def _on_callers_gpu(arrays):
    """A context on the GPU that holds the caller's CuPy ``arrays``, whatever the current device
    is (none for NumPy arrays)."""
    devices = [a.device.id for a in arrays if not isinstance(a, numpy.ndarray)]
    return import_cupy().cuda.Device(devices[0]) if devices else contextlib.nullcontext()


def _as_float32(arrays):
    """``arrays`` (name -> array) with the float16/bfloat16 ones as float32 copies: the work is float32."""
    return {name: a if a.dtype == numpy.float32 else a.astype(numpy.float32) for name, a in arrays.items()}


def _run_on_gpu(problem, arrays, precision, out, plan, text_lengths):
    cupy = require_gpu()
    if plan is None:
        plan = plans.cached(problem, precision)
    elif not plan.matches(problem, precision):
        raise ValueError(f"this plan is for B={plan.batch_size}, Nv={plan.num_video_tokens}, "
                         f"Nt={plan.num_text_tokens}, D={plan.hidden_size}, H={plan.num_heads}, "
                         f"{plan.precision}; the arrays give B={problem.batch_size}, "
                         f"Nv={problem.num_video_tokens}, Nt={problem.num_text_tokens}, "
                         f"D={problem.hidden_size}, H={problem.num_heads}, {precision}")
    inputs = tuple(_contiguous_aligned(cupy, a) for a in arrays.values())
    # The GPU code writes straight into the caller's buffers only when it can.
    direct = out is not None and all(isinstance(o, cupy.ndarray) and o.flags.c_contiguous for o in out)
    return plan.launch(inputs, problem.scale, CrossAttentionGrads(*out) if direct else None,
                       text_lengths=text_lengths)


def _contiguous_aligned(cupy, array):
    """A C-contiguous CuPy array starting on a 16-byte boundary, copied only when needed."""
    array = cupy.ascontiguousarray(cupy.asarray(array))
    address = array.ctypes.data if isinstance(array, numpy.ndarray) else array.data.ptr  # NumPy: tests' fake GPU
    return array.copy() if address % checks.INPUT_ALIGNMENT else array


def _copy_into(buffer, result):
    if isinstance(buffer, numpy.ndarray):
        buffer[...] = to_numpy(result)
    else:
        buffer[...] = import_cupy().asarray(result)
