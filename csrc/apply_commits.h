// Copyright (c) tracelock authors.
// Shared declarations of tracelock._C. Torch-free, so the .cu file can include it too.
#pragma once

#include <cstdint>

// position states, mirrored from tracelock/states.py
constexpr uint8_t kActive = 1;
constexpr uint8_t kLocked = 2;
constexpr uint8_t kEot = 3;

namespace tracelock {
// whether this build holds the CUDA kernels (the WITH_CUDA macro)
bool with_cuda();
}  // namespace tracelock

#ifdef WITH_CUDA
#include <cuda_runtime.h>
// torch-free launcher in apply_commits_kernel.cu: one block per row
extern "C" cudaError_t tracelock_apply_commits_launch(int64_t* x, uint8_t* state, const int64_t* proposal,
                                                      const bool* commit, const int64_t* end_ids,
                                                      int64_t* first_active, int64_t B, int64_t L, int64_t E,
                                                      int64_t fill_id, bool stop_at_eot, cudaStream_t stream);
#endif
