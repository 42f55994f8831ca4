// The matrix products of a model's step (binding.cpp, model_step): out = x w^T + bias for the
// few rows of one frame, torch-free like scan_kernel.h. A call computes the output features
// [begin, end), so that the calling thread and the pool's helpers can split the features
// between them (HelperPool: a helper that has no core yet is never waited for). Under
// at::linear every product was an OpenMP fork/join, which waits for each team thread: paced,
// each woke a sleeping thread, and with the other core busy each waited for a time slice
// (docs/performance.md, "model step").
#pragma once

#include <cstdint>
#include <cstring>

namespace scan_bridge {

// A bfloat16 value (its bits) as the fp32 value whose top half it is: exact.
inline float widen_bf16(uint16_t bits) {
  const uint32_t wide = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof(f));
  return f;
}

struct LinearProblem {
  const float* x = nullptr;    // [rows, in], rows x_stride apart
  int64_t rows = 0, in = 0, x_stride = 0;
  const float* w = nullptr;    // [features, in], contiguous; or, instead,
  const uint16_t* w_bf16 = nullptr;  // the same in bfloat16 (the top half of each fp32 value)
  const float* bias = nullptr; // [features] or nullptr
  int64_t features = 0;
  float* out = nullptr;        // [rows, features], contiguous
};

// The features callers split at: a multiple of every target's vector lanes, so that each part
// but the last runs whole vectors.
constexpr int64_t kLinearBlock = 16;

// out[r, j] for every row r and feature j in [begin, end).
void linear_features(const LinearProblem& p, int64_t begin, int64_t end);

}  // namespace scan_bridge
