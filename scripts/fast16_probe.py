"""cuBLAS's CUBLAS_COMPUTE_32F_FAST_16F (fp32 data, converted to fp16 inside the GEMM) against TF32 on
fp32 data and against fp16 operands converted beforehand, on the backward's eight projection GEMMs.

If FAST_16F ran at the fp16 operands' rate, the fp16 mode's two conversion passes (~80 µs of fp16
64x128x77's 393 µs) could go; it takes no scale, so it keeps fp16's range only (perf-notes, Session 38).
Per case and compute mode: the summed GPU time of the eight GEMMs (each timed alone, CUDA events
around 10 queued calls behind a spin, median of 20: gemm_probe.median_us; L2 not flushed) and the
largest relative error max|x − y| / max|y| against float64, inputs drawn as the benchmark draws them.

Usage (GPU): PYTHONPATH=. python3 scripts/fast16_probe.py [BxNvxNt ...]   (default 64x128x77 8x512x77 2x256x77)
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

COMPUTE_32F_FAST_16F = 74  # cublasComputeType_t (cublas_api.h)


def backward_gemms(batch_size, num_video_tokens, num_text_tokens, hidden=1024):
    """The backward's projection GEMMs as (name, rows of A, M, N, K, trans_a, trans_b) of
    ``gemm.matmul``: C[M, N] = op(A) op(B), row-major, A with ``rows of A`` rows. Their FLOPs,
    2·M·N·K each, sum to WORKLOAD.md's 10·Mv·D² + 12·Mt·D² (the attention's part aside)."""
    mv, mt, d = batch_size * num_video_tokens, batch_size * num_text_tokens, hidden
    return [("Q0 = X Wq^T", mv, mv, d, d, False, True),
            ("[K0 | V0] = T [Wk; Wv]^T", mt, mt, 2 * d, d, False, True),
            ("dO = dY Wo", mv, mv, d, d, False, False),
            ("dWo = dY^T O", mv, d, d, mv, True, False),
            ("dX = dQ Wq", mv, mv, d, d, False, False),
            ("dWq = dQ^T X", mv, d, d, mv, True, False),
            ("dT = [dK | dV] [Wk; Wv]", mt, mt, d, 2 * d, False, False),
            ("[dWk; dWv] = [dK | dV]^T T", mt, 2 * d, d, mt, True, False)]


def main():
    import cupy
    import numpy

    from cupy_xattn import cases, gemm
    from gemm_probe import median_us

    modes = {"tf32": (numpy.float32, gemm.COMPUTE_32F_FAST_TF32), "fast16f": (numpy.float32, COMPUTE_32F_FAST_16F),
             "fp16 operands": (numpy.float16, gemm.COMPUTE_32F)}
    shapes = sys.argv[1:] or ["64x128x77", "8x512x77", "2x256x77"]
    rng = cupy.random.default_rng(38)
    print(f"{'case':12s} {'GEMM':28s} " + " ".join(f"{m + ' µs':>16s} {'rel err':>8s}" for m in modes))
    for shape in shapes:
        case = cases.parse_shape(shape, atol=0.0)
        totals = dict.fromkeys(modes, 0.0)
        for name, rows, m, n, k, trans_a, trans_b in backward_gemms(*case[:3]):
            a = rng.standard_normal((rows, k if not trans_a else m), dtype=numpy.float32)
            b = rng.standard_normal((n, k) if trans_b else (k, n), dtype=numpy.float32)
            if not trans_a:  # B is a weight: randn / √1024, as the benchmark draws them
                b /= numpy.float32(32)
            ref = (a.T if trans_a else a).astype(numpy.float64) @ (b.T if trans_b else b).astype(numpy.float64)
            cells = []
            for mode, (dtype, compute) in modes.items():
                a_in, b_in = a.astype(dtype), b.astype(dtype)
                c = cupy.empty((m, n), numpy.float32)

                def run(a_in=a_in, b_in=b_in, c=c, compute=compute):
                    gemm.matmul(a_in, b_in, c, trans_a=trans_a, trans_b=trans_b, compute=compute)
                us = median_us(run)
                totals[mode] += us
                error = float(cupy.abs(c - ref).max() / cupy.abs(ref).max())
                cells.append(f"{us:16.1f} {error:8.1e}")
            print(f"{shape:12s} {name:28s} " + " ".join(cells))
        print(f"{shape:12s} {'sum of the eight':28s} " + " ".join(f"{t:16.1f} {'':8s}" for t in totals.values()))


if __name__ == "__main__":
    main()
