// Copyright (c) tracelock authors.
// apply_commits on CUDA, torch-free (cuda_runtime.h only) so it compiles in ~2 s with bare nvcc and
// against CPU-only torch installs. One block per row: pass 1 commits and finds the first EOT, pass 2
// fills the tail under stop_at_eot and finds the first ACTIVE. Same IO as the CPU loop.
#include <cuda_runtime.h>

#include <cstdint>

#include "apply_commits.h"

namespace {

constexpr int kThreads = 256;

__global__ void apply_commits_kernel(int64_t* __restrict__ x, uint8_t* __restrict__ state,
                                     const int64_t* __restrict__ proposal, const bool* __restrict__ commit,
                                     const int64_t* __restrict__ end_ids, int64_t* __restrict__ first_active,
                                     int64_t L, int64_t E, int64_t fill_id, bool stop_at_eot) {
  __shared__ unsigned long long s_first_eot, s_first_active;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * L;
  if (threadIdx.x == 0) {
    s_first_eot = static_cast<unsigned long long>(L);
    s_first_active = static_cast<unsigned long long>(L);
  }
  __syncthreads();
  for (int64_t l = threadIdx.x; l < L; l += blockDim.x) {
    uint8_t s = state[row + l];
    if (s == kActive && commit[row + l]) {
      const int64_t tok = proposal[row + l];
      bool is_end = false;
      for (int64_t e = 0; e < E; ++e) is_end |= end_ids[e] == tok;
      x[row + l] = tok;
      s = is_end ? kEot : kLocked;
      state[row + l] = s;
    }
    if (s == kEot) atomicMin(&s_first_eot, static_cast<unsigned long long>(l));
  }
  __syncthreads();
  // each thread revisits only its own positions, so its pass-1 writes are visible without a fence
  const int64_t first_eot = stop_at_eot ? static_cast<int64_t>(s_first_eot) : L;
  for (int64_t l = threadIdx.x; l < L; l += blockDim.x) {
    if (state[row + l] != kActive) continue;
    if (l > first_eot) {
      x[row + l] = fill_id;
      state[row + l] = kEot;
    } else {
      atomicMin(&s_first_active, static_cast<unsigned long long>(l));
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) first_active[blockIdx.x] = static_cast<int64_t>(s_first_active);
}

}  // namespace

extern "C" cudaError_t tracelock_apply_commits_launch(int64_t* x, uint8_t* state, const int64_t* proposal,
                                                      const bool* commit, const int64_t* end_ids,
                                                      int64_t* first_active, int64_t B, int64_t L, int64_t E,
                                                      int64_t fill_id, bool stop_at_eot, cudaStream_t stream) {
  if (B == 0) return cudaSuccess;
  apply_commits_kernel<<<static_cast<unsigned>(B), kThreads, 0, stream>>>(x, state, proposal, commit, end_ids,
                                                                         first_active, L, E, fill_id, stop_at_eot);
  return cudaGetLastError();
}
