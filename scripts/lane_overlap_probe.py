"""Do two independent cuBLAS GEMMs captured on two streams of one CUDA graph run side by side?

Usage:  PYTHONPATH=. python3 scripts/lane_overlap_probe.py [--rows 1024 154] [--reps 10]

In the plans' graphs of the small cases the first GEMMs of the three lanes (Q0 over B·Nv rows,
[K0 | V0] over B·Nt rows) ran one after the other although nothing orders them (Session 9,
`graph_kernels.py --trace --kernels`). This replays, with the TF32 GEMMs of those shapes
(row-major C = A B^T, K = 1024; N = 1024 and 2048): each alone, both on two lanes (forked and
joined as Backward does), and both on one lane; and prints every kernel's start and end of a
replay (CUPTI through torch's profiler, as graph_kernels.py --trace). Overlap on two lanes, or
its absence, says whether the lanes' serial start is the graph's or the GEMM kernels' doing.
"""
import argparse

import numpy

from cupy_xattn import _cublas
from cupy_xattn.gemm import COMPUTE_32F_FAST_TF32, OP_N, OP_T, R_32F
from graph_kernels import trace

D = 1024


def main():
    import cupy

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs=2, default=[1024, 154], help="M of the two GEMMs")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    constants = cupy.array([1.0, 0.0], numpy.float32)  # alpha, beta (device pointer mode)
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
    handles = [_cublas.Handle(stream) for stream in streams]
    keep = []

    def table(*arrays):
        pointers = cupy.array([a.data.ptr for a in arrays], numpy.uint64)
        keep.append((arrays, pointers))
        return pointers.data.ptr

    def gemm(rows, n, lane):
        """C = A B^T, A [rows][D], B [n][D], row-major (cuBLAS: C^T = B A^T, B first)."""
        a, b = (cupy.random.standard_normal(shape, dtype=numpy.float32) for shape in ((rows, D), (n, D)))
        c = cupy.empty((rows, n), numpy.float32)
        pointers = table(b), table(a), table(c)
        return lambda lane=lane: handles[lane].gemm_batched(
            OP_T, OP_N, n, rows, D, constants.data.ptr, pointers[0], R_32F, D, pointers[1], R_32F, D,
            constants.data.ptr + 4, pointers[2], R_32F, n, 1, COMPUTE_32F_FAST_TF32)

    first, second = gemm(args.rows[0], D, 0), gemm(args.rows[1], 2 * D, 1)
    cupy.cuda.Device().synchronize()  # the operands and tables, made on the default stream, are written
    forked, joined = cupy.cuda.Event(disable_timing=True), cupy.cuda.Event(disable_timing=True)

    def two_lanes():
        forked.record(streams[0])
        streams[1].wait_event(forked)
        first()
        second()
        joined.record(streams[1])
        streams[0].wait_event(joined)

    variants = {"first alone": first, "second alone": lambda: second(lane=0), "both, two lanes": two_lanes,
                "both, one lane": lambda: (first(), second(lane=0))}
    for label, issue in variants.items():
        issue()  # loads cuBLAS's kernels outside the capture
        cupy.cuda.Device().synchronize()
        streams[0].begin_capture()
        issue()
        graph = streams[0].end_capture()
        print(f"== {label} (rows {args.rows[0]} x N {D}, rows {args.rows[1]} x N {2 * D}, K {D})", flush=True)
        trace(lambda: graph.launch(streams[0]), args.reps, listing=True, lead=False)  # its own stream: no lead


if __name__ == "__main__":
    main()
