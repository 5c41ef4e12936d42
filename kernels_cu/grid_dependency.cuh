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

// Global loads that nothing but wait_for_inputs() precedes: ptxas schedules read-only loads
// (ld.global.nc, what a const __restrict__ pointer gets) above griddepcontrol.wait when they stand
// right behind it (sm_90a, nvcc 13.0: attn_bwd_lean's prologue, Session 36), where they would read
// what the kernels before are still writing; L2-cached loads (ld.global.cg) it leaves behind it.
template <typename T>
__device__ __forceinline__ T load_after_wait(const T* p) {
    return __ldcg(p);
}
__device__ __forceinline__ const float* load_after_wait(const float* const* p) {
    return reinterpret_cast<const float*>(__ldcg(reinterpret_cast<const unsigned long long*>(p)));
}

// Lets the kernels that depend on this one through a programmatic edge be launched before it ends:
// they still wait for all of it in their wait_for_inputs(), so only their launch, and the SM slots
// their blocks take, come earlier. Used where a small grid follows a large one that something on
// another lane would otherwise fill the SMs behind (the conversions' rescales: perf-notes, v67).
__device__ __forceinline__ void launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;");
#endif
}
