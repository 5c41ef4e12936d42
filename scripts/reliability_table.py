"""What each bad input gets, as a Markdown table (the first part of docs/reliability.md).

Every row calls ``cross_attention_backward`` with one thing wrong and records the exception
(type and first line) or, for inputs that are valid but extreme, what the outputs hold.
``--backend numpy`` needs no GPU; ``--backend cupy`` runs the same rows on the GPU.

Usage: PYTHONPATH=. python3 scripts/reliability_table.py [--backend cupy] [--precision fp16]
(``--precision`` applies to every row that does not set its own; the default is the library's.)
"""
import argparse

import numpy

from cupy_xattn import CrossAttentionGrads, cross_attention_backward
from cupy_xattn.cases import Case, make_inputs

H = 4


def _inputs(xp):
    return make_inputs(Case(2, 6, 5, atol=0.0), hidden_size=256, seed=0, xp=xp)


def _rows(xp):
    """(description, inputs, keyword arguments) for each bad or extreme call."""
    base = _inputs(xp)
    rows = []

    def row(what, change=None, **kwargs):
        inputs = dict(base)
        if change:
            inputs.update(change(inputs))
        rows.append((what, inputs, kwargs))

    row("video_latents float64", lambda a: {"video_latents": a["video_latents"].astype(numpy.float64)})
    row("weights int32", lambda a: {"key_weight": a["key_weight"].astype(numpy.int32)})
    row("grad_output float16", lambda a: {"grad_output": a["grad_output"].astype(numpy.float16)})
    row("a Python list as key_bias", lambda a: {"key_bias": a["key_bias"].tolist()})
    row("grad_output with Nv + 1 rows", lambda a: {"grad_output": xp.zeros((2, 7, 256), numpy.float32)})
    row("query_weight transposed shape (256, 255)", lambda a: {"query_weight": xp.zeros((256, 255), numpy.float32)})
    row("text_embeddings with 0 tokens", lambda a: {"text_embeddings": xp.zeros((2, 0, 256), numpy.float32)})
    row("hidden size 256 with 3 heads", num_heads=3)
    row("num_heads = 2.0", num_heads=2.0)
    for scale in (float("nan"), float("inf"), 0.0, -1.0):
        row(f"scale = {scale}", scale=scale)
    row("scale = '0.1' (a string)", scale="0.1")
    row("precision = 'bf16'", precision="bf16")
    row("backend = 'torch'", backend="torch")
    row("non-contiguous inputs (every other column of a wider array)",
        lambda a: {k: xp.repeat(v[..., None], 2, axis=-1)[..., 0] for k, v in a.items()})
    row("NaN in video_latents[0, 0, 0]", lambda a: {"video_latents": _with(xp, a["video_latents"], numpy.nan)})
    row("+Inf in key_weight[0, 0]", lambda a: {"key_weight": _with(xp, a["key_weight"], numpy.inf)})
    row("grad_output scaled by 1e30", lambda a: {"grad_output": a["grad_output"] * numpy.float32(1e30)})
    row("grad_output scaled by 1e-30", lambda a: {"grad_output": a["grad_output"] * numpy.float32(1e-30)})
    outs = [xp.empty_like(a) for a in list(base.values())[1:]]
    rows.append(("out aliasing an input (grad_query_weight = query_weight)", base,
                 {"out": outs[:2] + [base["query_weight"]] + outs[3:]}))
    rows.append(("out with a wrong shape", base, {"out": outs[:1] + [xp.empty((2, 6, 256), numpy.float32)] + outs[2:]}))
    rows.append(("out of 9 arrays", base, {"out": outs[:9]}))
    if xp is numpy:
        read_only = [o.copy() for o in outs]
        read_only[0].flags.writeable = False
        rows.append(("read-only out (NumPy)", base, {"out": read_only}))
    return rows


def _with(xp, array, value):
    array = array.copy()
    array[(0,) * array.ndim] = value
    return array


def _outcome(inputs, kwargs, backend, precision=None):
    kwargs = {"num_heads": H, "backend": backend, **({"precision": precision} if precision else {}), **kwargs}
    try:
        with numpy.errstate(all="ignore"):  # NaN/Inf inputs: the result, not the warning, is the point
            grads = cross_attention_backward(**inputs, **kwargs)
    except Exception as exc:  # the table records whatever comes out
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        return f"`{type(exc).__name__}`: " + " ".join(lines[:3])
    finite = [numpy.isfinite(_host(g)).all() for g in grads]
    if all(finite):
        return "runs; all outputs finite"
    bad = [name for name, ok in zip(CrossAttentionGrads._fields, finite) if not ok]
    return f"runs; NaN/Inf in {len(bad)} of 10 outputs ({', '.join(bad)})"


def _host(array):
    return array if isinstance(array, numpy.ndarray) else array.get()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["numpy", "cupy"], default="numpy")
    parser.add_argument("--precision", choices=["fp32", "tf32", "fp16"], default=None)
    args = parser.parse_args()
    if args.backend == "cupy":
        import cupy as xp
    else:
        xp = numpy
    mode = f", precision {args.precision}" if args.precision else ""
    print(f"| input (B=2, Nv=6, Nt=5, D=256, H={H}; backend {args.backend}{mode}) | what it gets |")
    print("|---|---|")
    for what, inputs, kwargs in _rows(xp):
        print(f"| {what} | {_outcome(inputs, kwargs, args.backend, args.precision).replace('|', '/')} |")


if __name__ == "__main__":
    main()
