"""Tell initcheck's reports about our kernels from reports about what wrote their inputs.

initcheck flags a read of global memory that no tracked write initialised. Two probes, each run
under initcheck, e.g. ``PYTHONPATH=. compute-sanitizer --tool initcheck python3
scripts/initcheck_probe.py attention 1x100x93``:

    gemm       C = A @ B by cuBLAS (TF32, the backward's GEMM shape class), then a CuPy
               reduction reads C. A report here is about how cuBLAS wrote C, not about the reader.
    attention  the fused attention kernel alone (shape BxNvxNt, default 2x64x77), its inputs copied from the host (cudaMemcpy),
               its outputs poisoned first. A report here is a read of memory our code never wrote.
"""
import argparse

import cupy
import numpy

from cupy_xattn import attention_bwd, gemm
from cupy_xattn.checks import Problem


def probe_gemm():
    rng = numpy.random.default_rng(0)
    a = cupy.asarray(rng.standard_normal((512, 1024), dtype=numpy.float32))
    b = cupy.asarray(rng.standard_normal((1024, 1024), dtype=numpy.float32))
    c = cupy.empty((512, 1024), numpy.float32)
    gemm.matmul(a, b, c, trans_b=True)
    print("gemm: sum of C =", float(c.sum()), flush=True)


def probe_attention(batch_size=2, n_video=64, n_text=77, hidden=1024, heads=16):
    rng = numpy.random.default_rng(0)
    host = lambda *shape: cupy.asarray(rng.standard_normal(shape, dtype=numpy.float32))  # noqa: E731
    q0, kv0, dout = host(batch_size * n_video, hidden), host(batch_size * n_text, 2 * hidden), host(
        batch_size * n_video, hidden)
    biases = [host(hidden) for _ in range(3)]
    table = cupy.array([b.data.ptr for b in biases], numpy.uint64)
    o, dq, dkv = (cupy.full(x.shape, numpy.nan, numpy.float32) for x in (q0, q0, kv0))
    sm_count = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["multiProcessorCount"]
    problem = Problem(batch_size, n_video, n_text, hidden, heads, 64, 0.125)
    attention_bwd.AttentionBackward(problem, "tf32", sm_count)(q0, kv0, table.data.ptr, dout, o, dq, dkv)
    print("attention: outputs finite:", all(bool(cupy.isfinite(x).all()) for x in (o, dq, dkv)), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("probe", choices=["gemm", "attention"])
    parser.add_argument("shape", nargs="?", default="2x64x77", help="BxNvxNt of the attention probe")
    args = parser.parse_args()
    if args.probe == "gemm":
        probe_gemm()
    else:
        probe_attention(*map(int, args.shape.split("x")))


if __name__ == "__main__":
    main()
