// Copyright (c) tracelock authors.
// The tracelock::skip_finished_blocks op: the semi-AR block schedule's advance, one pass per row, no host
// sync. The spec is skip_finished_blocks_ref in kernels/ref.py (about two dozen small ATen ops per
// skipped block, most over the whole [B, L] state, plus a host sync to stop). CPU only: on CUDA the torch spec runs.
// Reads the selected rows' current blocks of state (block bytes each, again per skipped block); writes 3·B
// int64 counters in place.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "apply_commits.h"

namespace tracelock {

namespace {

int64_t active_in_block(const uint8_t* row, int64_t lo, int64_t block, int64_t L) {
  int64_t n = 0;
  for (int64_t l = lo; l < lo + block && l < L; ++l) n += row[l] == kActive;
  return n;
}

}  // namespace

void skip_finished_blocks_cpu(const at::Tensor& state, const at::Tensor& block_idx, const at::Tensor& region_step,
                              const at::Tensor& region_initial, const at::Tensor& steps, const at::Tensor& rows,
                              int64_t prompt_len, int64_t block, int64_t num_regions, int64_t steps_per_block,
                              bool idle_steps) {
  // the Python dispatcher checks the same with friendlier messages; these guard direct torch.ops calls
  TORCH_CHECK(state.dim() == 2 && state.scalar_type() == at::kByte && state.is_contiguous(),
              "skip_finished_blocks: state must be a contiguous [B, L] uint8 tensor");
  const int64_t B = state.size(0), L = state.size(1);
  for (const at::Tensor* t : {&block_idx, &region_step, &region_initial, &steps}) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == B && t->scalar_type() == at::kLong && t->is_contiguous(),
                "skip_finished_blocks: block_idx, region_step, region_initial and steps must be contiguous [B] int64");
  }
  TORCH_CHECK(rows.dim() == 1 && rows.size(0) == B && rows.scalar_type() == at::kBool && rows.is_contiguous(),
              "skip_finished_blocks: rows must be a contiguous [B] bool tensor");
  TORCH_CHECK(block > 0 && num_regions > 0, "skip_finished_blocks: block and num_regions must be positive");
  const uint8_t* ps = state.data_ptr<uint8_t>();
  int64_t* pk = block_idx.data_ptr<int64_t>();
  int64_t* pr = region_step.data_ptr<int64_t>();
  int64_t* pi = region_initial.data_ptr<int64_t>();
  const int64_t* pn = steps.data_ptr<int64_t>();
  const bool* pw = rows.data_ptr<bool>();
  for (int64_t b = 0; b < B; ++b) {
    if (!pw[b]) continue;
    const uint8_t* row = ps + b * L;
    // the spec's loop over all rows, run row by row: a row's skips never depend on another row
    while (pk[b] < num_regions - 1 && active_in_block(row, prompt_len + pk[b] * block, block, L) == 0 &&
           (!idle_steps || pn[b] >= (pk[b] + 1) * steps_per_block)) {
      pk[b] += 1;
      pr[b] = 0;
      pi[b] = active_in_block(row, prompt_len + pk[b] * block, block, L);
    }
  }
}

}  // namespace tracelock

TORCH_LIBRARY_FRAGMENT(tracelock, m) {
  m.def(
      "skip_finished_blocks(Tensor state, Tensor(a!) block_idx, Tensor(b!) region_step, Tensor(c!) region_initial, "
      "Tensor steps, Tensor rows, int prompt_len, int block, int num_regions, int steps_per_block, "
      "bool idle_steps) -> ()");
}

TORCH_LIBRARY_IMPL(tracelock, CPU, m) { m.impl("skip_finished_blocks", &tracelock::skip_finished_blocks_cpu); }
