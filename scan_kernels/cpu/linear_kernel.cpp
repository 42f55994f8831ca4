// out = x w^T + bias (linear_kernel.h). Features go W at a time (W: lanes of a vector): each
// row's W dot products run as W vector accumulators over `in`, folded into one vector of W
// sums by LaneSums, the way the state updates sum W rows. The W weight rows (W x in floats)
// stay in L1 while every row of x passes over them, so the weights are read from memory once
// a call. Remainders: `in` past its last whole vector and features past the last block of W
// are summed in scalar lanes. bfloat16 weights (a model loaded in bf16) are widened as they are
// read, so that a paced step streams half the weight bytes; x, the sums and out stay fp32.
#include "linear_kernel.h"

#include <cstring>
#include <type_traits>
#include <vector>

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

// W bfloat16 values widened to fp32: each is the top half of its fp32 value.
inline V load(const uint16_t* p) {
  typedef uint16_t Half __attribute__((vector_size(sizeof(V) / 2), aligned(2)));
  typedef uint32_t Wide __attribute__((vector_size(sizeof(V))));
  const Wide bits = __builtin_convertvector(*reinterpret_cast<const Half*>(p), Wide) << 16;
  V v;
  std::memcpy(&v, &bits, sizeof(V));
  return v;
}

inline float widen(float w) { return w; }
inline float widen(uint16_t w) { return widen_bf16(w); }

// out[c] += the products of x and weight row c over k in [whole, in), c < W: `in` past its last
// whole vector. Out of line, so that every caller runs the one compiled form: inlined, the
// compiler fused its multiply-adds differently beside different vector bodies, and a row's sums
// then changed with the number of rows in the call.
template <typename Stored>
__attribute__((noinline)) void tail_sums(const float* __restrict x, const Stored* __restrict w, int64_t whole,
                                         int64_t in, float* __restrict out) {
  for (int64_t k = whole; k < in; ++k)
    for (int c = 0; c < W; ++c) out[c] += x[k] * widen(w[c * in + k]);
}

// Features j .. j + W of one row x: out[0 .. W). `w`: the block's weights as the vectors read
// them (bf16 widened once for a call's rows, or as stored); `stored`: the same weights as
// stored, which the remainder reads whatever `w` is, so that it is one computation either way.
template <typename Weight, typename Stored>
inline void dot_block(const float* __restrict x, const Weight* __restrict w, const Stored* __restrict stored,
                      int64_t in, float* __restrict out) {
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
  if (whole < in) tail_sums(x, stored, whole, in, out);
}

template <typename Weight>
inline float dot(const float* __restrict x, const Weight* __restrict w, int64_t in) {
  float part[kLanes] = {};
  int64_t k = 0;
  for (; k + kLanes <= in; k += kLanes)
    for (int l = 0; l < kLanes; ++l) part[l] += x[k + l] * widen(w[k + l]);
  for (int l = 0; k < in; ++k, ++l) part[l] += x[k] * widen(w[k]);
  float sum = 0.0f;
  for (int l = 0; l < kLanes; ++l) sum += part[l];
  return sum;
}

// A block's W bf16 weight rows widened once for all of a call's rows (widened per row, the
// conversions outweighed the halved reads at 32 rows); one row reads them as they are.
const float* widened_block(const uint16_t* w, int64_t n) {
  thread_local std::vector<float> block;
  block.resize(static_cast<size_t>(n));
  int64_t k = 0;
  for (; k + W <= n; k += W) {
    const V v = load(w + k);
    std::memcpy(block.data() + k, &v, sizeof(V));
  }
  for (; k < n; ++k) block[k] = widen(w[k]);
  return block.data();
}

// Features j .. j + W of every row.
template <typename Weight, typename Stored>
void block_rows(const LinearProblem& p, const Weight* w, const Stored* stored, int64_t j) {
  for (int64_t r = 0; r < p.rows; ++r) {
    float* out = p.out + r * p.features + j;
    dot_block(p.x + r * p.x_stride, w, stored, p.in, out);
    if (p.bias)
      for (int c = 0; c < W; ++c) out[c] += p.bias[j + c];
  }
}

template <typename Weight>
void features(const LinearProblem& p, const Weight* weights, int64_t begin, int64_t end) {
  int64_t j = begin;
  for (; j + W <= end; j += W) {
    const Weight* w = weights + j * p.in;
    if constexpr (std::is_same_v<Weight, uint16_t>) {
      if (p.rows > 1) {
        block_rows(p, widened_block(w, W * p.in), w, j);
        continue;
      }
    }
    block_rows(p, w, w, j);
  }
  for (; j < end; ++j)
    for (int64_t r = 0; r < p.rows; ++r)
      p.out[r * p.features + j] = dot(p.x + r * p.x_stride, weights + j * p.in, p.in) + (p.bias ? p.bias[j] : 0.0f);
}

}  // namespace

void linear_features(const LinearProblem& p, int64_t begin, int64_t end) {
  if (p.w_bf16 != nullptr)
    features(p, p.w_bf16, begin, end);
  else
    features(p, p.w, begin, end);
}

}  // namespace scan_bridge
