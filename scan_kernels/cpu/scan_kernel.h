// One selective-scan call described without torch types: the contract between the SIMD kernels
// (scan_kernel.cpp, torch-free so it compiles in seconds with -O3 -march=native) and the ATen
// binding (binding.cpp), which fills a ScanProblem from tensors and shares its work items
// between the calling thread and helper threads (helper_pool.h). The bridge's native step path
// (bridge/native/step.cpp) fills one from a request frame and runs it through the binding's
// "scan_bridge.run_problem" capsule.
//
// The state update is the same problem with seq == 1, h0 and state_out both pointing at the
// state pool, and `slots` choosing the pool row of each batch row.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

namespace scan_bridge {

enum class DType : int32_t { f32, f16, bf16, f64, i32, i64 };

// A tensor read or written through element strides in a fixed axis order (given per field
// below). `data` may sit at any byte offset: every access goes through memcpy-style loads.
struct Strided {
  void* data = nullptr;  // nullptr: the optional operand is absent
  DType dtype = DType::f32;
  int64_t stride[4] = {0, 0, 0, 0};
};

struct ScanProblem {
  int64_t batch = 0, seq = 0, dim = 0, state = 0, groups = 1;
  Strided x, dt, z;     // (batch, time, channel)
  Strided B, C;         // (batch, time, group, state)
  Strided A;            // (channel, state)
  Strided D, dt_bias;   // (channel)
  Strided slots;        // (batch) i32/i64 or absent: the row of h0 and state_out of each batch
                        // row; seq == 1: < 0 = padding row (y = 0, no state touched); seq > 1
                        // (the binding's model prefill only; run_problem refuses it): each >= 0
  Strided h0;           // (row, channel, state); absent = zeros
  Strided y;            // (batch, time, channel), written
  Strided state_out;    // (row, channel, state), written; may alias h0 (in-place update)
  // Sequence mode, or null: `batch` + 1 boundaries of as many sequences packed along the time
  // axis of one row of x, dt, z, B, C and y (varlen); sequence b runs over the times
  // cu_seqlens[b] .. cu_seqlens[b + 1] from row b of h0 and leaves its state in row b of
  // state_out, and `seq` is the packed length.
  const int64_t* cu_seqlens = nullptr;
  bool dt_softplus = false;
  bool has_dt_min = false, has_dt_max = false;
  double dt_min = 0.0, dt_max = 0.0;
  bool compute_f64 = false;  // float64 math (x is float64); float32 otherwise
};

// The steps one batch row's items walk: `seq`, or for `rows` sequences packed at `cu_seqlens`,
// their mean (for sizing the threads' shares).
inline int64_t steps_per_row(int64_t seq, int64_t rows, const int64_t* cu_seqlens) {
  if (cu_seqlens == nullptr) return seq;
  const int64_t mean = seq / (rows > 0 ? rows : 1);
  return mean > 0 ? mean : 1;
}

// Items are independent (channel block, batch row) pairs; any split of [0, work_items) across
// threads gives bit-identical results. Consecutive items share a channel block (or a batch
// row, for seq == 1), so a thread taking contiguous ranges prepares shared data once.
int64_t work_items(const ScanProblem& p);
// State-element updates (time x channels x state) one item performs: sizes parallel grains.
int64_t work_per_item(const ScanProblem& p);

// Contiguous ranges of items handed out on demand, so that a thread that gets less CPU time
// (a core shared with another process) simply takes fewer ranges. The items are cut into one
// span per seat (thread) of the call: a thread takes ranges from its own span first, then
// helps with what is left of the others'. While the threads keep pace, each one so meets the
// same items call after call: in a state update, the same pool rows, which then stay in its
// core's L2 instead of moving between the cores on every step. Against one queue shared by all,
// the step was as fast or faster and the ExPhil scan no slower
// (docs/performance.md, "work split affinity").
class WorkQueue {
 public:
  WorkQueue(int64_t items, int64_t chunk, int seats)
      : chunk_(chunk < 1 ? 1 : chunk), seats_(seats < 1 ? 1 : seats), spans_(new Span[seats_]) {
    for (int s = 0; s < seats_; ++s) {
      spans_[s].next.store(items * s / seats_, std::memory_order_relaxed);
      spans_[s].end = items * (s + 1) / seats_;
    }
  }
  // A range for the thread in `seat` (0 .. seats - 1); false when every span is used up.
  bool take(int seat, int64_t* begin, int64_t* end) {
    for (int k = 0; k < seats_; ++k) {
      Span& span = spans_[(seat + k) % seats_];
      if (span.next.load(std::memory_order_relaxed) >= span.end) continue;
      const int64_t b = span.next.fetch_add(chunk_, std::memory_order_relaxed);
      if (b >= span.end) continue;
      *begin = b;
      *end = b + chunk_ < span.end ? b + chunk_ : span.end;
      return true;
    }
    return false;
  }

 private:
  // One cache line each, so that two threads taking from their own spans do not contend.
  struct alignas(64) Span {
    std::atomic<int64_t> next{0};
    int64_t end = 0;
  };
  const int64_t chunk_;
  const int seats_;
  std::unique_ptr<Span[]> spans_;
};

// Runs ranges from `queue` until it is empty; called by every thread of a parallel region,
// each with its own seat.
void run_items(const ScanProblem& p, WorkQueue& queue, int seat);

// The instruction set the kernels were compiled for, for `info` and benchmark reports.
const char* simd_description();

// values[i] <- silu(values[i]) = values[i] sigmoid(values[i]) for i < count, with the kernels'
// vector exp (simd.h): for the fused model step's conv outputs and gates (binding.cpp).
void silu_in_place(float* values, int64_t count);

// The kernel run for native callers in this process (scan_kernels/cpu/binding.cpp exports it, the
// bridge's native step path calls it): `problem_size` is sizeof(ScanProblem) as the caller was
// compiled; 0 on success, else the error's message is in `error`.
using RunProblemFn = int (*)(const ScanProblem* problem, size_t problem_size, char* error, size_t error_size);
inline constexpr char kRunProblemCapsule[] = "scan_bridge.run_problem";

}  // namespace scan_bridge
