// Building blocks of warp-specialised kernels (sm_90): warpgroups with different roles in one block
// (a producer that copies tiles, consumers that multiply them) hand shared-memory stages to each
// other through mbarriers, take turns through named barriers, and move registers from the
// producer, which needs few, to the consumers (setmaxnreg, sm_90a).
//
// Stage hand-off: a stage has a "full" barrier (the producer's threads arrive once the copies into
// it have landed) and an "empty" one (the consumers arrive once they have read it). Phases
// alternate; a waiter names the parity of the phase it waits for: the n-th fill of a stage
// completes phase n - 1 of its full barrier, so the consumer of use n of a stage waits for parity
// n & 1, and the producer, before refilling it for use n, for parity (n & 1) ^ 1 of the empty
// barrier (which passes at once for use 0: the phase "before" the first counts as complete).
#pragma once

#include <cstdint>

#include "device_primitives.cuh"

namespace astr::kernels {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Before any thread uses it, and followed by a barrier that orders the initialisation before use.
__device__ __forceinline__ void mbarrier_init(uint64_t* barrier, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(shared_address(barrier)),
               "r"(arrivals)
               : "memory");
}
// After a block's barriers are initialised, before the barrier that publishes them: makes the
// initialisation visible to the asynchronous proxy too (TMA completes its bytes there).
__device__ __forceinline__ void mbarrier_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Release: this thread's earlier shared-memory writes are visible to the threads whose wait
// returns for the phase this arrival completes.
__device__ __forceinline__ void mbarrier_arrive(uint64_t* barrier) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(shared_address(barrier))
               : "memory");
}
// Acquire: blocks until the phase of the given parity has completed.
__device__ __forceinline__ void mbarrier_wait(uint64_t* barrier, int parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(shared_address(barrier)),
      "r"(parity)
      : "memory");
}

// The barrier counts one arrival of this thread once every cp.async it has issued so far has
// landed (the thread goes on at once; .noinc: the arrival is one of those the barrier was
// initialised to expect).
__device__ __forceinline__ void cp_async_arrive_on(uint64_t* barrier) {
  asm volatile(
      "cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(shared_address(barrier))
      : "memory");
}
// The same without .noinc: the barrier expects one more arrival first, so the phase waits for it
// and for another arrival (a thread that arrives after every such call has been made).
__device__ __forceinline__ void cp_async_arrive_on_counted(uint64_t* barrier) {
  asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];\n" ::"r"(shared_address(barrier))
               : "memory");
}

// This thread's arrival, and `bytes` more that asynchronous copies (TMA) will complete on the
// barrier: the phase completes once every arrival is in and those bytes have landed. Before the
// copies are issued.
__device__ __forceinline__ void mbarrier_arrive_expect_bytes(uint64_t* barrier, uint32_t bytes) {
  asm volatile(
      "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(shared_address(barrier)),
      "r"(bytes)
      : "memory");
}

// Named barrier `id` (1..15; 0 is __syncthreads') over `threads` threads, whole warps: sync waits
// for the count, arrive counts this warp without waiting. A pair of warpgroups takes turns with
// it: one syncs, the other arrives when the turn is handed over.
template <int kThreads>
__device__ __forceinline__ void named_barrier_sync(int id) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(kThreads) : "memory");
}
template <int kThreads>
__device__ __forceinline__ void named_barrier_arrive(int id) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "n"(kThreads) : "memory");
}
#endif

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Registers per thread of the calling warpgroup, moved to or from the block's pool. Takes effect
// only in a kernel with a register cap at entry (__launch_bounds__(threads, 1)), each role's
// call the start of one branch of a single if / else; ptxas warns (C7508) otherwise.
template <int kRegisters>
__device__ __forceinline__ void release_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}
template <int kRegisters>
__device__ __forceinline__ void claim_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}
#endif

}  // namespace astr::kernels
