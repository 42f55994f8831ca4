// out = x w^T + bias (linear_kernel.h). Features go W at a time (W: lanes of a vector): each
// row's W dot products run as W vector accumulators over `in`, folded into one vector of W
// sums by LaneSums, the way the state updates sum W rows. The W weight rows (W x in floats)
// stay in L1 while every row of x passes over them, so the weights are read from memory once
// a call. Remainders: `in` past its last whole vector and features past the last block of W
// are summed in scalar lanes.
#include "linear_kernel.h"

#include <cstring>

#include "simd.h"

namespace scan_bridge {
namespace {

using V = Lanes<float>::V;
using VU = Lanes<float>::Unaligned;
constexpr int W = Lanes<float>::W;
// Partial sums of a scalar dot product (the compiler vectorizes them; one running sum is an
// ordered reduction it must keep scalar).
constexpr int kLanes = 16;

inline V load(const float* p) { return V(*reinterpret_cast<const VU*>(p)); }

// Features j .. j + W of one row x: out[0 .. W).
inline void dot_block(const float* __restrict x, const float* __restrict w, int64_t in, float* __restrict out) {
  const int64_t whole = in / W * W;
  V acc[W];
  for (int c = 0; c < W; ++c) acc[c] = V{};
  for (int64_t k = 0; k < whole; k += W) {
    const V xv = load(x + k);
#pragma GCC unroll 16
    for (int c = 0; c < W; ++c) acc[LaneSums<float>::kSlot[c]] += xv * load(w + c * in + k);
  }
  const V sums = LaneSums<float>::of(acc);
  std::memcpy(out, &sums, sizeof(V));
  for (int64_t k = whole; k < in; ++k)
    for (int c = 0; c < W; ++c) out[c] += x[k] * w[c * in + k];
}

inline float dot(const float* __restrict x, const float* __restrict w, int64_t in) {
  float part[kLanes] = {};
  int64_t k = 0;
  for (; k + kLanes <= in; k += kLanes)
    for (int l = 0; l < kLanes; ++l) part[l] += x[k + l] * w[k + l];
  for (int l = 0; k < in; ++k, ++l) part[l] += x[k] * w[k];
  float sum = 0.0f;
  for (int l = 0; l < kLanes; ++l) sum += part[l];
  return sum;
}

}  // namespace

void linear_features(const LinearProblem& p, int64_t begin, int64_t end) {
  int64_t j = begin;
  for (; j + W <= end; j += W) {
    const float* w = p.w + j * p.in;
    for (int64_t r = 0; r < p.rows; ++r) {
      float* out = p.out + r * p.features + j;
      dot_block(p.x + r * p.x_stride, w, p.in, out);
      if (p.bias)
        for (int c = 0; c < W; ++c) out[c] += p.bias[j + c];
    }
  }
  for (; j < end; ++j)
    for (int64_t r = 0; r < p.rows; ++r)
      p.out[r * p.features + j] = dot(p.x + r * p.x_stride, p.w + j * p.in, p.in) + (p.bias ? p.bias[j] : 0.0f);
}

}  // namespace scan_bridge
