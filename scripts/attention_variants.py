"""The attention kernel alone, per variant of a launcher knob of cupy_xattn.attention_bwd (default:
the resident kernel's tile, RESIDENT_BLOCK_Q 64 or 128): GPU time (CUDA events, median), relative
error against the float64 reference, and the registers and local (spill) bytes per thread of the
kernel as this machine's NVRTC and driver built it. fp32 times the build the fp32 mode runs, which
writes O as an fp16 copy and remainder (``o_half``); tf32 the build that writes fp32 O rows.

Usage: PYTHONPATH=. python3 scripts/attention_variants.py [--precision tf32] [--reps 20] \
           [--knob RESIDENT_BLOCK_Q=64,128] 64x128x77 2x4096x77 ...
"""
import argparse
import ast

import numpy

from cupy_xattn import attention_bwd, cases, reference
from cupy_xattn.checks import Problem


def main():
    import cupy

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="+")
    parser.add_argument("--precision", default="tf32", choices=["tf32", "fp32"])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--knob", default="RESIDENT_BLOCK_Q=64,128",
                        help="NAME=V1,V2,...: a module constant of attention_bwd and the values to try")
    args = parser.parse_args()
    knob, _, values = args.knob.partition("=")
    if not hasattr(attention_bwd, knob) or not values:
        parser.error(f"--knob {args.knob!r}: expected NAME=V1,V2,... with NAME a constant of attention_bwd")
    values = [ast.literal_eval(v) for v in values.split(",")]  # ints or True/False
    heads, hidden, scale = 16, 1024, 0.125
    sm_count = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["multiProcessorCount"]
    print(f"{'shape':>12} {knob:>16} {'chunks':>6} {'us':>9} {'max rel err':>12} {'regs':>5} {'local B':>8}")
    for shape in args.shapes:
        case = cases.parse_shape(shape, atol=0.0)
        b, nv, nt = case.batch_size, case.num_video_tokens, case.num_text_tokens
        rng = numpy.random.default_rng(0)
        q0, dout = (rng.standard_normal((b * nv, hidden), dtype=numpy.float32) for _ in range(2))
        kv0 = rng.standard_normal((b * nt, 2 * hidden), dtype=numpy.float32)
        bq, bk, bv = (rng.standard_normal(hidden, dtype=numpy.float32) for _ in range(3))
        f64 = lambda a, n: a.astype(numpy.float64).reshape(b, n, -1)  # noqa: E731
        q, k, v = f64(q0, nv) + bq, f64(kv0[:, :hidden], nt) + bk, f64(kv0[:, hidden:], nt) + bv
        do = f64(dout, nv)
        ref = (reference.attention(q, k, v, scale, num_heads=heads),
               *reference.attention_backward(do, q, k, v, scale, num_heads=heads))
        biases = [cupy.asarray(x) for x in (bq, bk, bv)]
        table = cupy.array([x.data.ptr for x in biases], numpy.uint64)
        gpu = [cupy.asarray(x) for x in (q0, kv0, dout)]
        o_half = args.precision == "fp32"
        # fp32: inverse scales of T, [Wk; Wv], bv, dY that bound |V| as the copies' would (max|V0| ≤
        # hidden · 2^15 · inv_t · 2^15 · inv_w), then 1 / s_O and the two alphas, written by the kernel.
        inv_w = 2.0 ** (numpy.ceil(numpy.log2(numpy.abs(kv0[:, hidden:]).max() / hidden)) - 14)
        inv_bv = 2.0 ** (numpy.ceil(numpy.log2(numpy.abs(bv).max())) - 15)
        o_scales = cupy.array([2.0 ** -15, inv_w, inv_bv, 1.0] + [numpy.nan] * 3, numpy.float32)
        for value in values:
            setattr(attention_bwd, knob, value)
            kernel = attention_bwd.AttentionBackward(Problem(b, nv, nt, hidden, heads, 64, scale), args.precision,
                                                     sm_count, o_half=o_half)
            o, dq = (cupy.full((b * nv, hidden), numpy.nan, numpy.float32) for _ in range(2))
            dkv = cupy.full((b * nt, 2 * hidden), numpy.nan, numpy.float32)
            o_lo = o.astype(numpy.float16) if o_half else None  # the remainders (times 2^11)
            o = o.astype(numpy.float16) if o_half else o
            half = (dict(o_scales=tuple(o_scales.data.ptr + 4 * i for i in range(6)), o_lo=o_lo.data.ptr)
                    if o_half else {})
            run = lambda: kernel(gpu[0], gpu[1], table.data.ptr, gpu[2], o, dq, dkv, **half)  # noqa: E731
            run()
            times = []
            for _ in range(args.reps):
                start, end = cupy.cuda.Event(), cupy.cuda.Event()
                start.record()
                run()
                end.record()
                end.synchronize()
                times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3)
            got_kv = cupy.asnumpy(dkv).reshape(b, nt, 2 * hidden)
            got_o = cupy.asnumpy(o).astype(numpy.float64)
            if o_half:
                got_o = (got_o + cupy.asnumpy(o_lo).astype(numpy.float64) * 2.0 ** -11) * float(o_scales[4])
            got = (got_o.reshape(b, nv, -1), cupy.asnumpy(dq).reshape(b, nv, -1),
                   got_kv[..., :hidden], got_kv[..., hidden:])
            err = max(float(numpy.abs(x - y).max() / numpy.abs(y).max()) for x, y in zip(got, ref))
            attributes = kernel._main.attributes
            print(f"{shape:>12} {value!s:>16} {kernel.n_chunks:>6} {numpy.median(times):9.1f} {err:12.2e} "
                  f"{attributes['num_regs']:>5} {attributes['local_size_bytes']:>8}", flush=True)


if __name__ == "__main__":
    main()
