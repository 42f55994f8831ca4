// Mamba-2 (SSD) recurrences over contiguous operands in the compute dtype (float or double),
// torch-free like scan_kernel.h. The binding (binding.cpp) hands them contiguous tensors whose
// dt is already discretized (bias, softplus, clamp) and applies D and the z gate itself, so these
// loops hold only the per-state-element work: one decay per (time, head), two multiply-adds per
// state element.
#pragma once

#include <cstdint>

namespace scan_bridge {

template <typename T>
struct SsdScanProblem {
  int64_t batch = 0, seq = 0, heads = 0, headdim = 0, state = 0, groups = 1;
  const T* x = nullptr;   // [batch, seq, heads, headdim]
  const T* dt = nullptr;  // [batch, seq, heads], discretized
  const T* A = nullptr;   // [heads]
  const T* B = nullptr;   // [batch, seq, groups, state]
  const T* C = nullptr;   // [batch, seq, groups, state]
  const T* h0 = nullptr;  // [batch, heads, headdim, state] or nullptr (zeros)
  T* y = nullptr;         // [batch, seq, heads, headdim], written: C . h only
  T* state_out = nullptr; // [batch, heads, headdim, state] or nullptr
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
  const T* dt = nullptr;        // [batch, heads], discretized
  const T* A = nullptr;         // [heads]
  const T* B = nullptr;         // [batch, groups, state]
  const T* C = nullptr;         // [batch, groups, state]
  T* y = nullptr;               // [batch, heads, headdim], written (C . h; 0 for padding rows)
};

// Items are (batch row, head) pairs.
template <typename T>
void ssd_update_items(const SsdUpdateProblem<T>& p, int64_t begin, int64_t end);

}  // namespace scan_bridge
