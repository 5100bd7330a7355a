"""C++ kernels for the replay on CPU, built at first use with torch's cpp_extension.

On CPU, a tree walk written as tensor operations pays torch's per-operation overhead
(~3 us) for every level and step of every batch; these loops do the same walk over the
same tensors in one call (the approach TorchRL's C++ segment tree takes too). A replay
sample is one call (walk, leaves, importance weights, a row gather that prefetches a few
rows ahead, generations, the split into fields) and so is a priority update (checks,
generation test, leaves, ancestors level by level, running maximum): ~30 tensor operations
and their ~3 us each become two calls. CUDA tensors use the tensor-operation paths in
`sum_tree.py` and `replay.py`, which are the reference these kernels are tested against.
If the build fails (no compiler), the tensor paths are used everywhere.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading

log = logging.getLogger(__name__)

_SRC = r"""
#include <torch/extension.h>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

// levels[0] = leaves, levels[l+1][i] = sum of levels[l][i*F .. i*F+F-1]; all float64, contiguous.

// The walk for B prefix masses, written into node[B].
static void find_into(const std::vector<torch::Tensor>& levels, const double* mass, int64_t B, int64_t fanout,
                      int64_t* node) {
  // Level by level for the whole batch (not sample by sample): the B walks are independent,
  // so their cache misses overlap instead of forming one long dependent chain.
  std::vector<double> u(mass, mass + B);
  for (int64_t b = 0; b < B; ++b) node[b] = 0;
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
      // Branch-free: j = how many running sums of the children are <= the mass (the tensor
      // path's rule); the loop has no data-dependent exit, so walks of different b overlap.
      double acc = 0, below = 0;
      int64_t j = 0, last = -1;
      for (int64_t k = 0; k < n; ++k) {
        acc += c[k];
        const bool le = acc <= ub;
        j += le;
        below = le ? acc : below;
        last = c[k] > 0 ? k : last;
      }
      if (j == n) {  // rounding put the mass at the block's end: take its last non-empty child,
        j = last < 0 ? n - 1 : last;  // and the end of that child's range further down
        ub = std::numeric_limits<double>::infinity();
      } else {
        ub -= below;
      }
      u[b] = ub;
      node[b] = base + j;
    }
  }
}

torch::Tensor tree_find(std::vector<torch::Tensor> levels, torch::Tensor mass, int64_t fanout) {
  const int64_t B = mass.size(0);
  auto out = torch::empty({B}, torch::dtype(torch::kLong));
  find_into(levels, mass.data_ptr<double>(), B, fanout, out.data_ptr<int64_t>());
  return out;
}

// One replay sample in one call: the tree walk for B masses (uniform [B] in [0, 1) times
// total), the sampled leaves, their
// probabilities leaf/total, importance weights (size*p)^-beta over their maximum, the packed
// rows (each row prefetched a few rows ahead of its copy) and the slots' generations; the
// rows are handed back split into fields: split[f] = {first column, end column, dtype, *shape}.
// Returns (idx, p, w, fields, generations, count of sampled leaves <= 0).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, std::vector<torch::Tensor>, torch::Tensor, int64_t>
replay_sample(std::vector<torch::Tensor> levels, torch::Tensor uniform, int64_t fanout, double total, int64_t size,
              double beta, torch::Tensor packed, torch::Tensor generation, torch::Tensor meta,
              std::vector<std::vector<int64_t>> split) {
  TORCH_CHECK(packed.is_contiguous() && packed.scalar_type() == torch::kFloat && packed.dim() == 2,
              "replay_sample: packed storage must be a contiguous float32 matrix");
  const int64_t B = uniform.size(0), C = packed.size(1);
  auto idx = torch::empty({B}, torch::dtype(torch::kLong));
  int64_t* ix = idx.data_ptr<int64_t>();
  std::vector<double> mass(uniform.data_ptr<double>(), uniform.data_ptr<double>() + B);
  for (auto& m : mass) m *= total;
  find_into(levels, mass.data(), B, fanout, ix);
  const double* leaves = levels[0].data_ptr<double>();
  auto p = torch::empty({B}, torch::dtype(torch::kDouble));
  auto w = torch::empty({B}, torch::dtype(torch::kFloat));
  double* pp = p.data_ptr<double>();
  float* ww = w.data_ptr<float>();
  std::vector<double> wd(B);
  int64_t bad = 0;
  double wmax = 0;
  for (int64_t b = 0; b < B; ++b) {
    const double leaf = leaves[ix[b]];
    if (!(leaf > 0)) ++bad;
    pp[b] = leaf / total;
    wd[b] = std::pow((double)size * pp[b], -beta);
    if (b == 0 || wd[b] > wmax) wmax = wd[b];
  }
  for (int64_t b = 0; b < B; ++b) ww[b] = (float)(wd[b] / wmax);
  auto rows = torch::empty({B, C}, torch::dtype(torch::kFloat));
  auto gens = torch::empty({B}, torch::dtype(torch::kLong));
  const float* src = packed.data_ptr<float>();
  float* dst = rows.data_ptr<float>();
  const int64_t* gen = generation.data_ptr<int64_t>();
  int64_t* g = gens.data_ptr<int64_t>();
  const int64_t bytes = C * (int64_t)sizeof(float), ahead = 4;
  for (int64_t b = 0; b < B; ++b) {
    if (b + ahead < B) {
      const char* q = reinterpret_cast<const char*>(src + ix[b + ahead] * C);
      for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(q + off);
      __builtin_prefetch(gen + ix[b + ahead]);
    }
    std::memcpy(dst + b * C, src + ix[b] * C, bytes);
    g[b] = gen[ix[b]];
  }
  meta.data_ptr<int64_t>()[3] += B;
  std::vector<torch::Tensor> fields;
  fields.reserve(split.size());
  for (const auto& f : split) {
    std::vector<int64_t> shape{B}, strides(f.size() - 2);
    shape.insert(shape.end(), f.begin() + 3, f.end());
    const int64_t width = f[1] - f[0];
    strides.back() = 1;
    for (int64_t d = (int64_t)shape.size() - 2; d >= 1; --d) strides[d] = strides[d + 1] * shape[d + 1];
    strides[0] = C;
    const auto dt = static_cast<torch::ScalarType>(f[2]);
    if (dt == torch::kFloat) {  // a view of the gathered rows
      fields.push_back(rows.as_strided(shape, strides, f[0]));
      continue;
    }
    auto out = torch::empty(shape, torch::dtype(dt));  // exact: these dtypes sit in float32 unrounded
    auto cast = [&](auto* o) {
      using T = std::remove_pointer_t<decltype(o)>;
      for (int64_t b = 0; b < B; ++b)
        for (int64_t j = 0; j < width; ++j) o[b * width + j] = static_cast<T>(dst[b * C + f[0] + j]);
    };
    switch (dt) {
      case torch::kByte: cast(out.data_ptr<uint8_t>()); break;
      case torch::kChar: cast(out.data_ptr<int8_t>()); break;
      case torch::kShort: cast(out.data_ptr<int16_t>()); break;
      case torch::kBool: cast(out.data_ptr<bool>()); break;
      default: TORCH_CHECK(false, "replay_sample: packed field of unsupported dtype ", dt);
    }
    fields.push_back(out);
  }
  return {idx, p, w, fields, gens, bad};
}

// Recompute the ancestors of the changed leaves `node` level by level for the whole batch
// (a parent from its children, never patched by deltas), prefetching a few blocks ahead.
// A leaf given twice is recomputed twice: the sums stay exact. `node` is consumed.
static void refresh_ancestors(const std::vector<torch::Tensor>& levels, int64_t fanout, std::vector<int64_t>& node) {
  const int64_t A = (int64_t)node.size(), L = (int64_t)levels.size();
  for (int64_t l = 1; l < L; ++l) {
    const double* below = levels[l - 1].data_ptr<double>();
    double* above = levels[l].data_ptr<double>();
    for (int64_t a = 0; a < A; ++a) {
      if (a + 8 < A) __builtin_prefetch(below + (node[a + 8] / fanout) * fanout);
      const int64_t parent = node[a] / fanout;
      const double* c = below + parent * fanout;
      double s = 0;
      for (int64_t j = 0; j < fanout; ++j) s += c[j];
      above[parent] = s;
      node[a] = parent;
    }
  }
}

// Priority update in one call. Checks every index and priority before writing anything;
// returns (applied, status, position): status 1 = index out of range, 2 = priority not finite
// or negative (position = the first offender), 0 = done. Entries whose slot's generation
// differs from the sampled one (overwritten since) are skipped; the others' leaves become
// (p + eps)^alpha, their ancestors are recomputed level by level for the whole batch, and
// max_priority takes the largest applied priority.
std::tuple<int64_t, int64_t, int64_t> replay_update(std::vector<torch::Tensor> levels, int64_t fanout,
    torch::Tensor generation, torch::Tensor idx, torch::Tensor gens, torch::Tensor prio, double eps, double alpha,
    torch::Tensor max_p) {
  const int64_t M = idx.size(0), N = generation.size(0);
  const int64_t* ix = idx.data_ptr<int64_t>();
  const int64_t* sg = gens.data_ptr<int64_t>();
  std::vector<double> pr(M);
  if (prio.scalar_type() == torch::kFloat) {
    const float* f = prio.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m) pr[m] = f[m];
  } else {
    TORCH_CHECK(prio.scalar_type() == torch::kDouble, "replay_update: priorities must be float32 or float64");
    const double* d = prio.data_ptr<double>();
    for (int64_t m = 0; m < M; ++m) pr[m] = d[m];
  }
  for (int64_t m = 0; m < M; ++m)
    if (ix[m] < 0 || ix[m] >= N) return {0, 1, m};
  for (int64_t m = 0; m < M; ++m)
    if (!(pr[m] >= 0 && pr[m] < std::numeric_limits<double>::infinity())) return {0, 2, m};
  const int64_t* gen = generation.data_ptr<int64_t>();
  std::vector<int64_t> node;
  node.reserve(M);
  double* leaves = levels[0].data_ptr<double>();
  double mx = -1;
  for (int64_t m = 0; m < M; ++m) {
    if (m + 8 < M) { __builtin_prefetch(gen + ix[m + 8]); __builtin_prefetch(leaves + ix[m + 8], 1); }
    if (gen[ix[m]] != sg[m]) continue;
    leaves[ix[m]] = std::pow(pr[m] + eps, alpha);
    if (pr[m] > mx) mx = pr[m];
    node.push_back(ix[m]);
  }
  const int64_t A = (int64_t)node.size();
  refresh_ancestors(levels, fanout, node);
  if (A) {
    double* mp = max_p.data_ptr<double>();
    if (mx > *mp) *mp = mx;
  }
  return {A, 0, 0};
}

void tree_update(std::vector<torch::Tensor> levels, torch::Tensor idx, torch::Tensor values, int64_t fanout) {
  const int64_t M = idx.size(0);
  const int64_t* ix = idx.data_ptr<int64_t>();
  const double* v = values.data_ptr<double>();
  const int64_t n0 = levels[0].size(0);
  TORCH_CHECK(values.size(0) == M, "tree_update: ", M, " indices but ", values.size(0), " values");
  for (int64_t m = 0; m < M; ++m) TORCH_CHECK(ix[m] >= 0 && ix[m] < n0, "tree_update: leaf ", ix[m], " out of range");
  double* leaves = levels[0].data_ptr<double>();
  for (int64_t m = 0; m < M; ++m) leaves[ix[m]] = v[m];
  std::vector<int64_t> node(ix, ix + M);
  refresh_ancestors(levels, fanout, node);
}

// True if any of the n float32 values (as bits) is NaN or infinite: an exponent-bits test
// the compiler vectorises. Built for AVX-512, AVX2 and the baseline, the best picked at load
// (GCC's target_clones; the baseline x86-64 build would test 4 values per instruction and
// made this check a third of an insert).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
static bool any_nonfinite(const uint32_t* b, int64_t n) {
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) bad |= ((b[i] & 0x7f800000u) == 0x7f800000u);
  return bad != 0;
}

// n floats from src to dst with non-temporal stores on x86-64: the destination lines are
// written whole without being read first (a plain store into memory not in cache reads each
// line before writing it), and the rows do not evict the cache's working set. Elsewhere memcpy.
static void stream_copy(float* dst, const float* src, int64_t n) {
#if defined(__SSE2__)
  while (n > 0 && (reinterpret_cast<uintptr_t>(dst) & 15)) { *dst++ = *src++; --n; }
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm_stream_ps(dst + i, _mm_loadu_ps(src + i));
    _mm_stream_ps(dst + i + 4, _mm_loadu_ps(src + i + 4));
    _mm_stream_ps(dst + i + 8, _mm_loadu_ps(src + i + 8));
    _mm_stream_ps(dst + i + 12, _mm_loadu_ps(src + i + 12));
  }
  for (; i + 4 <= n; i += 4) _mm_stream_ps(dst + i, _mm_loadu_ps(src + i));
  for (; i < n; ++i) dst[i] = src[i];
#else
  std::memcpy(dst, src, n * sizeof(float));
#endif
}

// Insert: rows [first_row, first_row + keep) of the sources go to the ring slots next_slot,
// next_slot + 1, ... (mod capacity) of the packed float32 matrix, each source at its column
// offset (float32 copied, 8/16-bit ints and bool converted). Every row of every float32
// source is checked for NaN / inf before anything is written; returns (status, source, row):
// status 1 = not finite, nothing written; 0 = done. Rows are assembled a few at a time in a
// small buffer that stays in L1 cache, then streamed to the ring (consecutive slots are one
// contiguous run of memory, two where it wraps).
std::tuple<int64_t, int64_t, int64_t> replay_insert(torch::Tensor packed, std::vector<torch::Tensor> srcs,
    std::vector<int64_t> col0, int64_t first_row, int64_t keep, int64_t next_slot) {
  TORCH_CHECK(packed.is_contiguous() && packed.scalar_type() == torch::kFloat && packed.dim() == 2,
              "replay_insert: packed storage must be a contiguous float32 matrix");
  const int64_t N = packed.size(0), C = packed.size(1), F = (int64_t)srcs.size();
  TORCH_CHECK((int64_t)col0.size() == F, "replay_insert: one column offset per source");
  TORCH_CHECK(keep >= 0 && keep <= N && next_slot >= 0 && next_slot < N, "replay_insert: bad slot range");
  std::vector<int64_t> width(F);
  for (int64_t f = 0; f < F; ++f) {
    TORCH_CHECK(srcs[f].is_contiguous() && srcs[f].device().is_cpu(), "replay_insert: sources must be contiguous CPU");
    width[f] = srcs[f].dim() > 1 ? srcs[f].numel() / srcs[f].size(0) : 1;
    TORCH_CHECK(col0[f] >= 0 && col0[f] + width[f] <= C, "replay_insert: source ", f, " exceeds the row");
    TORCH_CHECK(srcs[f].size(0) >= first_row + keep, "replay_insert: source ", f, " has too few rows");
    const auto t = srcs[f].scalar_type();
    TORCH_CHECK(t == torch::kFloat || t == torch::kByte || t == torch::kChar || t == torch::kShort || t == torch::kBool,
                "replay_insert: unsupported dtype ", t);
  }
  for (int64_t f = 0; f < F; ++f) {
    if (srcs[f].scalar_type() != torch::kFloat) continue;
    const uint32_t* b = reinterpret_cast<const uint32_t*>(srcs[f].data_ptr<float>());  // every row, kept or not
    const int64_t n = (first_row + keep) * width[f];
    if (any_nonfinite(b, n)) {
      for (int64_t i = 0; i < n; ++i)
        if ((b[i] & 0x7f800000u) == 0x7f800000u) return {1, f, i / width[f]};
    }
  }
  float* dst = packed.data_ptr<float>();
  const int64_t R = std::max<int64_t>(1, (32 << 10) / (C * (int64_t)sizeof(float)));  // rows per 32 KiB
  std::vector<float> stage(R * C);
  for (int64_t r0 = 0; r0 < keep; r0 += R) {
    const int64_t nr = std::min(R, keep - r0);
    for (int64_t r = 0; r < nr; ++r) {
      float* row = stage.data() + r * C;
      const int64_t sr = first_row + r0 + r;
      for (int64_t f = 0; f < F; ++f) {
        const int64_t w = width[f];
        float* o = row + col0[f];
        switch (srcs[f].scalar_type()) {
          case torch::kFloat: std::memcpy(o, srcs[f].data_ptr<float>() + sr * w, w * sizeof(float)); break;
          case torch::kByte: { const uint8_t* i = srcs[f].data_ptr<uint8_t>() + sr * w; for (int64_t j = 0; j < w; ++j) o[j] = i[j]; break; }
          case torch::kChar: { const int8_t* i = srcs[f].data_ptr<int8_t>() + sr * w; for (int64_t j = 0; j < w; ++j) o[j] = i[j]; break; }
          case torch::kShort: { const int16_t* i = srcs[f].data_ptr<int16_t>() + sr * w; for (int64_t j = 0; j < w; ++j) o[j] = i[j]; break; }
          default: { const bool* i = srcs[f].data_ptr<bool>() + sr * w; for (int64_t j = 0; j < w; ++j) o[j] = i[j]; break; }
        }
      }
    }
    const int64_t slot = (next_slot + r0) % N;
    const int64_t first = std::min(nr, N - slot);
    stream_copy(dst + slot * C, stage.data(), first * C);
    if (first < nr) stream_copy(dst, stage.data() + first * C, (nr - first) * C);
  }
#if defined(__SSE2__)
  _mm_sfence();  // the streamed rows are visible before the caller publishes the new ring position
#endif
  return {0, 0, 0};
}

// The calls release the GIL (the learner samples from a prefetch thread while its main
// thread runs the update); they touch no Python objects.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("tree_find", &tree_find, py::call_guard<py::gil_scoped_release>(), "sum tree: leaf for each prefix mass");
  m.def("tree_update", &tree_update, py::call_guard<py::gil_scoped_release>(), "sum tree: set leaves and refresh ancestors");
  m.def("scalar_type", [](torch::Tensor t) { return (int64_t)t.scalar_type(); }, "c10::ScalarType code of a tensor");
  m.def("replay_sample", &replay_sample, py::call_guard<py::gil_scoped_release>(), "replay: walk, weights, row gather, generations");
  m.def("replay_insert", &replay_insert, py::call_guard<py::gil_scoped_release>(), "replay: checked one-pass row insert");
  m.def("replay_update", &replay_update, py::call_guard<py::gil_scoped_release>(), "replay: checked, generation-aware priority update");
}
"""

_lock = threading.Lock()
_module = None
_failed = False


# One build per source version and Python environment: torch keys its build cache by name,
# and two virtual environments sharing a home folder (a checkout and a CI clone) would
# otherwise rebuild it in turn at every first use (~35 s each).
_NAME = "apex_bdq_replay_v10_" + hashlib.sha1(sys.prefix.encode()).hexdigest()[:8]
STALE_LOCK_S = 300.0
"""A build lock older than this is a dead process's (the build takes well under a minute)."""


def _clear_stale_build_lock(name: str) -> None:
    """torch's JIT build takes a lock file in the build directory on every load, and a later
    load waits for it forever: a process killed while loading (`ray stop --force` during a
    worker's start-up) leaves every replay sample of every later run hanging. A lock older
    than STALE_LOCK_S is removed, with a warning."""
    import time
    try:
        from torch.utils.cpp_extension import _get_build_directory
        lock = os.path.join(_get_build_directory(name, verbose=False), "lock")
        age = time.time() - os.path.getmtime(lock)
    except (ImportError, OSError):
        return  # no lock (the usual case), or a torch without the helper
    if age > STALE_LOCK_S:
        log.warning("removing a stale torch extension build lock %s (%.0f s old: its process died)", lock, age)
        try:
            os.unlink(lock)
        except OSError:
            pass


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
                _clear_stale_build_lock(_NAME)
                _module = load_inline(name=_NAME, cpp_sources=[_SRC], extra_cflags=["-O3"], verbose=False)
            except Exception as e:  # no compiler, no ninja, ...: fall back to tensor ops
                log.warning("sum tree C++ kernels unavailable, using tensor operations on CPU: %s", e)
                _failed = True
    return _module
