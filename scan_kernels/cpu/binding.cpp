// Python entry points of the CPU backend: tensors in, a ScanProblem filled from their strides
// (no copies, both layouts), outputs allocated here, and the work items shared between the
// calling thread and helper threads (helper_pool.h), as many in all as torch.get_num_threads().
// Native callers in the process get the same run for a ScanProblem they fill themselves through
// the "scan_bridge.run_problem" capsule.
// The GIL is released while the kernel runs (released_gil.h, which says why tensors come by const
// reference). Arguments arrive validated by scan_kernels._args (a ScanProblem through the capsule, by
// its caller); the checks here cover ranks, dtypes and devices only (sizes are trusted, so a
// direct call with mismatched sizes reads out of bounds).
//
// Only the light ATen headers are included (not torch/extension.h), which keeps this file's
// compile short.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <vector>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>

#include "helper_pool.h"
#include "linear_kernel.h"
#include "model_step.h"
#include "released_gil.h"
#include "scan_backward.h"
#include "scan_kernel.h"
#include "ssd_kernel.h"

namespace py = pybind11;
using scan_bridge::DType;
using scan_bridge::ScanProblem;
using scan_bridge::Strided;

namespace {

// State-element updates each thread of a call gets at least (fewer: fewer threads). Unlike
// 2^16, 2^15 splits calls of 2^16 updates (an 8x512x16 step, a 1x64x64x16 scan) across two
// threads, which was faster or no slower (docs/performance.md, "kernel min work per thread").
// Smaller values were not compared.
constexpr int64_t kMinWorkPerThread = 1 << 15;
// State-element updates below which a call does not wake sleeping helpers (HelperPool::Wake):
// 128 rows of 512x16. A choice, not a measured break-even: the 32x512x16 step (2^18) is below,
// and woken for it was slower (docs/performance.md, "helper wake"); ExPhil's scan (about 2^24)
// is far above; sizes in between were not timed both ways.
constexpr int64_t kMinWorkToWake = 1 << 20;

DType dtype_of(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::f32;
    case at::kHalf: return DType::f16;
    case at::kBFloat16: return DType::bf16;
    case at::kDouble: return DType::f64;
    case at::kInt: return DType::i32;
    case at::kLong: return DType::i64;
    default: TORCH_CHECK(false, name, ": unsupported dtype ", t.scalar_type());
  }
}

// `t` seen with its axes in the given order; a -1 axis is a broadcast (stride 0) axis.
template <size_t K>
Strided strided(const at::Tensor& t, const char* name, const std::array<int, K>& axes) {
  TORCH_CHECK(t.device().is_cpu(), name, ": expected a CPU tensor, got one on ", t.device());
  Strided s;
  s.data = t.data_ptr();
  s.dtype = dtype_of(t, name);
  for (size_t i = 0; i < K; ++i) s.stride[i] = axes[i] < 0 ? 0 : t.stride(axes[i]);
  return s;
}

template <size_t K>
Strided strided(const std::optional<at::Tensor>& t, const char* name, const std::array<int, K>& axes) {
  return t.has_value() ? strided(*t, name, axes) : Strided{};
}

// The threads a call of `items` items of `per_item` state-element updates each runs on: the
// calling thread and as many helpers as have kMinWorkPerThread each to do, up to
// torch.get_num_threads() in all.
int64_t threads_for(int64_t items, int64_t per_item) {
  const int64_t min_items = (kMinWorkPerThread + per_item - 1) / per_item;
  return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items / min_items));
}

// Runs `work(queue, seat)` on `threads` threads, the items going through the queue in ranges of
// about 1/kRangesPerThread of a thread's share.
template <typename Work>
void run_on(int64_t threads, int64_t items, int64_t per_item, Work work) {
  constexpr int64_t kRangesPerThread = 8;
  scan_bridge::WorkQueue queue(items, std::max<int64_t>(1, items / (threads * kRangesPerThread)),
                               static_cast<int>(threads));
  const auto wake = items * per_item >= kMinWorkToWake ? scan_bridge::HelperPool::Wake::always
                                                       : scan_bridge::HelperPool::Wake::if_calls_close;
  scan_bridge::HelperPool::shared().run(static_cast<int>(threads - 1), [&](int seat) { work(queue, seat); }, wake);
}

void run(const ScanProblem& p) {
  const int64_t items = scan_bridge::work_items(p);
  const int64_t per_item = std::max<int64_t>(1, scan_bridge::work_per_item(p));
  run_on(threads_for(items, per_item), items, per_item,
         [&](scan_bridge::WorkQueue& queue, int seat) { scan_bridge::run_items(p, queue, seat); });
}

// What both entry points fill alike: the sizes and the operands x, dt, z (read as batch,
// time, channel through `btd`), B, C (batch, time, group, state through `btgn`), A, D,
// dt_bias, and the dt options. A -1 time axis is a broadcast axis of length 1.
ScanProblem problem_from(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A,
                         const at::Tensor& B, const at::Tensor& C, const std::optional<at::Tensor>& D,
                         const std::optional<at::Tensor>& z, const std::optional<at::Tensor>& dt_bias,
                         bool dt_softplus, std::optional<double> dt_min, std::optional<double> dt_max,
                         const std::array<int, 3>& btd, const std::array<int, 4>& btgn) {
  ScanProblem p;
  p.batch = x.size(0);
  p.seq = btd[1] < 0 ? 1 : x.size(btd[1]);
  p.dim = x.size(btd[2]);
  p.state = A.size(1);
  p.groups = B.size(btgn[2]);
  p.x = strided(x, "x", btd);
  p.dt = strided(dt, "dt", btd);
  p.z = strided(z, "z", btd);
  p.B = strided(B, "B", btgn);
  p.C = strided(C, "C", btgn);
  p.A = strided(A, "A", std::array<int, 2>{0, 1});
  p.D = strided(D, "D", std::array<int, 1>{0});
  p.dt_bias = strided(dt_bias, "dt_bias", std::array<int, 1>{0});
  p.dt_softplus = dt_softplus;
  p.has_dt_min = dt_min.has_value();
  p.has_dt_max = dt_max.has_value();
  p.dt_min = dt_min.value_or(0.0);
  p.dt_max = dt_max.value_or(0.0);
  p.compute_f64 = x.scalar_type() == at::kDouble;
  return p;
}

// The boundaries of sequences packed along `seq` time steps of one batch row, checked here
// too (scan_kernels._args checks them for callers; the kernels index with them unchecked): an int64
// CPU tensor [n + 1] rising strictly from 0 to seq. Null when absent.
const int64_t* packed_bounds(const std::optional<at::Tensor>& cu_seqlens, int64_t batch, int64_t seq,
                             const char* op) {
  if (!cu_seqlens.has_value()) return nullptr;
  const at::Tensor& cu = *cu_seqlens;
  const std::string what = std::string(op) + " cu_seqlens: ";
  if (cu.scalar_type() != at::kLong || cu.device().type() != at::kCPU || !cu.is_contiguous() || cu.dim() != 1 ||
      cu.size(0) < 2)
    throw std::invalid_argument(what + "expected a contiguous 1-D CPU int64 tensor of n + 1 >= 2 boundaries");
  if (batch != 1) throw std::invalid_argument(what + "expected batch 1, got " + std::to_string(batch));
  const int64_t* bounds = cu.data_ptr<int64_t>();
  const int64_t n = cu.size(0) - 1;
  bool rising = bounds[0] == 0 && bounds[n] == seq;
  for (int64_t i = 0; rising && i < n; ++i) rising = bounds[i] < bounds[i + 1];
  if (!rising) throw std::invalid_argument(what + "expected boundaries rising strictly from 0 to " + std::to_string(seq));
  return bounds;
}

std::tuple<at::Tensor, std::optional<at::Tensor>> scan(
    const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
    const at::Tensor& C, const std::optional<at::Tensor>& D, const std::optional<at::Tensor>& z,
    const std::optional<at::Tensor>& dt_bias, bool dt_softplus, std::optional<double> dt_min,
    std::optional<double> dt_max, const std::optional<at::Tensor>& h0, bool return_state,
    const std::string& layout, const std::optional<at::Tensor>& cu_seqlens) {
  TORCH_CHECK(layout == "bld" || layout == "bdl", "layout: expected \"bld\" or \"bdl\", got ", layout);
  TORCH_CHECK(x.dim() == 3 && B.dim() == 4 && C.dim() == 4 && A.dim() == 2,
              "scan: expected x 3-D, B and C 4-D (with a groups axis), A 2-D");
  const bool bdl = layout == "bdl";
  // Everything is read as (batch, time, channel) and (batch, time, group, state).
  const std::array<int, 3> btd = bdl ? std::array<int, 3>{0, 2, 1} : std::array<int, 3>{0, 1, 2};
  const std::array<int, 4> btgn = bdl ? std::array<int, 4>{0, 3, 1, 2} : std::array<int, 4>{0, 1, 2, 3};

  ScanProblem p = problem_from(x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_min, dt_max, btd, btgn);
  p.h0 = strided(h0, "h0", std::array<int, 3>{0, 1, 2});
  if (const int64_t* bounds = packed_bounds(cu_seqlens, p.batch, p.seq, "scan")) {
    // One sequence of one step is a plain step (step mode); more are batch rows of their own.
    p.batch = cu_seqlens->size(0) - 1;
    if (p.seq > 1) p.cu_seqlens = bounds;
  }

  at::Tensor y = at::empty(x.sizes(), x.options());
  p.y = strided(y, "y", btd);
  std::optional<at::Tensor> state;
  if (return_state) {
    state = at::empty({p.batch, p.dim, p.state}, x.options().dtype(p.compute_f64 ? at::kDouble : at::kFloat));
    p.state_out = strided(*state, "state", std::array<int, 3>{0, 1, 2});
  }
  run(p);
  return {y, state};
}

at::Tensor state_update(const at::Tensor& state, const at::Tensor& x, const at::Tensor& dt,
                        const at::Tensor& A, const at::Tensor& B, const at::Tensor& C,
                        const std::optional<at::Tensor>& D, const std::optional<at::Tensor>& z,
                        const std::optional<at::Tensor>& dt_bias, bool dt_softplus,
                        std::optional<double> dt_min, std::optional<double> dt_max,
                        const std::optional<at::Tensor>& slots) {
  TORCH_CHECK(state.dim() == 3 && x.dim() == 2 && B.dim() == 3 && C.dim() == 3 && A.dim() == 2,
              "state_update: expected state 3-D, x 2-D, B and C 3-D (with a groups axis), A 2-D");
  // One timestep: the time axis is a broadcast axis of length 1.
  const std::array<int, 3> btd{0, -1, 1};
  const std::array<int, 4> btgn{0, -1, 1, 2};

  ScanProblem p = problem_from(x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_min, dt_max, btd, btgn);
  p.slots = strided(slots, "slots", std::array<int, 1>{0});
  // Read and written in place: each item loads its state slice whole before storing it.
  p.h0 = strided(state, "state", std::array<int, 3>{0, 1, 2});
  p.state_out = p.h0;

  at::Tensor y = at::empty(x.sizes(), x.options());
  p.y = strided(y, "y", btd);
  run(p);
  return y;
}

// `run()` behind a C signature, for callers in this process that fill a problem struct
// themselves: `problem_size` is the struct's size as the caller was compiled (`expected` as
// this module was), so that a caller built against another header is refused instead of
// misread. 0 on success, else the error's message is in `error`.
template <typename Run>
int call_from_c(const char* problem, const char* header, size_t problem_size, size_t expected, Run run,
                char* error, size_t error_size) {
  try {
    if (problem_size != expected)
      throw std::invalid_argument(std::string(problem) + " size " + std::to_string(problem_size) + ", expected " +
                                  std::to_string(expected) + " (built against another " + header + ")");
    run();
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(error, error_size, "%s", e.what());
    return 1;
  } catch (...) {  // nothing may unwind through the C signature into another module
    std::snprintf(error, error_size, "the kernel raised something other than a std::exception");
    return 1;
  }
}

// A native caller's problem sizes: rows >= 0, every other size >= 1, `grouped` split evenly
// into `groups` (a zero there was a division by zero, which no exception reports).
void require_sizes(const char* problem, int64_t rows, std::initializer_list<int64_t> sizes, int64_t grouped,
                   int64_t groups) {
  bool ok = rows >= 0;
  for (int64_t size : sizes) ok = ok && size >= 1;
  if (!ok || grouped % groups != 0)
    throw std::invalid_argument(std::string(problem) + ": expected rows >= 0, every other size >= 1 and the " +
                                "groups dividing their axis");
}

// The kernel run on a ScanProblem filled elsewhere in this process -- the bridge's native step
// path (bridge/native/step.cpp), which points it at operands where they lie in a request
// frame -- exported as the capsule "scan_bridge.run_problem".
int run_problem(const ScanProblem* p, size_t problem_size, char* error, size_t error_size) {
  return call_from_c("ScanProblem", "scan_kernel.h", problem_size, sizeof(ScanProblem),
                     [&] {
                       require_sizes("ScanProblem", p->batch, {p->seq, p->dim, p->state, p->groups}, p->dim,
                                     p->groups);
                       // slots past a step are this module's own (a model's prefill, checked there)
                       if (p->seq != 1 && p->slots.data != nullptr)
                         throw std::invalid_argument("ScanProblem: slots are for a step (seq 1)");
                       run(*p);
                     },
                     error, error_size);
}

}  // namespace

// --- Mamba-2 (SSD) --------------------------------------------------------------------------
// scan_kernels/cpu/__init__.py hands contiguous tensors of one compute dtype (D as [heads, headdim]);
// what is checked here is that contract, not the user's input.

void require_operand(const at::Tensor& t, const char* name, at::ScalarType dtype, const char* op = "ssd") {
  if (!t.is_contiguous() || t.scalar_type() != dtype || t.device().type() != at::kCPU)
    throw std::invalid_argument(std::string(op) + " " + name + ": expected a contiguous CPU tensor of " +
                                std::string(c10::toString(dtype)) + ", got " + std::string(c10::toString(t.scalar_type())) +
                                (t.is_contiguous() ? "" : " (not contiguous)"));
}

template <typename T>
const T* data_of(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<T>() : nullptr;
}

// The operands and options the SSD kernels apply around their recurrence.
struct SsdExtras {
  const std::optional<at::Tensor>& D;
  const std::optional<at::Tensor>& z;
  const std::optional<at::Tensor>& dt_bias;
  bool dt_softplus;
  std::optional<double> dt_min, dt_max;

  void require(at::ScalarType dtype) const {
    for (auto [t, name] : {std::pair<const std::optional<at::Tensor>*, const char*>{&D, "D"}, {&z, "z"}, {&dt_bias, "dt_bias"}})
      if (t->has_value()) require_operand(**t, name, dtype);
  }
  template <typename T>
  scan_bridge::SsdOptions<T> options() const {
    scan_bridge::SsdOptions<T> o;
    o.dt_bias = data_of<T>(dt_bias);
    o.dt_softplus = dt_softplus;
    o.has_dt_min = dt_min.has_value();
    o.has_dt_max = dt_max.has_value();
    o.dt_min = static_cast<T>(dt_min.value_or(0.0));
    o.dt_max = static_cast<T>(dt_max.value_or(0.0));
    o.D = data_of<T>(D);
    o.z = data_of<T>(z);
    return o;
  }
};

// Items are whole recurrences (over a sequence, or one step of a head) of `per_item`
// state-element updates each, run as the Mamba-1 kernels' are (run_on): the same threads and
// wake policy, and ranges from per-seat spans, so that a step's thread meets the same pool rows
// call after call and they stay in its core's L2; taken one at a time from one shared counter,
// the rows moved between the cores on every step and two threads were slower than one.
template <typename Problem, typename Run>
void run_ssd_items(const Problem& p, int64_t items, int64_t per_item, Run run_items) {
  run_on(threads_for(items, per_item), items, per_item, [&](scan_bridge::WorkQueue& queue, int seat) {
    for (int64_t begin, end; queue.take(seat, &begin, &end);) run_items(p, begin, end);
  });
}

template <typename T>
void ssd_scan_typed(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
                    const at::Tensor& C, const SsdExtras& extras, const std::optional<at::Tensor>& h0,
                    const at::Tensor& y, const std::optional<at::Tensor>& state_out,
                    const std::optional<at::Tensor>& cu_seqlens) {
  scan_bridge::SsdScanProblem<T> p;
  p.batch = x.size(0);
  p.seq = x.size(1);
  if (const int64_t* bounds = packed_bounds(cu_seqlens, p.batch, p.seq, "ssd_scan")) {
    p.batch = cu_seqlens->size(0) - 1;
    p.cu_seqlens = bounds;
  }
  p.heads = x.size(2);
  p.headdim = x.size(3);
  p.state = B.size(3);
  p.groups = B.size(2);
  p.x = x.data_ptr<T>();
  p.dt = dt.data_ptr<T>();
  p.A = A.data_ptr<T>();
  p.B = B.data_ptr<T>();
  p.C = C.data_ptr<T>();
  p.h0 = data_of<T>(h0);
  p.options = extras.options<T>();
  p.y = y.data_ptr<T>();
  p.state_out = state_out.has_value() ? state_out->data_ptr<T>() : nullptr;
  const int64_t items = scan_bridge::ssd_scan_item_count(p);
  // x's rows, one whatever the sequences packed in it
  run_ssd_items(p, items, x.size(0) * p.seq * p.heads * p.headdim * p.state / items, scan_bridge::ssd_scan_items<T>);
}

void ssd_scan(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
              const at::Tensor& C, const std::optional<at::Tensor>& D, const std::optional<at::Tensor>& z,
              const std::optional<at::Tensor>& dt_bias, bool dt_softplus, std::optional<double> dt_min,
              std::optional<double> dt_max, const std::optional<at::Tensor>& h0, const at::Tensor& y,
              const std::optional<at::Tensor>& state_out, const std::optional<at::Tensor>& cu_seqlens) {
  const auto dtype = x.scalar_type();
  if (dtype != at::kFloat && dtype != at::kDouble) throw std::invalid_argument("ssd x: expected float32 or float64");
  for (auto [t, name] : {std::pair<const at::Tensor*, const char*>{&x, "x"}, {&dt, "dt"}, {&A, "A"}, {&B, "B"}, {&C, "C"}, {&y, "y"}})
    require_operand(*t, name, dtype);
  const SsdExtras extras{D, z, dt_bias, dt_softplus, dt_min, dt_max};
  extras.require(dtype);
  if (h0.has_value()) require_operand(*h0, "h0", dtype);
  if (state_out.has_value()) require_operand(*state_out, "state", dtype);
  if (dtype == at::kFloat) ssd_scan_typed<float>(x, dt, A, B, C, extras, h0, y, state_out, cu_seqlens);
  else ssd_scan_typed<double>(x, dt, A, B, C, extras, h0, y, state_out, cu_seqlens);
}

// Items are (batch row, head) pairs of headdim x state updates each.
template <typename T>
void run_ssd_update_problem(const scan_bridge::SsdUpdateProblem<T>& p) {
  run_ssd_items(p, p.batch * p.heads, p.headdim * p.state, scan_bridge::ssd_update_items<T>);
}

// The Mamba-2 steps of the bridge's native step path, exported as the capsule
// "scan_bridge.run_ssd_update" (ssd_kernel.h).
int run_ssd_update(const scan_bridge::SsdUpdateProblem<float>* p, size_t problem_size, char* error,
                   size_t error_size) {
  return call_from_c("SsdUpdateProblem", "ssd_kernel.h", problem_size, sizeof(*p),
                     [&] {
                       require_sizes("SsdUpdateProblem", p->batch, {p->heads, p->headdim, p->state, p->groups},
                                     p->heads, p->groups);
                       run_ssd_update_problem(*p);
                     },
                     error, error_size);
}

template <typename T>
void ssd_update_typed(const at::Tensor& pool, const at::Tensor& rows, const at::Tensor& x, const at::Tensor& dt,
                      const at::Tensor& A, const at::Tensor& B, const at::Tensor& C, const SsdExtras& extras,
                      const at::Tensor& y) {
  scan_bridge::SsdUpdateProblem<T> p;
  p.batch = x.size(0);
  p.heads = x.size(1);
  p.headdim = x.size(2);
  p.state = B.size(2);
  p.groups = B.size(1);
  p.pool = pool.data_ptr<T>();
  p.pool_row_stride = pool.stride(0);
  p.rows = rows.data_ptr<int64_t>();
  p.x = x.data_ptr<T>();
  p.dt = dt.data_ptr<T>();
  p.A = A.data_ptr<T>();
  p.B = B.data_ptr<T>();
  p.C = C.data_ptr<T>();
  p.options = extras.options<T>();
  p.y = y.data_ptr<T>();
  run_ssd_update_problem(p);
}

void ssd_state_update(const at::Tensor& pool, const at::Tensor& rows, const at::Tensor& x, const at::Tensor& dt,
                      const at::Tensor& A, const at::Tensor& B, const at::Tensor& C,
                      const std::optional<at::Tensor>& D, const std::optional<at::Tensor>& z,
                      const std::optional<at::Tensor>& dt_bias, bool dt_softplus, std::optional<double> dt_min,
                      std::optional<double> dt_max, const at::Tensor& y) {
  const auto dtype = x.scalar_type();
  if (dtype != at::kFloat && dtype != at::kDouble) throw std::invalid_argument("ssd x: expected float32 or float64");
  for (auto [t, name] : {std::pair<const at::Tensor*, const char*>{&x, "x"}, {&dt, "dt"}, {&A, "A"}, {&B, "B"}, {&C, "C"}, {&y, "y"}})
    require_operand(*t, name, dtype);
  const SsdExtras extras{D, z, dt_bias, dt_softplus, dt_min, dt_max};
  extras.require(dtype);
  // The pool's rows may lie apart (parts of a model's state between them); each row is contiguous.
  require_operand(pool.size(0) ? pool.select(0, 0) : pool, "state", dtype);
  require_operand(rows, "rows", at::kLong);
  if (dtype == at::kFloat) ssd_update_typed<float>(pool, rows, x, dt, A, B, C, extras, y);
  else ssd_update_typed<double>(pool, rows, x, dt, A, B, C, extras, y);
}

// --- The scan's backward pass -----------------------------------------------------------------
// scan_kernels/cpu/__init__.py hands contiguous [batch, seq, channel] tensors of one compute dtype
// ("bld"; Mamba-2's heads x headdim as channels, with scalar_decay, and dt, dt_bias, A per head:
// channels_per_dt = headdim). Items are shared out as the forward's are; each thread sums into
// its own seat's slice of dA, dD, ddt_bias, dB and dC, and the slices are added here, with dA
// and ddt_bias summed over each dt column's channels. These sums are plain loops, not torch
// ops: those would run on torch's OpenMP team, whose threads then spin on the cores the next
// call's helpers need.

struct BackwardOptions {
  bool dt_softplus, scalar_decay;
  int64_t channels_per_dt;
  std::optional<double> dt_min, dt_max;
};

// out[r, d / per, k] = the sum over seats s < threads and channels d of
// seats[s, r, d, k], for k < kept of the `width` stored: per-channel accumulators summed over the
// threads and over each dt column's `per` channels.
template <typename T>
void sum_into_columns(const T* seats, int64_t threads, int64_t rows, int64_t dim, int64_t width, int64_t kept,
                      int64_t per, T* out) {
  if (per == 1 && kept == width) {
    // dB, dC, dD: the seats' slices summed elementwise, in a flat loop the compiler vectorizes
    // (the general nest below costs more than the sums at their sizes).
    const int64_t n = rows * dim * width;
    std::copy(seats, seats + n, out);
    for (int64_t seat = 1; seat < threads; ++seat)
      for (int64_t i = 0; i < n; ++i) out[i] += seats[seat * n + i];
    return;
  }
  const int64_t columns = dim / per;
  std::fill(out, out + rows * columns * kept, T{0});
  for (int64_t seat = 0; seat < threads; ++seat)
    for (int64_t r = 0; r < rows; ++r) {
      const T* in = seats + (seat * rows + r) * dim * width;
      T* row = out + r * columns * kept;
      for (int64_t c = 0; c < columns; ++c)
        for (int64_t d = c * per; d < (c + 1) * per; ++d)
          for (int64_t k = 0; k < kept; ++k) row[c * kept + k] += in[d * width + k];
    }
}

template <typename T>
std::vector<at::Tensor> scan_backward_typed(
    const at::Tensor& x, const at::Tensor& dt, const std::optional<at::Tensor>& z, const at::Tensor& dy,
    const at::Tensor& A, const at::Tensor& B, const at::Tensor& C, const std::optional<at::Tensor>& D,
    const std::optional<at::Tensor>& dt_bias, const std::optional<at::Tensor>& h0,
    const std::optional<at::Tensor>& dstate, const BackwardOptions& o, const at::Tensor& dx, const at::Tensor& ddt,
    const std::optional<at::Tensor>& dz, const std::optional<at::Tensor>& dh0,
    const std::optional<at::Tensor>& cu_seqlens) {
  scan_bridge::ScanBackwardProblem<T> p;
  p.batch = x.size(0);
  p.seq = x.size(1);
  // The operands' [row, time] positions: batch x seq, or one row of packed sequences.
  const int64_t positions = p.batch * p.seq;
  if (const int64_t* bounds = packed_bounds(cu_seqlens, p.batch, p.seq, "scan_backward")) {
    p.batch = cu_seqlens->size(0) - 1;
    p.cu_seqlens = bounds;
  }
  p.dim = x.size(2);
  p.state = B.size(3);
  p.groups = B.size(2);
  p.scalar_decay = o.scalar_decay;
  p.channels_per_dt = o.channels_per_dt;
  p.x = x.data_ptr<T>();
  p.dt = dt.data_ptr<T>();
  p.z = data_of<T>(z);
  p.dy = dy.data_ptr<T>();
  p.A = A.data_ptr<T>();
  p.B = B.data_ptr<T>();
  p.C = C.data_ptr<T>();
  p.D = data_of<T>(D);
  p.dt_bias = data_of<T>(dt_bias);
  p.dt_softplus = o.dt_softplus;
  p.has_dt_min = o.dt_min.has_value();
  p.has_dt_max = o.dt_max.has_value();
  p.dt_min = o.dt_min.value_or(0.0);
  p.dt_max = o.dt_max.value_or(0.0);
  p.h0 = data_of<T>(h0);
  p.dstate = data_of<T>(dstate);
  p.dx = dx.data_ptr<T>();
  p.ddt = ddt.data_ptr<T>();
  p.dz = dz.has_value() ? dz->data_ptr<T>() : nullptr;
  p.dh0 = dh0.has_value() ? dh0->data_ptr<T>() : nullptr;

  const bool ssd = p.scalar_decay;
  const int64_t items = ssd ? scan_bridge::ssd_backward_items(p) : scan_bridge::scan_backward_items(p);
  const int64_t per_item = std::max<int64_t>(
      1, ssd ? scan_bridge::ssd_backward_work_per_item(p) : scan_bridge::scan_backward_work_per_item(p));
  const int64_t threads = threads_for(items, per_item);
  const int64_t bc = positions * p.groups * p.state;
  std::vector<T> seats(threads * (p.dim * p.state + 2 * p.dim + 2 * bc), T{0});
  p.dA = seats.data();
  p.dD = p.dA + threads * p.dim * p.state;
  p.ddt_bias = p.dD + threads * p.dim;
  p.dB = p.ddt_bias + threads * p.dim;
  p.dC = p.dB + threads * bc;
  run_on(threads, items, per_item,
         [&](scan_bridge::WorkQueue& queue, int seat) {
           if (ssd) scan_bridge::ssd_backward_run(p, queue, seat);
           else scan_bridge::scan_backward_run(p, queue, seat);
         });
  const int64_t per = o.channels_per_dt, columns = p.dim / per, kept = p.scalar_decay ? 1 : p.state;
  const auto options = x.options();
  at::Tensor dA = p.scalar_decay ? at::empty({columns}, options) : at::empty({columns, p.state}, options);
  at::Tensor dD = at::empty({p.dim}, options), dbias = at::empty({columns}, options);
  at::Tensor dB = at::empty(B.sizes(), options);
  at::Tensor dC = at::empty(C.sizes(), options);
  sum_into_columns(p.dA, threads, 1, p.dim, p.state, kept, per, dA.data_ptr<T>());
  sum_into_columns(p.dD, threads, 1, p.dim, 1, 1, 1, dD.data_ptr<T>());
  sum_into_columns(p.ddt_bias, threads, 1, p.dim, 1, 1, per, dbias.data_ptr<T>());
  sum_into_columns(p.dB, threads, 1, bc, 1, 1, 1, dB.data_ptr<T>());
  sum_into_columns(p.dC, threads, 1, bc, 1, 1, 1, dC.data_ptr<T>());
  return {dA, dD, dbias, dB, dC};
}

// -> [dA, dD, ddt_bias, dB, dC]; dx, ddt, dz, dh0 are written where they are given. dt, dt_bias
// and A have a column per `channels_per_dt` channels, and so do ddt, dA and ddt_bias. With
// cu_seqlens, batch-1 operands hold packed sequences, and h0, dstate, dh0 a row for each.
std::vector<at::Tensor> scan_backward(
    const at::Tensor& x, const at::Tensor& dt, const std::optional<at::Tensor>& z, const at::Tensor& dy,
    const at::Tensor& A, const at::Tensor& B, const at::Tensor& C, const std::optional<at::Tensor>& D,
    const std::optional<at::Tensor>& dt_bias, bool dt_softplus, std::optional<double> dt_min,
    std::optional<double> dt_max, const std::optional<at::Tensor>& h0, const std::optional<at::Tensor>& dstate,
    bool scalar_decay, int64_t channels_per_dt, const at::Tensor& dx, const at::Tensor& ddt,
    const std::optional<at::Tensor>& dz,
    const std::optional<at::Tensor>& dh0, const std::optional<at::Tensor>& cu_seqlens) {
  const auto dtype = x.scalar_type();
  if (dtype != at::kFloat && dtype != at::kDouble)
    throw std::invalid_argument("scan_backward x: expected float32 or float64");
  if (x.dim() != 3 || B.dim() != 4 || C.dim() != 4 || A.dim() != (scalar_decay ? 1 : 2))
    throw std::invalid_argument("scan_backward: expected x 3-D, B and C 4-D, A 2-D (1-D with scalar_decay)");
  if (channels_per_dt < 1 || x.size(2) % channels_per_dt != 0)
    throw std::invalid_argument("scan_backward: expected channels_per_dt to divide x's " +
                                std::to_string(x.size(2)) + " channels, got " + std::to_string(channels_per_dt));
  // The Mamba-1 runner reads dt, dt_bias and A per channel.
  if (!scalar_decay && channels_per_dt != 1)
    throw std::invalid_argument("scan_backward: expected channels_per_dt 1 without scalar_decay, got " +
                                std::to_string(channels_per_dt));
  if (z.has_value() != dz.has_value()) throw std::invalid_argument("scan_backward: dz is given exactly with z");
  for (auto [t, name] : {std::pair<const at::Tensor*, const char*>{&x, "x"}, {&dt, "dt"}, {&dy, "dy"},
                         {&A, "A"}, {&B, "B"}, {&C, "C"}, {&dx, "dx"}, {&ddt, "ddt"}})
    require_operand(*t, name, dtype, "scan_backward");
  for (auto [t, name] : {std::pair<const std::optional<at::Tensor>*, const char*>{&z, "z"}, {&D, "D"},
                         {&dt_bias, "dt_bias"}, {&h0, "h0"}, {&dstate, "dstate"}, {&dz, "dz"}, {&dh0, "dh0"}})
    if (t->has_value()) require_operand(**t, name, dtype, "scan_backward");
  const BackwardOptions o{dt_softplus, scalar_decay, channels_per_dt, dt_min, dt_max};
  if (dtype == at::kFloat)
    return scan_backward_typed<float>(x, dt, z, dy, A, B, C, D, dt_bias, h0, dstate, o, dx, ddt, dz, dh0, cu_seqlens);
  return scan_backward_typed<double>(x, dt, z, dy, A, B, C, D, dt_bias, h0, dstate, o, dx, ddt, dz, dh0, cu_seqlens);
}

// --- A whole model's step -------------------------------------------------------------------
// One frame through a stack of Mamba or Mamba-2 blocks (bridge/models/runtime.py is the same
// math in torch, and the reference it is tested against): the norms, the conv window, SiLU,
// dt's softplus, Mamba-2's skip and gated norm and the residuals as plain loops, the matrix
// products by `linear` (linear_kernel.h), the state updates as the kernels above. A step of a
// small model is dozens of torch ops a layer, each costing more than its arithmetic
// (docs/performance.md, "model step"); here they are a few. Activations and state fp32, the
// matrices fp32 or bfloat16 (a model loaded in bf16); the state is updated in the pool.

// One layer's tensors, in this order (None where the model has none): its weights, then (for
// `model_step`) its state.
enum LayerTensor {
  kNorm, kInProj, kInProjBias, kConv, kConvBias, kA, kD, kDtBias, kOutProj, kOutProjBias,
  kXProj, kDtProj, kGateNorm, kLayerWeights, kConvState = kLayerWeights, kSsmState, kLayerTensors
};

using LayerList = std::vector<std::vector<std::optional<at::Tensor>>>;

// A model's weights and sizes as its step reads them, checked once.
struct FusedModel {
  LayerList layers;  // each its kLayerWeights weights
  at::Tensor norm_f;
  std::optional<at::Tensor> embeddings, lm_head;  // [vocab, d], fp32 or bf16, where the model has them
  bool mamba2;
  int64_t d, di, n, rank, heads, headdim, groups;
  double eps;
  std::optional<double> dt_min, dt_max;

  // `layers`: each with its weights first (what follows them is not kept).
  // dims: arch (0 Mamba-1, 1 Mamba-2), d_inner, d_state, dt_rank, heads, headdim, groups.
  FusedModel(const LayerList& all, const at::Tensor& norm, const std::vector<int64_t>& dims, double eps_,
             std::optional<double> min, std::optional<double> max,
             const std::optional<at::Tensor>& embedding = std::nullopt,
             const std::optional<at::Tensor>& head = std::nullopt)
      : norm_f(norm), embeddings(embedding), lm_head(head), eps(eps_), dt_min(min), dt_max(max) {
    if (dims.size() != 7) throw std::invalid_argument("model_step: expected 7 dims");
    if (dims[0] != 0 && dims[0] != 1)
      throw std::invalid_argument("model_step: dims[0]: expected 0 (Mamba-1) or 1 (Mamba-2), got " +
                                  std::to_string(dims[0]));
    mamba2 = dims[0] == 1;
    di = dims[1], n = dims[2], rank = dims[3], heads = dims[4], headdim = dims[5], groups = dims[6];
    check_dims();
    require_operand(norm_f, "norm_f", at::kFloat, "model_step");
    d = norm_f.numel();
    for (const auto* t : {&embeddings, &lm_head}) {
      if (!t->has_value()) continue;
      const auto& w = **t;
      require_operand(w, t == &embeddings ? "embeddings" : "lm_head",
                      w.scalar_type() == at::kBFloat16 ? at::kBFloat16 : at::kFloat, "model_step");
      if (w.dim() != 2 || w.size(1) != d)
        throw std::invalid_argument("model_step: expected [vocab, " + std::to_string(d) + "] embeddings and head");
    }
    const std::vector<LayerTensor> needed =
        mamba2 ? std::vector<LayerTensor>{kNorm, kInProj, kConv, kA, kD, kDtBias, kOutProj, kGateNorm}
               : std::vector<LayerTensor>{kNorm, kInProj, kConv, kA, kD, kDtBias, kOutProj, kXProj, kDtProj};
    for (const auto& layer : all) {
      if (layer.size() < kLayerWeights)
        throw std::invalid_argument("model_step: expected " + std::to_string(int(kLayerWeights)) +
                                    " weights a layer, got " + std::to_string(layer.size()));
      for (LayerTensor i : needed)
        if (!layer[i].has_value())
          throw std::invalid_argument("model_step: layer tensor " + std::to_string(int(i)) + " missing");
      layers.emplace_back(layer.begin(), layer.begin() + kLayerWeights);
      check_layer(layers.size() - 1);
    }
  }

  const at::Tensor& weight(size_t layer, LayerTensor i) const { return *layers[layer][i]; }

  // The conv's channels: Mamba-1's x, Mamba-2's x | B | C.
  int64_t conv_channels() const { return mamba2 ? di + 2 * groups * n : di; }

  // Each layer's conv state [pool, conv_channels, width] and ssm state ([pool, d_inner, state],
  // Mamba-2's [pool, heads, headdim, state]), fp32, as the loops and kernels index them.
  void check_states(const char* op, size_t l, const at::Tensor& conv, const at::Tensor& ssm) const {
    const int64_t width = weight(l, kConv).size(1);
    const std::vector<int64_t> ssm_sizes = mamba2 ? std::vector<int64_t>{-1, heads, headdim, n}
                                                  : std::vector<int64_t>{-1, di, n};
    if (conv.scalar_type() != at::kFloat || !conv.device().is_cpu() || !sizes_are(conv, {-1, conv_channels(), width}) ||
        conv.stride(2) != 1)
      throw std::invalid_argument(std::string(op) + ": layer " + std::to_string(l) +
                                  " conv state: expected a CPU tensor of Float [pool, " + std::to_string(conv_channels()) +
                                  ", " + std::to_string(width) + "] with its last axis contiguous, got " + described(conv));
    if (ssm.scalar_type() != at::kFloat || !ssm.device().is_cpu() || !sizes_are(ssm, ssm_sizes))
      throw std::invalid_argument(std::string(op) + ": layer " + std::to_string(l) +
                                  " ssm state: expected a CPU tensor of Float " + shown_sizes(ssm_sizes) + ", got " +
                                  described(ssm));
  }

 private:
  // Whether `t` has `sizes` (-1: any size of at least 1).
  static bool sizes_are(const at::Tensor& t, const std::vector<int64_t>& sizes) {
    if (t.dim() != static_cast<int64_t>(sizes.size())) return false;
    for (size_t i = 0; i < sizes.size(); ++i)
      if (sizes[i] < 0 ? t.size(i) < 1 : t.size(i) != sizes[i]) return false;
    return true;
  }

  static std::string shown_sizes(const std::vector<int64_t>& sizes) {
    std::string shown = "[";
    for (size_t i = 0; i < sizes.size(); ++i)
      shown += (i ? ", " : "") + (sizes[i] < 0 ? std::string("any") : std::to_string(sizes[i]));
    return shown + "]";
  }

  static std::string described(const at::Tensor& t) {
    std::vector<int64_t> sizes(t.sizes().begin(), t.sizes().end());
    return std::string(c10::toString(t.scalar_type())) + " " + shown_sizes(sizes) + (t.is_contiguous() ? "" : " (not contiguous)") +
           (t.device().is_cpu() ? "" : " on " + t.device().str());
  }

  // The sizes the loops below index by: a tensor read through a raw pointer past its end would
  // read other memory, not raise.
  void check_dims() const {
    const bool positive = di >= 1 && n >= 1 && (mamba2 ? heads >= 1 && headdim >= 1 && groups >= 1 : rank >= 1);
    if (!positive || (mamba2 && (heads * headdim != di || heads % groups != 0)))
      throw std::invalid_argument("model_step: dims: expected positive sizes" +
                                  std::string(mamba2 ? ", heads * headdim == d_inner and groups dividing heads" : "") +
                                  ", got d_inner " + std::to_string(di) + ", state " + std::to_string(n) +
                                  ", dt_rank " + std::to_string(rank) + ", heads " + std::to_string(heads) +
                                  ", headdim " + std::to_string(headdim) + ", groups " + std::to_string(groups));
  }

  // Layer l's weights of the sizes its step reads: contiguous CPU tensors, fp32 where a loop reads
  // them as floats (the products' and Mamba-1's state-update operands keep their kernels' dtype checks).
  void check_layer(size_t l) const {
    const auto& layer = layers[l];
    const int64_t d_in_proj = mamba2 ? 2 * di + 2 * groups * n + heads : 2 * di, per_head = mamba2 ? heads : di;
    // Its taps, of which the state's windows must have as many (check_states); -1: none to read.
    const int64_t width = layer[kConv]->dim() == 2 && layer[kConv]->size(1) >= 1 ? layer[kConv]->size(1) : -1;
    const std::vector<std::tuple<LayerTensor, const char*, std::vector<int64_t>, bool>> expected{
        {kNorm, "norm", {d}, true},
        {kInProj, "in_proj", {d_in_proj, d}, false},
        {kInProjBias, "in_proj bias", {d_in_proj}, true},
        {kConv, "conv", {conv_channels(), width}, true},
        {kConvBias, "conv bias", {conv_channels()}, true},
        {kA, "A", mamba2 ? std::vector<int64_t>{heads} : std::vector<int64_t>{di, n}, mamba2},
        {kD, "D", {per_head}, mamba2},
        {kDtBias, "dt_bias", {per_head}, mamba2},
        {kOutProj, "out_proj", {d, di}, false},
        {kOutProjBias, "out_proj bias", {d}, true},
        {kXProj, "x_proj", {rank + 2 * n, di}, false},
        {kDtProj, "dt_proj", {di, rank}, false},
        {kGateNorm, "gate norm", {di}, true},
    };
    for (const auto& [i, name, sizes, fp32] : expected) {
      const auto& t = layer[i];
      const bool read = mamba2 ? i != kXProj && i != kDtProj : i != kGateNorm;
      if (!t.has_value() || !read) continue;
      if (!t->device().is_cpu() || !t->is_contiguous() || (fp32 && t->scalar_type() != at::kFloat) ||
          !sizes_are(*t, sizes))
        throw std::invalid_argument("model_step: layer " + std::to_string(l) + " " + name +
                                    ": expected a contiguous CPU tensor" + (fp32 ? " of Float " : " ") +
                                    shown_sizes(sizes) + ", got " + described(*t));
    }
  }
};

// Every row's slot below `pool`.
void check_slots(const int64_t* slot, int64_t rows, int64_t pool) {
  for (int64_t r = 0; r < rows; ++r)
    if (slot[r] < 0 || slot[r] >= pool)
      throw std::invalid_argument("model_step: slot " + std::to_string(slot[r]) + " outside the pool's " +
                                  std::to_string(pool) + " rows");
}

const float* fdata(const std::optional<at::Tensor>& t) { return t.has_value() ? t->data_ptr<float>() : nullptr; }

// out[r] = weight * x[r] / rms(x[r]) for rows of width n.
void rms_norm_rows(const float* x, const float* weight, float* out, int64_t rows, int64_t n, double eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += double(xr[i]) * xr[i];
    const float scale = static_cast<float>(1.0 / std::sqrt(ss / n + eps));
    for (int64_t i = 0; i < n; ++i) out[r * n + i] = weight[i] * (xr[i] * scale);
  }
}


// The causal conv of one timestep: each row's window (in its pool row) shifted left, the new
// input appended, then the dot product with the weights, the bias and SiLU into out.
void conv_step(const float* in, int64_t in_stride, const at::Tensor& state, const int64_t* slots, int64_t rows,
               const float* w, const float* bias, float* out) {
  const int64_t channels = state.size(1), width = state.size(2);
  const int64_t row_stride = state.stride(0), channel_stride = state.stride(1);
  float* base = state.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    float* window = base + slots[r] * row_stride;
    for (int64_t c = 0; c < channels; ++c) {
      float* wc = window + c * channel_stride;
      const float* kc = w + c * width;
      float acc = bias ? bias[c] : 0.0f;
      for (int64_t j = 0; j + 1 < width; ++j) {
        wc[j] = wc[j + 1];
        acc += wc[j] * kc[j];
      }
      wc[width - 1] = in[r * in_stride + c];
      acc += wc[width - 1] * kc[width - 1];
      out[r * channels + c] = acc;
    }
  }
  // One vector pass, not a scalar exp per channel (docs/performance.md, "model step").
  scan_bridge::silu_in_place(out, rows * channels);
}

// The causal conv of `seq` timesteps for each row: in [rows * seq, channels] (rows in_stride
// apart), continuing from each row's window in its pool row, which is left holding the last
// `width` inputs; then the bias and SiLU into out [rows * seq, channels]. Time-major, so that the
// sums over the taps run along the channels in vectors.
void conv_seq(const float* in, int64_t in_stride, const at::Tensor& state, const int64_t* slots, int64_t rows,
              int64_t seq, const float* w, const float* bias, float* out) {
  const int64_t channels = state.size(1), width = state.size(2);
  const int64_t row_stride = state.stride(0), channel_stride = state.stride(1);
  float* base = state.data_ptr<float>();
  std::vector<float> taps(static_cast<size_t>(width * channels));  // [tap][channel]
  for (int64_t c = 0; c < channels; ++c)
    for (int64_t k = 0; k < width; ++k) taps[k * channels + c] = w[c * width + k];
  // A row's inputs in time order: the window's last width - 1, then the row's seq.
  std::vector<float> xs(static_cast<size_t>((width - 1 + seq) * channels));
  for (int64_t r = 0; r < rows; ++r) {
    float* window = base + slots[r] * row_stride;
    for (int64_t c = 0; c < channels; ++c)
      for (int64_t j = 1; j < width; ++j) xs[(j - 1) * channels + c] = window[c * channel_stride + j];
    for (int64_t t = 0; t < seq; ++t)
      std::copy(in + (r * seq + t) * in_stride, in + (r * seq + t) * in_stride + channels,
                xs.data() + (width - 1 + t) * channels);
    for (int64_t t = 0; t < seq; ++t) {
      float* o = out + (r * seq + t) * channels;
      for (int64_t c = 0; c < channels; ++c) o[c] = bias ? bias[c] : 0.0f;
      for (int64_t k = 0; k < width; ++k) {
        const float* x = xs.data() + (t + k) * channels;
        const float* tk = taps.data() + k * channels;
        for (int64_t c = 0; c < channels; ++c) o[c] += tk[c] * x[c];
      }
    }
    // The last `width` inputs (seq >= 1): xs[seq - 1 .. seq - 1 + width).
    for (int64_t c = 0; c < channels; ++c)
      for (int64_t j = 0; j < width; ++j) window[c * channel_stride + j] = xs[(seq - 1 + j) * channels + c];
  }
  scan_bridge::silu_in_place(out, rows * seq * channels);
}

// x [rows, in] (rows any stride apart, each contiguous) times w [features, in]^T plus bias, fp32
// (w fp32 or bfloat16): the features split over the calling thread and the helpers that get a
// core in time, as the kernels' items are (run_on).
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  if (x.dim() != 2 || x.scalar_type() != at::kFloat || !x.device().is_cpu())
    throw std::invalid_argument("model_step: a product's input: expected a 2-d CPU tensor of Float, got " +
                                std::to_string(x.dim()) + "-d " + std::string(c10::toString(x.scalar_type())));
  const bool bf16 = w.scalar_type() == at::kBFloat16;
  require_operand(w, "weight", bf16 ? at::kBFloat16 : at::kFloat, "model_step");
  if (bias.has_value()) require_operand(*bias, "bias", at::kFloat, "model_step");
  // Read as [features, in] below: a 3-d weight of those first two sizes was a silent wrong product.
  if (w.dim() != 2)
    throw std::invalid_argument("model_step: a product's weight: expected a 2-d tensor [features, in], got " +
                                std::to_string(w.dim()) + "-d");
  // Rows may lie any stride apart, but each is read as contiguous.
  if (x.size(1) > 1 && x.stride(1) != 1)
    throw std::invalid_argument("model_step: a product's input: expected each row contiguous (stride 1 along its " +
                                std::to_string(x.size(1)) + " inputs), got stride " + std::to_string(x.stride(1)));
  if (x.size(1) != w.size(1) || (bias.has_value() && bias->numel() != w.size(0)))
    throw std::invalid_argument("model_step: a product's operands do not fit: input [" + std::to_string(x.size(0)) +
                                ", " + std::to_string(x.size(1)) + "], weight [" + std::to_string(w.size(0)) + ", " +
                                std::to_string(w.size(1)) + "]");
  const int64_t rows = x.size(0), features = w.size(0);
  at::Tensor out = at::empty({rows, features}, x.options());
  scan_bridge::LinearProblem p;
  p.x = x.data_ptr<float>();
  p.rows = rows;
  p.in = x.size(1);
  p.x_stride = x.stride(0);
  if (bf16)
    p.w_bf16 = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  else
    p.w = w.data_ptr<float>();
  p.bias = fdata(bias);
  p.features = features;
  p.out = out.data_ptr<float>();
  const int64_t blocks = (features + scan_bridge::kLinearBlock - 1) / scan_bridge::kLinearBlock;
  const int64_t per_block = std::max<int64_t>(1, scan_bridge::kLinearBlock * rows * p.in);
  const int64_t min_blocks = (kMinWorkPerThread + per_block - 1) / per_block;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), blocks / min_blocks));
  run_on(threads, blocks, per_block, [&](scan_bridge::WorkQueue& queue, int seat) {
    int64_t begin, end;
    while (queue.take(seat, &begin, &end))
      scan_bridge::linear_features(p, begin * scan_bridge::kLinearBlock,
                                   std::min(end * scan_bridge::kLinearBlock, features));
  });
  return out;
}

inline float softplus(float v) { return v > 20.0f ? v : std::log1p(std::exp(v)); }

// Mamba-2's conv output [rows, x | B | C] split into contiguous x [rows, d_inner] and B, C
// [rows, groups * state] (`gn`), as its state update and scan read them.
void split_xbc(const at::Tensor& conv_out, int64_t di, int64_t gn, float* x, float* B, float* C) {
  const int64_t rows = conv_out.size(0), width = conv_out.size(1);
  const float* co = conv_out.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = co + r * width;
    std::copy(row, row + di, x + r * di);
    std::copy(row + di, row + di + gn, B + r * gn);
    std::copy(row + di + gn, row + di + 2 * gn, C + r * gn);
  }
}

// Mamba-2's mixer output for `rows` rows of d_inner channels, in place in y: (y + D x) silu(z),
// normalised per group of channels, scaled by layer l's gate norm; z's rows z_stride apart.
void gate_and_norm(const FusedModel& m, size_t l, float* y, const float* x, const float* z, int64_t z_stride,
                   int64_t rows, std::vector<float>& gate) {
  const int64_t di = m.di, headdim = m.headdim, groups = m.groups, per_group = di / groups;
  gate.resize(static_cast<size_t>(rows * di));
  for (int64_t r = 0; r < rows; ++r) std::copy(z + r * z_stride, z + r * z_stride + di, gate.data() + r * di);
  scan_bridge::silu_in_place(gate.data(), rows * di);
  const float* D = m.weight(l, kD).data_ptr<float>();
  const float* weight = m.weight(l, kGateNorm).data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    float* yr = y + r * di;
    for (int64_t c = 0; c < di; ++c) yr[c] = (yr[c] + D[c / headdim] * x[r * di + c]) * gate[r * di + c];
    for (int64_t g = 0; g < groups; ++g) {
      float* yg = yr + g * per_group;
      double ss = 0;
      for (int64_t c = 0; c < per_group; ++c) ss += double(yg[c]) * yg[c];
      const float scale = static_cast<float>(1.0 / std::sqrt(ss / per_group + m.eps));
      for (int64_t c = 0; c < per_group; ++c) yg[c] = weight[g * per_group + c] * (yg[c] * scale);
    }
  }
}

// Rows at or below which a step that finds the helpers asleep runs on the calling thread alone.
// Otherwise its first product, run alone, ends, the next finds the helpers' last call close and
// wakes them, and on two cores a woken helper's arrival and its spin afterwards cost a paced
// frame more than its share of the step saves (docs/performance.md, "paced step alone").
constexpr int64_t kAloneRows = 16;

// One frame of `m` for the rows of `hidden` (added into in place: the residual stream), whose
// states are rows `slots` of `conv` and `ssm` (one of each a layer, checked by the caller);
// returns the final norm's output, or with `logits` that times the model's head^T. A step of at
// most kAloneRows rows that finds the helpers asleep runs alone, head included.
at::Tensor step_model(const FusedModel& m, const at::Tensor& hidden, const at::Tensor& slots,
                      const std::vector<at::Tensor>& conv, const std::vector<at::Tensor>& ssm, bool logits) {
  const bool mamba2 = m.mamba2;
  const int64_t di = m.di, n = m.n, rank = m.rank, heads = m.heads, headdim = m.headdim, groups = m.groups;
  const double eps = m.eps;
  const int64_t rows = hidden.size(0), d = hidden.size(1);
  const scan_bridge::HelperPool::Alone alone(rows <= kAloneRows && !scan_bridge::HelperPool::shared().polling());
  const int64_t* slot = slots.data_ptr<int64_t>();
  float* h = hidden.data_ptr<float>();
  at::Tensor normed = at::empty({rows, d}, hidden.options());
  std::vector<float> gate;  // Mamba-2's silu(z), layer by layer
  for (size_t l = 0; l < m.layers.size(); ++l) {
    const auto& layer = m.layers[l];
    rms_norm_rows(h, m.weight(l, kNorm).data_ptr<float>(), normed.data_ptr<float>(), rows, d, eps);
    at::Tensor projected = linear(normed, m.weight(l, kInProj), layer[kInProjBias]);
    const int64_t width = projected.size(1);
    const float* pr = projected.data_ptr<float>();
    const at::Tensor& conv_state = conv[l];
    at::Tensor conv_out = at::empty({rows, conv_state.size(1)}, hidden.options());
    at::Tensor y;
    if (!mamba2) {
      // in_proj: [x | z]; x through the conv, then x_proj: [dt | B | C], dt through dt_proj.
      conv_step(pr, width, conv_state, slot, rows, m.weight(l, kConv).data_ptr<float>(), fdata(layer[kConvBias]),
                conv_out.data_ptr<float>());
      at::Tensor xdb = linear(conv_out, m.weight(l, kXProj), std::nullopt);
      at::Tensor dt = linear(xdb.narrow(1, 0, rank), m.weight(l, kDtProj), std::nullopt);
      at::Tensor B = xdb.narrow(1, rank, n).unsqueeze(1), C = xdb.narrow(1, rank + n, n).unsqueeze(1);
      y = state_update(ssm[l], conv_out, dt, m.weight(l, kA), B, C, layer[kD],
                       projected.narrow(1, di, di), layer[kDtBias], true, std::nullopt, std::nullopt, slots);
    } else {
      // in_proj: [z | x B C | dt]; x B C through the conv; dt through softplus and the limits.
      const int64_t conv_dim = conv_state.size(1), gn = groups * n;
      conv_step(pr + di, width, conv_state, slot, rows, m.weight(l, kConv).data_ptr<float>(), fdata(layer[kConvBias]),
                conv_out.data_ptr<float>());
      at::Tensor x = at::empty({rows, heads, headdim}, hidden.options());
      at::Tensor B = at::empty({rows, groups, n}, hidden.options()), C = at::empty({rows, groups, n}, hidden.options());
      at::Tensor dt = at::empty({rows, heads}, hidden.options());
      split_xbc(conv_out, di, gn, x.data_ptr<float>(), B.data_ptr<float>(), C.data_ptr<float>());
      const float* dt_bias = m.weight(l, kDtBias).data_ptr<float>();
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t hd = 0; hd < heads; ++hd) {
          float v = softplus(pr[r * width + di + conv_dim + hd] + dt_bias[hd]);
          if (m.dt_min) v = std::max(v, static_cast<float>(*m.dt_min));
          if (m.dt_max) v = std::min(v, static_cast<float>(*m.dt_max));
          dt.data_ptr<float>()[r * heads + hd] = v;
        }
      }
      y = at::empty({rows, heads, headdim}, hidden.options());
      ssd_state_update(ssm[l], slots, x, dt, m.weight(l, kA), B, C, std::nullopt, std::nullopt,
                       std::nullopt, false, std::nullopt, std::nullopt, y);
      gate_and_norm(m, l, y.data_ptr<float>(), x.data_ptr<float>(), pr, width, rows, gate);
      y = y.view({rows, di});
    }
    at::Tensor out = linear(y, m.weight(l, kOutProj), layer[kOutProjBias]);
    const float* op = out.data_ptr<float>();
    for (int64_t i = 0; i < rows * d; ++i) h[i] += op[i];
  }
  at::Tensor result = at::empty({rows, d}, hidden.options());
  rms_norm_rows(h, m.norm_f.data_ptr<float>(), result.data_ptr<float>(), rows, d, eps);
  return logits ? linear(result, *m.lm_head, std::nullopt) : result;
}

// Each layer's conv and ssm state (the last two of its tensors), every slot checked against them.
void layer_states(const char* op, const FusedModel& model, const LayerList& layers, const at::Tensor& slots,
                  int64_t rows, std::vector<at::Tensor>& conv, std::vector<at::Tensor>& ssm) {
  if (slots.numel() != rows) throw std::invalid_argument(std::string(op) + ": expected a slot for each input row");
  for (const auto& layer : layers) {
    if (layer.size() != kLayerTensors || !layer[kConvState] || !layer[kSsmState])
      throw std::invalid_argument(std::string(op) + ": expected 15 tensors a layer, its state last");
    model.check_states(op, conv.size(), *layer[kConvState], *layer[kSsmState]);
    conv.push_back(*layer[kConvState]);
    ssm.push_back(*layer[kSsmState]);
    check_slots(slots.data_ptr<int64_t>(), slots.numel(), std::min(conv.back().size(0), ssm.back().size(0)));
  }
}

// A prefill of `m` over hidden [rows, seq, d] (seq >= 1; added into in place: the residual
// stream) from the states in rows `slots` of `conv` and `ssm`, which are left holding the states
// after the last timestep: each layer's products over all rows * seq tokens at once, the conv
// over the window, the backend's scan kernels reading and writing the pool rows in place.
// Nothing runs on torch's OpenMP team (its calls here only allocate): a parallel torch op wakes
// the team, whose threads then spin on the core the kernels' helper needs (docs/performance.md,
// "model forward"). The math of bridge.models.runtime's composed prefill; returns the final
// norm's output.
at::Tensor forward_model(const FusedModel& m, at::Tensor& hidden, const at::Tensor& slots,
                         const std::vector<at::Tensor>& conv, const std::vector<at::Tensor>& ssm) {
  const int64_t di = m.di, n = m.n, rank = m.rank, heads = m.heads, headdim = m.headdim, groups = m.groups;
  const int64_t rows = hidden.size(0), seq = hidden.size(1), d = hidden.size(2), tokens = rows * seq;
  const int64_t* slot = slots.data_ptr<int64_t>();
  const auto options = hidden.options();
  float* h = hidden.data_ptr<float>();
  at::Tensor normed = at::empty({tokens, d}, options);
  std::vector<float> gate;
  for (size_t l = 0; l < m.layers.size(); ++l) {
    const auto& layer = m.layers[l];
    rms_norm_rows(h, m.weight(l, kNorm).data_ptr<float>(), normed.data_ptr<float>(), tokens, d, m.eps);
    const at::Tensor projected = linear(normed, m.weight(l, kInProj), layer[kInProjBias]);
    const int64_t width = projected.size(1);
    const float* pr = projected.data_ptr<float>();
    const int64_t conv_dim = conv[l].size(1);
    at::Tensor conv_out = at::empty({tokens, conv_dim}, options);
    at::Tensor y = at::empty({tokens, di}, options);
    const at::Tensor& state = ssm[l];
    if (!m.mamba2) {
      // in_proj: [x | z]; x through the conv, then x_proj: [dt | B | C], dt through dt_proj.
      conv_seq(pr, width, conv[l], slot, rows, seq, m.weight(l, kConv).data_ptr<float>(), fdata(layer[kConvBias]),
               conv_out.data_ptr<float>());
      const at::Tensor xdb = linear(conv_out, m.weight(l, kXProj), std::nullopt);
      const at::Tensor dt = linear(xdb.narrow(1, 0, rank), m.weight(l, kDtProj), std::nullopt);
      // Token rows read as [rows, seq, ...] (views); B and C with their one group.
      const auto by_row = [&](const at::Tensor& t) { return t.view({rows, seq, t.size(1)}); };
      const std::optional<at::Tensor> z = by_row(projected.narrow(1, di, di));
      ScanProblem p = problem_from(by_row(conv_out), by_row(dt), m.weight(l, kA),
                                   by_row(xdb.narrow(1, rank, n)).unsqueeze(2),
                                   by_row(xdb.narrow(1, rank + n, n)).unsqueeze(2), layer[kD], z, layer[kDtBias],
                                   true, std::nullopt, std::nullopt, {0, 1, 2}, {0, 1, 2, 3});
      p.slots = strided(slots, "slots", std::array<int, 1>{0});
      p.h0 = strided(state, "state", std::array<int, 3>{0, 1, 2});
      p.state_out = p.h0;
      p.y = strided(by_row(y), "y", std::array<int, 3>{0, 1, 2});
      run(p);
    } else {
      // in_proj: [z | x B C | dt]; x B C through the conv; dt's bias, softplus and limits in the scan.
      const int64_t gn = groups * n;
      conv_seq(pr + di, width, conv[l], slot, rows, seq, m.weight(l, kConv).data_ptr<float>(),
               fdata(layer[kConvBias]), conv_out.data_ptr<float>());
      at::Tensor x = at::empty({tokens, di}, options), dt = at::empty({tokens, heads}, options);
      at::Tensor B = at::empty({tokens, gn}, options), C = at::empty({tokens, gn}, options);
      split_xbc(conv_out, di, gn, x.data_ptr<float>(), B.data_ptr<float>(), C.data_ptr<float>());
      for (int64_t t = 0; t < tokens; ++t) {
        const float* raw = pr + t * width + di + conv_dim;
        std::copy(raw, raw + heads, dt.data_ptr<float>() + t * heads);
      }
      const std::optional<at::Tensor> none;
      scan_bridge::SsdScanProblem<float> p;
      p.batch = rows, p.seq = seq, p.heads = heads, p.headdim = headdim, p.state = n, p.groups = groups;
      p.x = x.data_ptr<float>();
      p.dt = dt.data_ptr<float>();
      p.A = m.weight(l, kA).data_ptr<float>();
      p.B = B.data_ptr<float>();
      p.C = C.data_ptr<float>();
      p.options = SsdExtras{none, none, layer[kDtBias], true, m.dt_min, m.dt_max}.options<float>();
      p.y = y.data_ptr<float>();
      p.h0 = p.state_out = state.data_ptr<float>();
      p.state_rows = slot;
      p.state_row_stride = state.stride(0);
      const int64_t items = scan_bridge::ssd_scan_item_count(p);
      run_ssd_items(p, items, std::max<int64_t>(1, tokens * di * n / items), scan_bridge::ssd_scan_items<float>);
      gate_and_norm(m, l, y.data_ptr<float>(), x.data_ptr<float>(), pr, width, tokens, gate);
    }
    const at::Tensor out = linear(y, m.weight(l, kOutProj), layer[kOutProjBias]);
    const float* op = out.data_ptr<float>();
    for (int64_t i = 0; i < tokens * d; ++i) h[i] += op[i];
  }
  at::Tensor result = at::empty({rows, seq, d}, options);
  rms_norm_rows(h, m.norm_f.data_ptr<float>(), result.data_ptr<float>(), tokens, d, m.eps);
  return result;
}

// The step as Python calls it: `layers` each with its weights then its conv and ssm state
// (pool tensors, a row per slot), the model's weights checked on every call; with `head`, the
// logits (the final norm's output times head^T) instead of the final norm's output.
at::Tensor model_step(const at::Tensor& hidden, const at::Tensor& slots, const LayerList& layers,
                      const at::Tensor& norm_f, const std::vector<int64_t>& dims, double eps,
                      std::optional<double> dt_min, std::optional<double> dt_max,
                      const std::optional<at::Tensor>& head) {
  const FusedModel model(layers, norm_f, dims, eps, dt_min, dt_max, std::nullopt, head);
  require_operand(hidden, "hidden", at::kFloat);
  require_operand(slots, "slots", at::kLong);
  if (hidden.dim() != 2 || hidden.size(1) != model.d)
    throw std::invalid_argument("model_step: expected hidden [rows, " + std::to_string(model.d) + "]");
  std::vector<at::Tensor> conv, ssm;
  layer_states("model_step", model, layers, slots, hidden.size(0), conv, ssm);
  return step_model(model, hidden, slots, conv, ssm, head.has_value());
}

// The prefill as Python calls it: as model_step, with embeddings [rows, seq, d] (read, not
// written) and, with `last_only`, the output of each row's last timestep alone.
at::Tensor model_forward(const at::Tensor& embeddings, const at::Tensor& slots, const LayerList& layers,
                         const at::Tensor& norm_f, const std::vector<int64_t>& dims, double eps,
                         std::optional<double> dt_min, std::optional<double> dt_max,
                         const std::optional<at::Tensor>& head, bool last_only) {
  const FusedModel model(layers, norm_f, dims, eps, dt_min, dt_max, std::nullopt, head);
  require_operand(embeddings, "embeddings", at::kFloat, "model_forward");
  require_operand(slots, "slots", at::kLong, "model_forward");
  if (embeddings.dim() != 3 || embeddings.size(1) < 1 || embeddings.size(2) != model.d)
    throw std::invalid_argument("model_forward: expected embeddings [rows, seq >= 1, " + std::to_string(model.d) + "]");
  // The residual stream, copied here: a torch copy of this many elements would wake torch's
  // OpenMP team, whose threads then spin on the core the kernels' helper needs.
  at::Tensor hidden = at::empty(embeddings.sizes(), embeddings.options());
  std::copy(embeddings.data_ptr<float>(), embeddings.data_ptr<float>() + embeddings.numel(), hidden.data_ptr<float>());
  std::vector<at::Tensor> conv, ssm;
  layer_states("model_forward", model, layers, slots, embeddings.size(0), conv, ssm);
  if (model.mamba2)
    for (const auto& state : ssm)
      if (state.stride(3) != 1 || state.stride(2) != model.n || state.stride(1) != model.headdim * model.n)
        throw std::invalid_argument("model_forward: expected each pool row's ssm state contiguous");
  at::Tensor out = forward_model(model, hidden, slots, conv, ssm);
  if (last_only) out = out.narrow(1, out.size(1) - 1, 1).contiguous();
  if (!head.has_value()) return out;
  return linear(out.view({-1, model.d}), *head, std::nullopt).view({out.size(0), out.size(1), head->size(0)});
}

// A model's weights checked and kept for native callers' steps: a "scan_bridge.fused_model"
// capsule (model_step.h) that owns them; `layers` each its weights alone; the embedding and the
// head where the model has them.
py::capsule prepare_model(const LayerList& layers, const at::Tensor& norm_f, const std::vector<int64_t>& dims,
                          double eps, std::optional<double> dt_min, std::optional<double> dt_max,
                          const std::optional<at::Tensor>& embeddings, const std::optional<at::Tensor>& lm_head) {
  for (const auto& layer : layers)
    if (layer.size() != kLayerWeights)
      throw std::invalid_argument("prepare_model: expected " + std::to_string(int(kLayerWeights)) +
                                  " weights a layer, got " + std::to_string(layer.size()));
  auto model = std::make_unique<FusedModel>(layers, norm_f, dims, eps, dt_min, dt_max, embeddings, lm_head);
  py::capsule owner(model.get(), scan_bridge::kFusedModelCapsule,
                    [](PyObject* capsule) {
                      delete static_cast<FusedModel*>(PyCapsule_GetPointer(capsule, scan_bridge::kFusedModelCapsule));
                    });
  model.release();
  return owner;
}

// The embedding rows of `rows` token ids (of `type`, at any byte offset) into `out` [rows, d]
// fp32: every id is checked first, so a bad one changes nothing.
void embed_tokens(const FusedModel& model, const void* ids, scan_bridge::TokenType type, int64_t rows, float* out) {
  if (!model.embeddings) throw std::invalid_argument("model_step: tokens given to a model without an embedding");
  const at::Tensor& table = *model.embeddings;
  const int64_t vocab = table.size(0), d = model.d;
  std::vector<int64_t> id(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    id[r] = scan_bridge::token_at(ids, type, r);
    if (id[r] < 0 || id[r] >= vocab)
      throw std::invalid_argument("model_step: token " + std::to_string(id[r]) + " outside the vocabulary of " +
                                  std::to_string(vocab));
  }
  for (int64_t r = 0; r < rows; ++r) {
    if (table.scalar_type() == at::kFloat) {
      std::memcpy(out + r * d, table.data_ptr<float>() + id[r] * d, static_cast<size_t>(d) * sizeof(float));
    } else {
      const auto* row = reinterpret_cast<const uint16_t*>(table.data_ptr<at::BFloat16>()) + id[r] * d;
      for (int64_t i = 0; i < d; ++i) out[r * d + i] = scan_bridge::widen_bf16(row[i]);
    }
  }
}

// A step of a prepared model on state rows that native callers address themselves, exported as
// the capsule "scan_bridge.run_model_step": the rows' parts are viewed where they lie, the
// input and output copied from and to wherever the caller's bytes are (a request frame, a reply).
int run_model_step(const scan_bridge::ModelStepProblem* p, size_t problem_size, char* error, size_t error_size) {
  return call_from_c("ModelStepProblem", "model_step.h", problem_size, sizeof(*p), [&] {
    if (p->model == nullptr || p->rows < 0)
      throw std::invalid_argument("ModelStepProblem: expected a prepared model and rows >= 0");
    const auto& model = *static_cast<const FusedModel*>(p->model);
    if (p->layers != static_cast<int64_t>(model.layers.size()))
      throw std::invalid_argument("model_step: expected the state of " + std::to_string(model.layers.size()) +
                                  " layers, got " + std::to_string(p->layers));
    const int64_t rows = p->rows, d = model.d;
    check_slots(p->slots, rows, p->pool_rows);
    if (p->logits && !model.lm_head) throw std::invalid_argument("model_step: logits asked of a model without a head");
    const auto f32 = at::TensorOptions().dtype(at::kFloat);
    at::Tensor hidden = at::empty({rows, d}, f32);
    if (p->token_type == scan_bridge::TokenType::none)
      std::memcpy(hidden.data_ptr<float>(), p->hidden, static_cast<size_t>(rows * d) * sizeof(float));
    else
      embed_tokens(model, p->hidden, p->token_type, rows, hidden.data_ptr<float>());
    at::Tensor slots = at::from_blob(const_cast<int64_t*>(p->slots), {rows}, at::TensorOptions().dtype(at::kLong));
    std::vector<at::Tensor> conv, ssm;
    for (size_t l = 0; l < model.layers.size(); ++l) {
      const at::Tensor& w = model.weight(l, kConv);  // [channels, d_conv]
      conv.push_back(at::from_blob(reinterpret_cast<float*>(p->conv[l]), {p->pool_rows, w.size(0), w.size(1)},
                                   {p->row_stride, w.size(1), 1}, f32));
      const int64_t n = model.n;
      ssm.push_back(model.mamba2
                        ? at::from_blob(reinterpret_cast<float*>(p->ssm[l]), {p->pool_rows, model.heads, model.headdim, n},
                                        {p->row_stride, model.headdim * n, n, 1}, f32)
                        : at::from_blob(reinterpret_cast<float*>(p->ssm[l]), {p->pool_rows, model.di, n},
                                        {p->row_stride, n, 1}, f32));
    }
    const at::Tensor out = step_model(model, hidden, slots, conv, ssm, p->logits);
    std::memcpy(p->out, out.data_ptr<float>(), static_cast<size_t>(out.numel()) * sizeof(float));
  }, error, error_size);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "scan-bridge CPU selective-scan kernels";
  // cu_seqlens last and optional: the Python side passes it only for a packed call, so that it
  // also drives builds of revisions before it (bench.kernel_ab).
  m.def("scan", &scan, py::arg("x"), py::arg("dt"), py::arg("A"), py::arg("B"), py::arg("C"), py::arg("D"),
        py::arg("z"), py::arg("dt_bias"), py::arg("dt_softplus"), py::arg("dt_min"), py::arg("dt_max"), py::arg("h0"),
        py::arg("return_state"), py::arg("layout"), py::arg("cu_seqlens") = py::none(),
        py::call_guard<scan_bridge::ReleasedGil>());
  m.def("state_update", &state_update, py::call_guard<scan_bridge::ReleasedGil>());
  m.def("ssd_scan", &ssd_scan, py::arg("x"), py::arg("dt"), py::arg("A"), py::arg("B"), py::arg("C"), py::arg("D"),
        py::arg("z"), py::arg("dt_bias"), py::arg("dt_softplus"), py::arg("dt_min"), py::arg("dt_max"), py::arg("h0"),
        py::arg("y"), py::arg("state"), py::arg("cu_seqlens") = py::none(), py::call_guard<scan_bridge::ReleasedGil>());
  m.def("ssd_state_update", &ssd_state_update, py::call_guard<scan_bridge::ReleasedGil>());
  m.def("model_step", &model_step, py::arg("hidden"), py::arg("slots"), py::arg("layers"), py::arg("norm_f"),
        py::arg("dims"), py::arg("eps"), py::arg("dt_min"), py::arg("dt_max"), py::arg("head") = py::none(),
        py::call_guard<scan_bridge::ReleasedGil>());
  m.def("model_forward", &model_forward, py::arg("embeddings"), py::arg("slots"), py::arg("layers"), py::arg("norm_f"),
        py::arg("dims"), py::arg("eps"), py::arg("dt_min"), py::arg("dt_max"), py::arg("head") = py::none(),
        py::arg("last_only") = false, py::call_guard<scan_bridge::ReleasedGil>());
  m.def("prepare_model", &prepare_model, py::arg("layers"), py::arg("norm_f"), py::arg("dims"), py::arg("eps"),
        py::arg("dt_min"), py::arg("dt_max"), py::arg("embeddings") = py::none(), py::arg("lm_head") = py::none());
  m.def("linear", &linear, py::call_guard<scan_bridge::ReleasedGil>());
  m.def("scan_backward", &scan_backward, py::arg("x"), py::arg("dt"), py::arg("z"), py::arg("dy"), py::arg("A"),
        py::arg("B"), py::arg("C"), py::arg("D"), py::arg("dt_bias"), py::arg("dt_softplus"), py::arg("dt_min"),
        py::arg("dt_max"), py::arg("h0"), py::arg("dstate"), py::arg("scalar_decay"), py::arg("channels_per_dt"),
        py::arg("dx"), py::arg("ddt"), py::arg("dz"), py::arg("dh0"), py::arg("cu_seqlens") = py::none(),
        py::call_guard<scan_bridge::ReleasedGil>());
  m.def("simd", &scan_bridge::simd_description);
  m.def("start_helpers", [] { scan_bridge::HelperPool::shared().start(at::get_num_threads() - 1); },
        "Starts the helper threads torch.get_num_threads() allows, before any call needs them.");
  static_assert(std::is_same_v<decltype(&run_problem), scan_bridge::RunProblemFn>);
  m.attr("run_problem") = py::capsule(reinterpret_cast<void*>(&run_problem), scan_bridge::kRunProblemCapsule);
  static_assert(std::is_same_v<decltype(&run_ssd_update), scan_bridge::RunSsdUpdateFn>);
  m.attr("run_ssd_update") = py::capsule(reinterpret_cast<void*>(&run_ssd_update), scan_bridge::kRunSsdUpdateCapsule);
  static_assert(std::is_same_v<decltype(&run_model_step), scan_bridge::RunModelStepFn>);
  m.attr("run_model_step") = py::capsule(reinterpret_cast<void*>(&run_model_step), scan_bridge::kRunModelStepCapsule);
}
