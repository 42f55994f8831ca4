// The selective scan's backward pass over contiguous operands in the compute dtype (float or
// double), torch-free like scan_kernel.h. dt is discretized here as the forward does it (bias,
// softplus, clamp), and its gradient goes back through that chain per (time, channel), so no
// discretized copy of dt is ever made. The binding (binding.cpp) sums the per-seat accumulators
// afterwards.
//
// Memory: no [batch, seq, dim, state] history. Each item (a block of W channels of one batch
// row) walks its sequence once to keep the state at every kBackwardChunk-th step, then walks it
// backwards a chunk at a time, recomputing that chunk's states from its checkpoint. A seat's
// scratch is (seq / kBackwardChunk + 2 kBackwardChunk) x state vectors of W lanes. A sequence
// whose states and decays fit in kWholeSequenceBytes is one chunk: no checkpoint walk.
//
// Mamba-2 (SSD) has a runner of its own (ssd_backward.cpp, the chunked matrix form), given its
// heads' channels (head x headdim) as channels, `scalar_decay` set and `channels_per_dt` =
// headdim: A, dt and dt_bias are then read per head.
#pragma once

#include <cstdint>

#include "scan_kernel.h"

namespace scan_bridge {

inline constexpr int kBackwardChunk = 16;
// A seat's states and decays for a whole sequence, at most: walked from L2 instead of L1, they
// spare the checkpoint walk, which costs about one forward pass (docs/performance.md).
inline constexpr int64_t kWholeSequenceBytes = 160 * 1024;

template <typename T>
struct ScanBackwardProblem {
  int64_t batch = 0, seq = 0, dim = 0, state = 0, groups = 1;
  bool scalar_decay = false;  // one decay per channel: A holds one value per dt column
  // Consecutive channels sharing a column of dt, dt_bias and A: a Mamba-2 head's headdim with
  // scalar_decay, else 1. The column of channel d is d / channels_per_dt, of `dt_columns` =
  // dim / channels_per_dt.
  int64_t channels_per_dt = 1;
  const T* x = nullptr;       // [batch, seq, dim]
  const T* dt = nullptr;      // [batch, seq, dt_columns], before bias, softplus and clamp
  const T* z = nullptr;       // [batch, seq, dim] or nullptr
  const T* dy = nullptr;      // [batch, seq, dim]
  const T* A = nullptr;       // [dt_columns, state], or [dt_columns] with scalar_decay
  const T* B = nullptr;       // [batch, seq, groups, state]
  const T* C = nullptr;       // [batch, seq, groups, state]
  const T* D = nullptr;       // [dim] or nullptr
  const T* dt_bias = nullptr; // [dt_columns] or nullptr
  bool dt_softplus = false;
  bool has_dt_min = false, has_dt_max = false;
  double dt_min = 0.0, dt_max = 0.0;
  const T* h0 = nullptr;      // [batch, dim, state] or nullptr (zeros)
  const T* dstate = nullptr;  // [batch, dim, state] or nullptr (zeros): the final state's gradient
  T* dx = nullptr;            // [batch, seq, dim], written
  T* ddt = nullptr;           // [batch, seq, dt_columns], written
  T* dz = nullptr;            // [batch, seq, dim], written where z is given
  T* dh0 = nullptr;           // [batch, dim, state], written, or nullptr
  // Accumulated (+=) into the slice of the running seat; zero-filled by the caller:
  T* dA = nullptr;            // [seats, dim, state] (with scalar_decay, [seats, dim, 0] only)
  T* dD = nullptr;            // [seats, dim]
  T* ddt_bias = nullptr;      // [seats, dim]
  T* dB = nullptr;            // [seats, batch, seq, groups, state]
  T* dC = nullptr;            // [seats, batch, seq, groups, state]
  // Or null: `batch` + 1 boundaries of as many sequences packed along seq in one row of the
  // [batch, seq, ...] operands above (which then have one row); sequence b runs over times
  // cu_seqlens[b] .. cu_seqlens[b + 1] with row b of h0, dstate and dh0.
  const int64_t* cu_seqlens = nullptr;
};

// Steps of the longest sequence: seq, or the longest of the packed ones.
template <typename T>
inline int64_t longest_sequence(const ScanBackwardProblem<T>& p) {
  if (p.cu_seqlens == nullptr) return p.seq;
  int64_t longest = 0;
  for (int64_t b = 0; b < p.batch; ++b)
    longest = p.cu_seqlens[b + 1] - p.cu_seqlens[b] > longest ? p.cu_seqlens[b + 1] - p.cu_seqlens[b] : longest;
  return longest;
}

// Items are (channel block, batch row) pairs; a seat's accumulators take the sums of the items
// it ran, so the totals are the same for any split up to the order of fp additions.
template <typename T>
int64_t scan_backward_items(const ScanBackwardProblem<T>& p);
// State-element updates one item performs (for the split between threads).
template <typename T>
int64_t scan_backward_work_per_item(const ScanBackwardProblem<T>& p);
template <typename T>
void scan_backward_run(const ScanBackwardProblem<T>& p, WorkQueue& queue, int seat);

// The same for Mamba-2 (scalar_decay, channels_per_dt = headdim): items are (batch row, head);
// ddt is written per head, and dA and ddt_bias accumulated at the head's first channel.
template <typename T>
int64_t ssd_backward_items(const ScanBackwardProblem<T>& p);
template <typename T>
int64_t ssd_backward_work_per_item(const ScanBackwardProblem<T>& p);
template <typename T>
void ssd_backward_run(const ScanBackwardProblem<T>& p, WorkQueue& queue, int seat);

}  // namespace scan_bridge
