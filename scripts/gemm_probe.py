"""cuBLAS TF32 rates for the weight-gradient product dW = A^T B (A, B: [M, D] row-major, M = B·Nv),
laid out as the backward has it and in the alternatives: K-major copies, batching, split-K.

Usage (GPU): PYTHONPATH=. python3 scripts/gemm_probe.py [M ...]    (default 8192 4928 1024)
Times: CUDA events around 10 queued calls (issued behind a spin kernel), median of 20; L2 not
flushed (operands of 8-64 MB).
"""
import sys

import cupy
import numpy

from cupy_xattn import gemm
from cupy_xattn.bench import LEAD_SOURCE


def median_us(fn, reps=20, queued=10):
    """Median over reps of the mean GPU time of ``queued`` back-to-back calls. A spin kernel
    (~1 ms) runs first, so the host has issued them all before the start event is reached:
    on this slow host one call takes longer to issue than small GEMMs take to run."""
    spin = cupy.RawKernel(LEAD_SOURCE, "lead")
    fn()
    times = []
    for _ in range(reps):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        spin((1,), (1,), (numpy.int64(2_000_000),))
        start.record()
        for _ in range(queued):
            fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3 / queued)
    return float(numpy.median(times))


def main():
    d = 1024
    for m in [int(x) for x in sys.argv[1:]] or [8192, 4928, 1024]:
        rng = cupy.random.default_rng(0)
        a, b = (rng.standard_normal((m, d), dtype=numpy.float32) for _ in range(2))
        a_t, b_t = cupy.ascontiguousarray(a.T), cupy.ascontiguousarray(b.T)
        c = cupy.empty((d, d), numpy.float32)
        flop = 2 * m * d * d
        ref = a.T @ b
        print(f"M={m}: dW = A^T B, {flop / 1e9:.1f} GFLOP")
        runs = {"nt (as the backward: A^T B, row-major A, B)": lambda: gemm.matmul(a, b, c, trans_a=True),
                "tn (K-major copies A^T, B^T)": lambda: gemm.matmul(a_t, b_t, c, trans_b=True)}
        for splits in (2, 4, 8):
            if m % splits:
                continue
            part = cupy.empty((splits, d, d), numpy.float32)
            a3, b3 = a.reshape(splits, m // splits, d), b.reshape(splits, m // splits, d)

            def split_k(a3=a3, b3=b3, part=part):
                gemm.matmul_batched(a3, b3, part, trans_a=True)
                part.sum(axis=0, out=c)
            runs[f"nt split-K x{splits} (batched) + sum"] = split_k
            runs[f"  its batched GEMM alone x{splits}"] = lambda a3=a3, b3=b3, part=part: gemm.matmul_batched(
                a3, b3, part, trans_a=True)
        for label, fn in runs.items():
            us = median_us(fn)
            err = float(cupy.abs(c - ref).max() / cupy.abs(ref).max()) if "alone" not in label else float("nan")
            print(f"  {label:48s} {us:8.1f} us {flop / us / 1e6:7.1f} TFLOP/s  rel err {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
