"""C++ kernels for the sum tree on CPU, built at first use with torch's cpp_extension.

On CPU, a tree walk written as tensor operations pays torch's per-operation overhead
(~3 us) for every level and step of every batch; these loops do the same walk over the
same tensors in one call (the approach TorchRL's C++ segment tree takes too). CUDA tensors
use the tensor-operation path in `sum_tree.py`, which is also the reference these kernels
are tested against. If the build fails (no compiler), the tensor path is used everywhere.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)

_SRC = r"""
#include <torch/extension.h>
#include <limits>
#include <vector>

// levels[0] = leaves, levels[l+1][i] = sum of levels[l][i*F .. i*F+F-1]; all float64, contiguous.

torch::Tensor tree_find(std::vector<torch::Tensor> levels, torch::Tensor mass, int64_t fanout) {
  // Level by level for the whole batch (not sample by sample): the B walks are independent,
  // so their cache misses overlap instead of forming one long dependent chain.
  const int64_t B = mass.size(0);
  auto out = torch::zeros({B}, torch::dtype(torch::kLong));
  std::vector<double> u(mass.data_ptr<double>(), mass.data_ptr<double>() + B);
  int64_t* node = out.data_ptr<int64_t>();
  const int64_t L = (int64_t)levels.size();
  for (int64_t l = L - 1; l >= 0; --l) {
    const double* lv = levels[l].data_ptr<double>();
    const bool top = (l == L - 1);
    const int64_t n = top ? levels[l].size(0) : fanout;
    for (int64_t b = 0; b < B; ++b) {
      if (!top && b + 16 < B) {  // fetch a later walk's block while this one is scanned
        const char* p = reinterpret_cast<const char*>(lv + node[b + 16] * fanout);
        for (int64_t off = 0; off < fanout * 8; off += 64) __builtin_prefetch(p + off);
      }
      const int64_t base = top ? 0 : node[b] * fanout;
      const double* c = lv + base;
      double ub = u[b];
      int64_t j = 0, last = -1;
      for (; j < n; ++j) {
        if (c[j] > 0) last = j;
        if (ub < c[j]) break;
        ub -= c[j];
      }
      if (j == n) {  // rounding put the mass at the block's end: take its last non-empty child,
        j = last < 0 ? n - 1 : last;  // and the end of that child's range further down
        ub = std::numeric_limits<double>::infinity();
      }
      u[b] = ub;
      node[b] = base + j;
    }
  }
  return out;
}

void tree_update(std::vector<torch::Tensor> levels, torch::Tensor idx, torch::Tensor values, int64_t fanout) {
  const int64_t M = idx.size(0);
  const int64_t* ix = idx.data_ptr<int64_t>();
  const double* v = values.data_ptr<double>();
  const int64_t L = (int64_t)levels.size();
  std::vector<double*> lv(L);
  for (int64_t l = 0; l < L; ++l) lv[l] = levels[l].data_ptr<double>();
  const int64_t n0 = levels[0].size(0);
  TORCH_CHECK(values.size(0) == M, "tree_update: ", M, " indices but ", values.size(0), " values");
  for (int64_t m = 0; m < M; ++m) TORCH_CHECK(ix[m] >= 0 && ix[m] < n0, "tree_update: leaf ", ix[m], " out of range");
  for (int64_t m = 0; m < M; ++m) lv[0][ix[m]] = v[m];
  for (int64_t m = 0; m < M; ++m) {
    int64_t node = ix[m];
    for (int64_t l = 1; l < L; ++l) {
      node /= fanout;
      const double* c = lv[l - 1] + node * fanout;
      double s = 0;
      for (int64_t j = 0; j < fanout; ++j) s += c[j];
      lv[l][node] = s;
    }
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("tree_find", &tree_find, "sum tree: leaf for each prefix mass");
  m.def("tree_update", &tree_update, "sum tree: set leaves and refresh ancestors");
}
"""

_lock = threading.Lock()
_module = None
_failed = False


def kernels():
    """The compiled module, or None when it cannot be built (set APEX_BDQ_NO_CPP=1 to skip)."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    if os.environ.get("APEX_BDQ_NO_CPP") == "1":
        _failed = True
        return None
    with _lock:
        if _module is None and not _failed:
            try:
                from torch.utils.cpp_extension import load_inline
                _module = load_inline(name="apex_bdq_sumtree_v5", cpp_sources=[_SRC], extra_cflags=["-O3"],
                                      verbose=False)
            except Exception as e:  # no compiler, no ninja, ...: fall back to tensor ops
                log.warning("sum tree C++ kernels unavailable, using tensor operations on CPU: %s", e)
                _failed = True
    return _module
