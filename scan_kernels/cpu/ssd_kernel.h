// Mamba-2 (SSD) recurrences over contiguous operands in the compute dtype (float or double),
// torch-free like scan_kernel.h. The binding (binding.cpp) hands them contiguous tensors; the
// kernels do the whole per-element work: dt's discretization once per (time, head), one decay
// per (time, head), two multiply-adds per state element, then D and the z gate on y. Doing
// the last in torch after the call left the parallel torch op waiting for a core the kernels'
// still-polling helper held (docs/performance.md, "SSD CPU kernel").
#pragma once

#include <cstddef>
#include <cstdint>

namespace scan_bridge {

// What the kernels apply around the recurrence: dt <- clamp(softplus(dt + bias)) per (time,
// head), and y <- (y + D x) silu(z) per element; absent parts are skipped.
template <typename T>
struct SsdOptions {
  const T* dt_bias = nullptr;  // [heads] or nullptr
  bool dt_softplus = false;
  bool has_dt_min = false, has_dt_max = false;
  T dt_min = 0, dt_max = 0;
  const T* D = nullptr;  // [heads, headdim] or nullptr
  const T* z = nullptr;  // shaped like x, or nullptr
};

template <typename T>
struct SsdScanProblem {
  int64_t batch = 0, seq = 0, heads = 0, headdim = 0, state = 0, groups = 1;
  const T* x = nullptr;   // [batch, seq, heads, headdim]
  const T* dt = nullptr;  // [batch, seq, heads], as the caller gave it
  const T* A = nullptr;   // [heads]
  const T* B = nullptr;   // [batch, seq, groups, state]
  const T* C = nullptr;   // [batch, seq, groups, state]
  const T* h0 = nullptr;  // [batch, heads, headdim, state] or nullptr (zeros)
  SsdOptions<T> options;
  T* y = nullptr;         // [batch, seq, heads, headdim], written
  T* state_out = nullptr; // [batch, heads, headdim, state] or nullptr
  // Or null: the row of h0 and state_out of each batch row, rows state_row_stride elements
  // apart (a model's prefill, its states in pool rows; h0 may then alias state_out).
  const int64_t* state_rows = nullptr;
  int64_t state_row_stride = 0;
  // Or null: `batch` + 1 boundaries of as many sequences packed along seq in one row of x, dt,
  // B, C, z and y (varlen); sequence b runs over cu_seqlens[b] .. cu_seqlens[b + 1] from row b
  // of h0 into row b of state_out.
  const int64_t* cu_seqlens = nullptr;
};

// Items are (batch row, head, block of headdim) triples, independent of each other: any split of
// [0, ssd_scan_item_count) across threads gives identical results.
template <typename T>
int64_t ssd_scan_item_count(const SsdScanProblem<T>& p);
template <typename T>
void ssd_scan_items(const SsdScanProblem<T>& p, int64_t begin, int64_t end);

template <typename T>
struct SsdUpdateProblem {
  int64_t batch = 0, heads = 0, headdim = 0, state = 0, groups = 1;
  T* pool = nullptr;            // [pool rows, heads, headdim, state], updated in place
  int64_t pool_row_stride = 0;  // elements from one pool row to the next (a model's pool holds other parts between)
  const int64_t* rows = nullptr;  // [batch]: the pool row of each batch row, < 0 = padding
  const T* x = nullptr;         // [batch, heads, headdim]
  const T* dt = nullptr;        // [batch, heads], as the caller gave it
  const T* A = nullptr;         // [heads]
  const T* B = nullptr;         // [batch, groups, state]
  const T* C = nullptr;         // [batch, groups, state]
  SsdOptions<T> options;
  T* y = nullptr;               // [batch, heads, headdim], written (0 for padding rows)
};

// Items are (batch row, head) pairs.
template <typename T>
void ssd_update_items(const SsdUpdateProblem<T>& p, int64_t begin, int64_t end);

// The fp32 state update run for native callers in this process (scan_kernels/cpu/binding.cpp
// exports it; the bridge's native step path calls it for Mamba-2 sessions), as RunProblemFn
// for Mamba-1: `problem_size` is sizeof(SsdUpdateProblem<float>) as the caller was compiled;
// 0 on success, else the error's message is in `error`. Every pointer is aligned to its type.
using RunSsdUpdateFn = int (*)(const SsdUpdateProblem<float>* problem, size_t problem_size, char* error,
                               size_t error_size);
inline constexpr char kRunSsdUpdateCapsule[] = "scan_bridge.run_ssd_update";

}  // namespace scan_bridge
