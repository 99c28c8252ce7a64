// Copyright (c) tracelock authors.
// The Python module tracelock._C. Loading it runs the TORCH_LIBRARY registrations of the other files, which
// expose the ops as torch.ops.tracelock.*; only build facts are bound here. Import torch first.
#include <pybind11/pybind11.h>

#include "apply_commits.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("with_cuda", &tracelock::with_cuda, "whether this build holds the CUDA kernels");
}
