// Programmatic dependent launch (sm_90 and later). plans.py makes the graph edges into this
// library's kernels programmatic (graphs.py): such a kernel may be launched while the kernels it
// depends on are still finishing, and its first statement, wait_for_inputs(), holds every thread
// until they have completed and their writes are visible. So it must come before any access to
// global memory, in every thread of every block; a block that left before it would let whatever
// depends on this kernel start before this kernel's own inputs were ready. Without a programmatic
// edge (a direct launch, an older GPU) the wait returns at once.
__device__ __forceinline__ void wait_for_inputs() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
