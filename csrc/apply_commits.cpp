// Copyright (c) tracelock authors.
// The tracelock::apply_commits op: schema, CPU loop and CUDA host wrapper. The spec is apply_commits_ref in
// kernels/ref.py. Light headers only (no torch/extension.h), and one file rather than a CPU and a CUDA one,
// because each extra file re-parses the ATen headers (~10 s on 2 cores).
// Reads B·L int64 proposal + B·L bool commit + B·L state, writes B·L x/state in place and [B] first_active.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "apply_commits.h"

#ifdef WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace tracelock {

void check_inputs(const at::Tensor& x, const at::Tensor& state, const at::Tensor& proposal,
                  const at::Tensor& commit, const at::Tensor& end_ids) {
  // the Python dispatcher checks the same with friendlier messages; these guard direct torch.ops calls
  TORCH_CHECK(x.dim() == 2, "apply_commits: x must be [B, L]");
  TORCH_CHECK(state.sizes() == x.sizes() && proposal.sizes() == x.sizes() && commit.sizes() == x.sizes(),
              "apply_commits: x, state, proposal and commit must have the same shape");
  TORCH_CHECK(x.scalar_type() == at::kLong && proposal.scalar_type() == at::kLong &&
                  state.scalar_type() == at::kByte && commit.scalar_type() == at::kBool &&
                  end_ids.scalar_type() == at::kLong,
              "apply_commits: dtypes must be x/proposal/end_ids int64, state uint8, commit bool");
  TORCH_CHECK(end_ids.dim() == 1, "apply_commits: end_ids must be [E]");
  TORCH_CHECK(x.is_contiguous() && state.is_contiguous() && proposal.is_contiguous() && commit.is_contiguous() &&
                  end_ids.is_contiguous(),
              "apply_commits: all tensors must be contiguous");
  for (const at::Tensor* t : {&state, &proposal, &commit, &end_ids}) {
    TORCH_CHECK(t->device() == x.device(), "apply_commits: all tensors must be on x's device");
  }
}

at::Tensor apply_commits_cpu(const at::Tensor& x, const at::Tensor& state, const at::Tensor& proposal,
                             const at::Tensor& commit, const at::Tensor& end_ids, int64_t fill_id,
                             bool stop_at_eot) {
  check_inputs(x, state, proposal, commit, end_ids);
  const int64_t B = x.size(0), L = x.size(1), E = end_ids.size(0);
  at::Tensor first_active = at::empty({B}, x.options());
  int64_t* px = x.data_ptr<int64_t>();
  uint8_t* ps = state.data_ptr<uint8_t>();
  const int64_t* pp = proposal.data_ptr<int64_t>();
  const bool* pc = commit.data_ptr<bool>();
  const int64_t* pe = end_ids.data_ptr<int64_t>();
  int64_t* pf = first_active.data_ptr<int64_t>();
  // a plain loop: B·L is a few thousand per step, below where at::parallel_for pays for itself
  for (int64_t b = 0; b < B; ++b) {
    int64_t* xr = px + b * L;
    uint8_t* sr = ps + b * L;
    bool seen_eot = false;
    int64_t first = L;
    for (int64_t l = 0; l < L; ++l) {
      if (sr[l] == kActive && pc[b * L + l]) {
        const int64_t tok = pp[b * L + l];
        bool is_end = false;
        for (int64_t e = 0; e < E; ++e) is_end |= pe[e] == tok;
        xr[l] = tok;
        sr[l] = is_end ? kEot : kLocked;
      }
      // one pass suffices: positions before the first EOT are never filled
      if (stop_at_eot && seen_eot && sr[l] == kActive) {
        xr[l] = fill_id;
        sr[l] = kEot;
      }
      seen_eot |= sr[l] == kEot;
      if (first == L && sr[l] == kActive) first = l;
    }
    pf[b] = first;
  }
  return first_active;
}

bool with_cuda() {
#ifdef WITH_CUDA
  return true;
#else
  return false;
#endif
}

at::Tensor apply_commits_cuda(const at::Tensor& x, const at::Tensor& state, const at::Tensor& proposal,
                              const at::Tensor& commit, const at::Tensor& end_ids, int64_t fill_id,
                              bool stop_at_eot) {
#ifdef WITH_CUDA
  check_inputs(x, state, proposal, commit, end_ids);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t B = x.size(0), L = x.size(1), E = end_ids.size(0);
  at::Tensor first_active = at::empty({B}, x.options());
  if (B == 0) return first_active;
  C10_CUDA_CHECK(tracelock_apply_commits_launch(
      x.data_ptr<int64_t>(), state.data_ptr<uint8_t>(), proposal.data_ptr<int64_t>(), commit.data_ptr<bool>(),
      end_ids.data_ptr<int64_t>(), first_active.data_ptr<int64_t>(), B, L, E, fill_id, stop_at_eot,
      c10::cuda::getCurrentCUDAStream(x.get_device()).stream()));
  return first_active;
#else
  TORCH_CHECK(false,
              "tracelock._C was built without CUDA; rebuild with "
              "`TRACELOCK_BUILD_CUDA=1 pip install -e . --no-build-isolation`");
#endif
}

}  // namespace tracelock

TORCH_LIBRARY(tracelock, m) {
  m.def(
      "apply_commits(Tensor(a!) x, Tensor(b!) state, Tensor proposal, Tensor commit, Tensor end_ids, "
      "int fill_id, bool stop_at_eot) -> Tensor");
}

TORCH_LIBRARY_IMPL(tracelock, CPU, m) { m.impl("apply_commits", &tracelock::apply_commits_cpu); }

TORCH_LIBRARY_IMPL(tracelock, CUDA, m) { m.impl("apply_commits", &tracelock::apply_commits_cuda); }
