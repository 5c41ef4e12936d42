"""The fp16 mode's Q0 = X Wq^T with bq added by cuBLASLt's bias epilogue (Handle.bias_gemm), against
the cublasGemmBatchedEx call without it that the plan made before (attn_bwd_lean then added bq to
every Q tile it loaded).

D = 1024, M = B·Nv rows, fp16 operands and output, fp32 accumulation, alpha from device memory.
Prints, per M and SM target (0: all SMs; 44: the third the small fp16 cases give Q0), whether the
Lt call's output matches the batched call's plus the bias (max |difference| over max |Q0|, at
fp16's rounding: ~1e-3), whether its graph replay matches its eager run, and the GPU times of
the two as graph replays (the plan replays a graph).

Usage (GPU): PYTHONPATH=. python3 scripts/bias_gemm_probe.py [M ...]      (default 512 1024 2048 8192)
Times: CUDA events around 10 queued calls behind a spin kernel, median of 20 (gemm_probe.py's
median_us); L2 not flushed.
"""
import sys

import cupy
import numpy

from cupy_xattn import _cublas, gemm

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gemm_probe import median_us  # noqa: E402
from grouped_probe import captured, largest_difference  # noqa: E402

D = 1024


def main():
    stream = cupy.cuda.Stream(non_blocking=True)
    handle = _cublas.Handle(stream)
    print(f"{'M':>6} {'SMs':>4} {'batched, no bias':>17} {'Lt with bias':>13} {'rel. diff':>10} {'replay diff':>12}"
          "   (graph replays, µs)")
    for m in [int(v) for v in sys.argv[1:]] or [512, 1024, 2048, 8192]:
        rng = cupy.random.default_rng(m)
        half = lambda *shape: rng.standard_normal(shape, dtype=numpy.float32).astype(numpy.float16)  # noqa: E731
        x, wq, bias = half(m, D), half(D, D), half(D)
        constants = cupy.array([0.0, 2.0 ** -6], numpy.float32)  # beta, alpha
        q0, q0_lt = cupy.empty((m, D), numpy.float16), cupy.empty((m, D), numpy.float16)
        table = cupy.array([wq.data.ptr, x.data.ptr, q0.data.ptr], numpy.uint64)
        cupy.cuda.Device().synchronize()
        for sms in (0, 44):
            with stream:
                # Row-major Q0 = X Wq^T is column-major Q0^T = Wq^T(col) X^T(col): Wq's buffer first.
                def batched():
                    handle.gemm_batched(gemm.OP_T, gemm.OP_N, D, m, D, constants.data.ptr + 4, table.data.ptr,
                                        gemm.R_16F, D, table.data.ptr + 8, gemm.R_16F, D, constants.data.ptr,
                                        table.data.ptr + 16, gemm.R_16F, D, 1, gemm.COMPUTE_32F, sm_target=sms)
                lt = handle.bias_gemm(gemm.OP_T, gemm.OP_N, D, m, D, constants.data.ptr + 4, wq.data.ptr, D,
                                      x.data.ptr, D, constants.data.ptr, q0_lt.data.ptr, D, bias.data.ptr,
                                      sm_target=sms)
                q0.fill(numpy.nan)
                q0_lt.fill(numpy.nan)
                batched()
                lt()
                expected = q0.astype(numpy.float32) + bias.astype(numpy.float32)
                diff = largest_difference([q0_lt], [expected]) / float(cupy.abs(expected).max())
                eager = q0_lt.copy()
                graphs = [captured(stream, batched), captured(stream, lt)]
                q0_lt.fill(numpy.nan)
                graphs[1].launch(stream)
                replay_diff = largest_difference([q0_lt], [eager])
                times = [median_us(lambda g=g: g.launch(stream)) for g in graphs]
            print(f"{m:>6} {sms:>4} {times[0]:14.1f} µs {times[1]:10.1f} µs {diff:10.2g} {replay_diff:12.3g}",
                  flush=True)


if __name__ == "__main__":
    main()
