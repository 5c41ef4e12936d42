"""cuBLAS's CUBLAS_COMPUTE_32F_FAST_16F (fp32 data, converted to fp16 inside the GEMM) against TF32 on
fp32 data and against fp16 operands converted beforehand, on the backward's eight projection GEMMs.

If FAST_16F ran at the fp16 operands' rate, the fp16 mode's two conversion passes (~80 µs of fp16
64x128x77's ~397 in Session 28's trace) could go; it takes no scale, so it keeps fp16's range only
(perf-notes, Session 38). Per case and compute mode: the summed GPU time of the eight GEMMs, laid
out as the fp16 mode has them (each timed alone, CUDA events around 10 queued calls behind a spin,
median of 20: gemm_probe.median_us; L2 not flushed), the largest relative error max|x − y| / max|y|
against float64 with inputs drawn as the benchmark draws them, and whether FAST_16F ran in fp16 at
all (an element of 1e5 in A: Inf only in fp16).

Usage (GPU): PYTHONPATH=. python3 scripts/fast16_probe.py [BxNvxNt ...]   (default 64x128x77 8x512x77 2x256x77)
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

COMPUTE_32F_FAST_16F = 74  # cublasComputeType_t (cublas_api.h)


def operand_shapes(batch_size, num_video_tokens, num_text_tokens, hidden=1024):
    """The stored (row-major) shape of each operand of backward_gemms."""
    mv, mt, d = batch_size * num_video_tokens, batch_size * num_text_tokens, hidden
    return {"X": (mv, d), "dY": (mv, d), "O": (mv, d), "dQ": (mv, d), "T": (mt, d), "[dK | dV]": (mt, 2 * d),
            "Wq": (d, d), "Wo": (d, d), "[Wk; Wv]": (2 * d, d)}


#: the backward's projection GEMMs as the fp16 mode lays them out (backward.py; the tf32 mode reads
#: pre-transposed weights and K-major copies for the weight gradients, and K0|V0 and dWk|dWv are two
#: batched products there): (A, B, trans_a, trans_b) of ``gemm.matmul``'s C = op(A) op(B)
BACKWARD_GEMMS = [("X", "Wq", False, True), ("T", "[Wk; Wv]", False, True), ("dY", "Wo", False, False),
                  ("dY", "O", True, False), ("dQ", "Wq", False, False), ("dQ", "X", True, False),
                  ("[dK | dV]", "[Wk; Wv]", False, False), ("[dK | dV]", "T", True, False)]


def backward_gemms(batch_size, num_video_tokens, num_text_tokens, hidden=1024):
    """BACKWARD_GEMMS with their sizes: (A, B, M, N, K, trans_a, trans_b), op(A) M × K, op(B) K × N.
    Their FLOPs, 2·M·N·K each, sum to WORKLOAD.md's 10·Mv·D² + 12·Mt·D² (the attention's part aside)."""
    shapes = operand_shapes(batch_size, num_video_tokens, num_text_tokens, hidden)
    gemms = []
    for a, b, trans_a, trans_b in BACKWARD_GEMMS:
        (m, k), (k_b, n) = shapes[a][::-1] if trans_a else shapes[a], shapes[b][::-1] if trans_b else shapes[b]
        if k != k_b:
            raise ValueError(f"op({a}) and op({b}) do not chain: {shapes[a]}, {shapes[b]}")
        gemms.append((a, b, m, n, k, trans_a, trans_b))
    return gemms


def main():
    import cupy
    import numpy

    from cupy_xattn import cases, gemm
    from gemm_probe import median_us

    modes = {"tf32": (numpy.float32, gemm.COMPUTE_32F_FAST_TF32), "fast16f": (numpy.float32, COMPUTE_32F_FAST_16F),
             "fp16 operands": (numpy.float16, gemm.COMPUTE_32F)}
    shapes = sys.argv[1:] or ["64x128x77", "8x512x77", "2x256x77"]
    rng = cupy.random.default_rng(38)
    print(f"{'case':12s} {'GEMM':24s} " + " ".join(f"{m + ' µs':>16s} {'rel err':>8s}" for m in modes)
          + "  FAST_16F in fp16?")
    for shape in shapes:
        case = cases.parse_shape(shape, atol=0.0)
        stored = operand_shapes(*case[:3])
        totals = dict.fromkeys(modes, 0.0)
        for a_name, b_name, m, n, k, trans_a, trans_b in backward_gemms(*case[:3]):
            a, b = (rng.standard_normal(stored[name], dtype=numpy.float32) for name in (a_name, b_name))
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
            # TF32 and fp16 round alike (10-bit significands) and randn stays in fp16's range, so the
            # error cannot tell them apart: an element of 1e5 (over fp16's 65504) can, Inf only in fp16.
            sentinel = a.copy()
            sentinel[0, 0] = 1e5
            c = cupy.empty((m, n), numpy.float32)
            gemm.matmul(sentinel, b, c, trans_a=trans_a, trans_b=trans_b, compute=COMPUTE_32F_FAST_16F)
            print(f"{shape:12s} {f'{a_name} · {b_name}':24s} " + " ".join(cells)
                  + f"  {'yes (Inf)' if bool(cupy.isinf(c).any()) else 'no (finite)'}")
        print(f"{shape:12s} {'sum of the eight':24s} " + " ".join(f"{t:16.1f} {'':8s}" for t in totals.values()))


if __name__ == "__main__":
    main()
