// SIMD selective scan and state update for the CPU (see scan_kernel.h for the contract).
//
// The work is cut into items of (a block of W channels of one group, one batch row), W = the
// lanes of fp32 (fp64) in one vector of the target's width, and h is laid out per mode:
//  - sequence mode (seq > 1): lanes run over channels and h is [state][lanes] in L1. Each
//    timestep is then multiply-adds with B_t,n and C_t,n broadcast and no horizontal sum; an
//    item walks its whole sequence in one pass. Packed sequences (cu_seqlens) are batch rows
//    of their own, each walked from its first time in the one packed row.
//  - step mode (seq == 1, the state update): lanes run over the state and h keeps the pool's
//    own [channel][state] layout, updated where it lies; y takes one lane-sum tree per block.
//
// Inputs are first packed into small aligned fp32 (fp64) tiles, a chunk of timesteps (or one
// batch row) at a time: that one step absorbs every dtype (f16/bf16/f32/f64), both layouts, any
// strides and any byte misalignment, and applies dt's bias/softplus/clamp and z's gate once per
// (t, channel). The recurrence only reads aligned tiles; y is converted and stored per tile.
//
// Written with GCC vector extensions so it builds for any target, with vectors of the width
// the target executes (kVectorBytes): 64 bytes with AVX-512, 32 with AVX2, 16 otherwise (the
// baseline: SSE2, NEON). Where AVX-512 is present exp2 uses a register table and vscalef, and
// half-precision runs convert 16 values per instruction (8 with AVX2's F16C).

#include "scan_kernel.h"
#include "simd.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__))
#include <immintrin.h>
#endif

namespace scan_bridge {
namespace {

// Timesteps packed per pass. 32 keeps the tiles of a pass (x, dt, dt*x, gate, y: 32 x 64 B
// each; B and C: 32 x state values) within a 32 KiB L1 for state 16.
constexpr int kTimeChunk = 32;

// ---- element access at any byte offset -------------------------------------------------

struct BF16 {
  uint16_t bits;
};

// IEEE half precision: GCC's _Float16 on x86, Arm's __fp16 where C++ has no _Float16 (GCC 12).
#if defined(__aarch64__) || defined(__arm__)
using Half = __fp16;
#else
using Half = _Float16;
#endif

inline float widen(float v) { return v; }
inline double widen(double v) { return v; }
inline float widen(Half v) { return static_cast<float>(v); }
inline float widen(BF16 v) {
  uint32_t bits = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename Dst>
inline Dst narrow(float v) { return static_cast<Dst>(v); }
template <typename Dst>
inline Dst narrow(double v) { return static_cast<Dst>(v); }
// float -> bfloat16, round to nearest even; NaN stays a quiet NaN (as torch converts).
template <>
inline BF16 narrow<BF16>(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  if (std::isnan(v)) return BF16{static_cast<uint16_t>((bits >> 16) | 0x40)};
  bits += 0x7FFF + ((bits >> 16) & 1);
  return BF16{static_cast<uint16_t>(bits >> 16)};
}
template <>
inline BF16 narrow<BF16>(double v) { return narrow<BF16>(static_cast<float>(v)); }

template <typename T, typename Src>
inline T read_elem(const char* p) {
  Src v;
  std::memcpy(&v, p, sizeof v);
  return static_cast<T>(widen(v));
}

template <typename Dst, typename T>
inline void write_elem(char* p, T v) {
  Dst d = narrow<Dst>(v);
  std::memcpy(p, &d, sizeof d);
}

// out[i] = src[i] for i < count, src contiguous at any byte offset. Plain loops vectorize for
// every pair but half <-> float, which GCC 12 converts one element at a time; AVX-512 does 16.
// (Here and in exp2, the all-ones-mask "maskz" intrinsics only avoid GCC 12's false
// uninitialized warnings in the unmasked ones.)
template <typename T, typename Src>
inline void read_run(const char* src, int count, T* out) {
  int i = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float> && std::is_same_v<Src, Half>) {
    for (; i + 16 <= count; i += 16) {
      __m256i h;
      std::memcpy(&h, src + 2 * i, sizeof h);
      _mm512_storeu_ps(out + i, _mm512_maskz_cvtph_ps(0xFFFF, h));
    }
  }
#elif defined(__AVX2__) && defined(__F16C__)
  if constexpr (std::is_same_v<T, float> && std::is_same_v<Src, Half>) {
    for (; i + 8 <= count; i += 8) {
      __m128i h;
      std::memcpy(&h, src + 2 * i, sizeof h);
      _mm256_storeu_ps(out + i, _mm256_cvtph_ps(h));
    }
  }
#endif
  for (; i < count; ++i) out[i] = read_elem<T, Src>(src + i * sizeof(Src));
}

template <typename Dst, typename T>
inline void write_run(char* dst, int count, const T* in) {
  int i = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float> && std::is_same_v<Dst, Half>) {
    for (; i + 16 <= count; i += 16) {
      const __m256i h = _mm512_maskz_cvtps_ph(0xFFFF, _mm512_loadu_ps(in + i),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      std::memcpy(dst + 2 * i, &h, sizeof h);
    }
  }
#elif defined(__AVX2__) && defined(__F16C__)
  if constexpr (std::is_same_v<T, float> && std::is_same_v<Dst, Half>) {
    for (; i + 8 <= count; i += 8) {
      const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      std::memcpy(dst + 2 * i, &h, sizeof h);
    }
  }
#endif
  for (; i < count; ++i) write_elem<Dst>(dst + i * sizeof(Dst), in[i]);
}


// ---- strided tiles in and out ---------------------------------------------------------------

// out[r * out_stride + c] = src[r * sr + c * sc] for r < rows, c < cols (strides in elements).
// Contiguous rows are copied as runs; contiguous columns (sr == 1: the "bdl" layout, and h read
// as [state][channel]) go W x W blocks at a time through an in-register transpose; anything
// else element by element along the smaller stride.
template <typename T, typename Src>
void load_2d_typed(const char* base, int64_t sr, int64_t sc, int rows, int cols, T* out,
                   int out_stride) {
  using V = typename Lanes<T>::V;
  constexpr int W = Lanes<T>::W;
  constexpr int64_t E = sizeof(Src);
  if (sc == 1) {
    for (int r = 0; r < rows; ++r) read_run<T, Src>(base + r * sr * E, cols, out + r * out_stride);
    return;
  }
  int full_rows = 0, full_cols = 0;
  if (sr == 1) {
    full_rows = rows / W * W;
    full_cols = cols / W * W;
    for (int r0 = 0; r0 < full_rows; r0 += W) {
      for (int c0 = 0; c0 < full_cols; c0 += W) {
        V m[W];
        for (int c = 0; c < W; ++c)
          read_run<T, Src>(base + ((c0 + c) * sc + r0) * E, W, reinterpret_cast<T*>(&m[c]));
        Shuffles<T>::transpose(m);
        for (int r = 0; r < W; ++r) std::memcpy(out + (r0 + r) * out_stride + c0, &m[r], sizeof(V));
      }
    }
  }
  // What the blocks left: the columns past full_cols of the block rows, then the rows past them.
  const bool rows_inner = sr == 1 || std::llabs(sr) < std::llabs(sc);
  auto rest = [&](int r_begin, int r_end, int c_begin) {
    if (rows_inner) {
      for (int c = c_begin; c < cols; ++c)
        for (int r = r_begin; r < r_end; ++r)
          out[r * out_stride + c] = read_elem<T, Src>(base + (r * sr + c * sc) * E);
    } else {
      for (int r = r_begin; r < r_end; ++r)
        for (int c = c_begin; c < cols; ++c)
          out[r * out_stride + c] = read_elem<T, Src>(base + (r * sr + c * sc) * E);
    }
  };
  rest(0, full_rows, full_cols);
  rest(full_rows, rows, 0);
}

template <typename T>
void load_2d(const Strided& s, int64_t offset, int64_t sr, int64_t sc, int rows, int cols,
             T* out, int out_stride) {
  const char* base = static_cast<const char*>(s.data);
  switch (s.dtype) {
    case DType::f32:
      return load_2d_typed<T, float>(base + offset * 4, sr, sc, rows, cols, out, out_stride);
    case DType::f16:
      return load_2d_typed<T, Half>(base + offset * 2, sr, sc, rows, cols, out, out_stride);
    case DType::bf16:
      return load_2d_typed<T, BF16>(base + offset * 2, sr, sc, rows, cols, out, out_stride);
    case DType::f64:
      return load_2d_typed<T, double>(base + offset * 8, sr, sc, rows, cols, out, out_stride);
    case DType::i32:
    case DType::i64:
      break;  // integer operands (slots) are read with read_slot
  }
}

// dst[r * sr + c * sc] = in[r * in_stride + c]: the mirror of load_2d_typed.
template <typename Dst, typename T>
void store_2d_typed(char* base, int64_t sr, int64_t sc, int rows, int cols, const T* in,
                    int in_stride) {
  using V = typename Lanes<T>::V;
  constexpr int W = Lanes<T>::W;
  constexpr int64_t E = sizeof(Dst);
  if (sc == 1) {
    for (int r = 0; r < rows; ++r) write_run<Dst, T>(base + r * sr * E, cols, in + r * in_stride);
    return;
  }
  int full_rows = 0, full_cols = 0;
  if (sr == 1) {
    full_rows = rows / W * W;
    full_cols = cols / W * W;
    for (int r0 = 0; r0 < full_rows; r0 += W) {
      for (int c0 = 0; c0 < full_cols; c0 += W) {
        V m[W];
        for (int r = 0; r < W; ++r) std::memcpy(&m[r], in + (r0 + r) * in_stride + c0, sizeof(V));
        Shuffles<T>::transpose(m);
        for (int c = 0; c < W; ++c)
          write_run<Dst, T>(base + ((c0 + c) * sc + r0) * E, W, reinterpret_cast<const T*>(&m[c]));
      }
    }
  }
  const bool rows_inner = sr == 1 || std::llabs(sr) < std::llabs(sc);
  auto rest = [&](int r_begin, int r_end, int c_begin) {
    if (rows_inner) {
      for (int c = c_begin; c < cols; ++c)
        for (int r = r_begin; r < r_end; ++r)
          write_elem<Dst>(base + (r * sr + c * sc) * E, in[r * in_stride + c]);
    } else {
      for (int r = r_begin; r < r_end; ++r)
        for (int c = c_begin; c < cols; ++c)
          write_elem<Dst>(base + (r * sr + c * sc) * E, in[r * in_stride + c]);
    }
  };
  rest(0, full_rows, full_cols);
  rest(full_rows, rows, 0);
}

template <typename T>
void store_2d(const Strided& s, int64_t offset, int64_t sr, int64_t sc, int rows, int cols,
              const T* in, int in_stride) {
  char* base = static_cast<char*>(s.data);
  switch (s.dtype) {
    case DType::f32:
      return store_2d_typed<float>(base + offset * 4, sr, sc, rows, cols, in, in_stride);
    case DType::f16:
      return store_2d_typed<Half>(base + offset * 2, sr, sc, rows, cols, in, in_stride);
    case DType::bf16:
      return store_2d_typed<BF16>(base + offset * 2, sr, sc, rows, cols, in, in_stride);
    case DType::f64:
      return store_2d_typed<double>(base + offset * 8, sr, sc, rows, cols, in, in_stride);
    case DType::i32:
    case DType::i64:
      break;  // never an output dtype
  }
}

// Asks for the cache line `ahead` bytes past each of `rows` rows (element strides, from the
// element at `offset`) before it is read.
void prefetch_rows(const Strided& s, int64_t offset, int64_t sr, int rows, int64_t ahead) {
  static constexpr int kSize[] = {4, 2, 2, 8, 4, 8};  // DType's element sizes
  const int64_t E = kSize[static_cast<int>(s.dtype)];
  const char* base = static_cast<const char*>(s.data) + offset * E + ahead;
  for (int r = 0; r < rows; ++r) __builtin_prefetch(base + r * sr * E);
}

int64_t read_slot(const Strided& s, int64_t b) {
  const char* p = static_cast<const char*>(s.data);
  if (s.dtype == DType::i32) {
    int32_t v;
    std::memcpy(&v, p + b * s.stride[0] * 4, sizeof v);
    return v;
  }
  int64_t v;
  std::memcpy(&v, p + b * s.stride[0] * 8, sizeof v);
  return v;
}


// ---- what both modes share ------------------------------------------------------------------

// Channels are cut into blocks of W lanes within each group, so a block never straddles two
// groups and B, C are the same for all its lanes; the last block of a group may be partial.
template <typename T>
struct Blocks {
  static constexpr int W = Lanes<T>::W;
  int64_t per_group, per_group_blocks, count;

  explicit Blocks(const ScanProblem& p)
      : per_group(p.dim / p.groups),
        per_group_blocks((per_group + W - 1) / W),
        count(p.groups * per_group_blocks) {}
  int64_t group(int64_t block) const { return block / per_group_blocks; }
  int64_t first_channel(int64_t block) const {
    return group(block) * per_group + (block % per_group_blocks) * W;
  }
  int lanes(int64_t block) const {
    return static_cast<int>(std::min<int64_t>(W, per_group - (block % per_group_blocks) * W));
  }
};

// dt <- clamp(softplus(dt + bias)); dtx <- dt * x; then dt is kept times Math<T>::kDecayScale,
// the form Math<T>::decay takes. In place over `count` vectors; `bias` advances by `bias_step`
// vectors per vector (0: one bias for all).
template <typename T>
void discretize(const ScanProblem& p, int count, typename Lanes<T>::V* dt,
                const typename Lanes<T>::V* x, typename Lanes<T>::V* dtx,
                const typename Lanes<T>::V* bias, int bias_step) {
  using V = typename Lanes<T>::V;
  const T lo = static_cast<T>(p.dt_min), hi = static_cast<T>(p.dt_max);
  for (int i = 0; i < count; ++i) {
    V d = dt[i] + bias[i * bias_step];
    if (p.dt_softplus) d = Math<T>::softplus(d);
    // Comparisons are false for NaN, so NaN passes through as in torch.clamp.
    if (p.has_dt_min) d = d < lo ? lo : d;
    if (p.has_dt_max) d = d > hi ? hi : d;
    dtx[i] = d * x[i];
    dt[i] = d * Math<T>::kDecayScale;
  }
}


// ---- sequence mode (seq > 1): lanes over channels ------------------------------------------

// h <- exp(dt A) h + (dt x) B_t ; y_t = C_t . h, for t < steps, with dts as discretize leaves
// them. h and A are [state] vectors of channel lanes (in L1); B_t, C_t scalars are broadcast.
template <typename T>
void recur_chunk(int steps, int64_t N, const typename Lanes<T>::V* __restrict A,
                 typename Lanes<T>::V* __restrict h, const typename Lanes<T>::V* __restrict dts,
                 const typename Lanes<T>::V* __restrict dtx, const T* __restrict Bs,
                 const T* __restrict Cs, typename Lanes<T>::V* __restrict ys) {
  using V = typename Lanes<T>::V;
  for (int t = 0; t < steps; ++t) {
    const V d = dts[t];
    const V u = dtx[t];
    const T* Bt = Bs + t * N;
    const T* Ct = Cs + t * N;
    // Two accumulators halve the dependency chain of the C . h sum.
    V acc0 = {}, acc1 = {};
    int64_t n = 0;
    for (; n + 1 < N; n += 2) {
      h[n] = Math<T>::decay(d, A[n]) * h[n] + u * Bt[n];
      acc0 += h[n] * Ct[n];
      h[n + 1] = Math<T>::decay(d, A[n + 1]) * h[n + 1] + u * Bt[n + 1];
      acc1 += h[n + 1] * Ct[n + 1];
    }
    if (n < N) {
      h[n] = Math<T>::decay(d, A[n]) * h[n] + u * Bt[n];
      acc0 += h[n] * Ct[n];
    }
    ys[t] = acc0 + acc1;
  }
}

// With 64-byte vectors items are ordered block-major (item = block * batch + b), so a thread's
// consecutive items share a block and its A, D, dt_bias are prepared once. With narrower ones
// (kRowMajor) a cache line of x, dt, z and y holds several blocks' channels, and items are
// ordered row-major (item = b * blocks + block), as in step mode: consecutive items walk a
// batch row's lines in order, each line read once, and every block's A, D, dt_bias is prepared
// once per thread. h is kept as [state][channel lanes]:
// each timestep is then pure multiply-adds with B and C broadcast, and loading and storing h
// transposes it once per item.
template <typename T>
class SequenceRunner {
  using V = typename Lanes<T>::V;
  static constexpr int W = Lanes<T>::W;
  static constexpr bool kRowMajor = kVectorBytes < kScratchAlign;

 public:
  explicit SequenceRunner(const ScanProblem& p)
      : p_(p), blocks_(p), N_(p.state), N_int_(static_cast<int>(p.state)),
        slots_(kRowMajor ? blocks_.count : 1),
        scratch_(Scratch::bytes<V>(slots_ * p.state) + Scratch::bytes<V>(p.state) +
                 2 * Scratch::bytes<V>(slots_) + 5 * Scratch::bytes<V>(kTimeChunk) +
                 2 * Scratch::bytes<T>(kTimeChunk * p.state)),
        prepared_block_(slots_, -1) {
    A_ = scratch_.take<V>(slots_ * N_);
    h_ = scratch_.take<V>(N_);
    D_ = scratch_.take<V>(slots_);
    bias_ = scratch_.take<V>(slots_);
    xs_ = scratch_.take<V>(kTimeChunk);
    dts_ = scratch_.take<V>(kTimeChunk);
    dtx_ = scratch_.take<V>(kTimeChunk);
    gate_ = scratch_.take<V>(kTimeChunk);
    ys_ = scratch_.take<V>(kTimeChunk);
    Bs_ = scratch_.take<T>(kTimeChunk * N_);
    Cs_ = scratch_.take<T>(kTimeChunk * N_);
  }

  void run_range(int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) run(item);
  }

  void run(int64_t item) {
    const int64_t b = kRowMajor ? item / blocks_.count : item % p_.batch;
    const int64_t block = kRowMajor ? item % blocks_.count : item / p_.batch;
    const int64_t g = blocks_.group(block);
    const int64_t d0 = blocks_.first_channel(block);
    const int lanes = blocks_.lanes(block);
    const int64_t slot = kRowMajor ? block : 0;
    if (block != prepared_block_[slot]) {
      prepare_block(slot, d0, lanes);
      prepared_block_[slot] = block;
    }
    slot_ = slot;
    const int64_t state_row = p_.slots.data != nullptr ? read_slot(p_.slots, b) : b;
    if (p_.h0.data == nullptr || lanes < W) std::memset(static_cast<void*>(h_), 0, N_ * sizeof(V));
    if (p_.h0.data != nullptr) {
      const auto& s = p_.h0.stride;
      load_2d(p_.h0, state_row * s[0] + d0 * s[1], s[2], s[1], N_int_, lanes, reinterpret_cast<T*>(h_), W);
    }
    // Packed sequences share row 0 of the operands, each from its own first time.
    const int64_t row = p_.cu_seqlens == nullptr ? b : 0;
    const int64_t first = p_.cu_seqlens == nullptr ? 0 : p_.cu_seqlens[b];
    const int64_t end = p_.cu_seqlens == nullptr ? p_.seq : p_.cu_seqlens[b + 1];
    for (int64_t t0 = first; t0 < end; t0 += kTimeChunk) {
      const int steps = static_cast<int>(std::min<int64_t>(kTimeChunk, end - t0));
      pack_chunk(row, g, t0, steps, d0, lanes);
      recur_chunk<T>(steps, N_, A_ + slot * N_, h_, dts_, dtx_, Bs_, Cs_, ys_);
      finish_chunk(row, t0, steps, d0, lanes);
    }
    if (p_.state_out.data != nullptr) {
      const auto& s = p_.state_out.stride;
      store_2d(p_.state_out, state_row * s[0] + d0 * s[1], s[2], s[1], N_int_, lanes,
               reinterpret_cast<const T*>(h_), W);
    }
  }

 private:
  // A as [state][lanes]; D and dt_bias as lanes; in the block's slot.
  void prepare_block(int64_t slot, int64_t d0, int lanes) {
    V* A = A_ + slot * N_;
    std::memset(static_cast<void*>(A), 0, N_ * sizeof(V));
    const auto& sa = p_.A.stride;
    load_2d(p_.A, d0 * sa[0], sa[1], sa[0], N_int_, lanes, reinterpret_cast<T*>(A), W);
    D_[slot] = V{};
    if (p_.D.data != nullptr)
      load_2d(p_.D, d0 * p_.D.stride[0], 0, p_.D.stride[0], 1, lanes, reinterpret_cast<T*>(D_ + slot), W);
    bias_[slot] = V{};
    if (p_.dt_bias.data != nullptr)
      load_2d(p_.dt_bias, d0 * p_.dt_bias.stride[0], 0, p_.dt_bias.stride[0], 1, lanes,
              reinterpret_cast<T*>(bias_ + slot), W);
  }

  // x, discretized dt, dt * x and silu(z) as [t][channel lanes] tiles, and B, C as [t][state]
  // rows, for timesteps t0 .. t0 + steps of batch row b.
  void pack_chunk(int64_t b, int64_t g, int64_t t0, int steps, int64_t d0, int lanes) {
    if (lanes < W) {
      // Keep the unused lanes at zero rather than at a previous block's values.
      for (int t = 0; t < steps; ++t) xs_[t] = dts_[t] = gate_[t] = V{};
    }
    const auto& sx = p_.x.stride;
    load_2d(p_.x, b * sx[0] + t0 * sx[1] + d0 * sx[2], sx[1], sx[2], steps, lanes,
            reinterpret_cast<T*>(xs_), W);
    const auto& sd = p_.dt.stride;
    load_2d(p_.dt, b * sd[0] + t0 * sd[1] + d0 * sd[2], sd[1], sd[2], steps, lanes,
            reinterpret_cast<T*>(dts_), W);
    if (kRowMajor && sx[2] == 1 && sd[2] == 1) {
      // The next line of these rows ("bld": channels contiguous), which the next blocks of the
      // row read.
      prefetch_rows(p_.x, b * sx[0] + t0 * sx[1] + d0, sx[1], steps, kScratchAlign);
      prefetch_rows(p_.dt, b * sd[0] + t0 * sd[1] + d0, sd[1], steps, kScratchAlign);
      const auto& sz = p_.z.stride;
      if (p_.z.data != nullptr && sz[2] == 1)
        prefetch_rows(p_.z, b * sz[0] + t0 * sz[1] + d0, sz[1], steps, kScratchAlign);
    }
    discretize<T>(p_, steps, dts_, xs_, dtx_, bias_ + slot_, 0);
    if (p_.z.data != nullptr) {
      const auto& sz = p_.z.stride;
      load_2d(p_.z, b * sz[0] + t0 * sz[1] + d0 * sz[2], sz[1], sz[2], steps, lanes,
              reinterpret_cast<T*>(gate_), W);
      for (int t = 0; t < steps; ++t) gate_[t] = Math<T>::silu(gate_[t]);
    }
    const auto& sB = p_.B.stride;
    load_2d(p_.B, b * sB[0] + t0 * sB[1] + g * sB[2], sB[1], sB[3], steps, N_int_, Bs_, N_int_);
    const auto& sC = p_.C.stride;
    load_2d(p_.C, b * sC[0] + t0 * sC[1] + g * sC[2], sC[1], sC[3], steps, N_int_, Cs_, N_int_);
  }

  void finish_chunk(int64_t b, int64_t t0, int steps, int64_t d0, int lanes) {
    if (p_.D.data != nullptr) {
      const V D = D_[slot_];
      for (int t = 0; t < steps; ++t) ys_[t] += D * xs_[t];
    }
    if (p_.z.data != nullptr)
      for (int t = 0; t < steps; ++t) ys_[t] *= gate_[t];
    const auto& sy = p_.y.stride;
    store_2d(p_.y, b * sy[0] + t0 * sy[1] + d0 * sy[2], sy[1], sy[2], steps, lanes,
             reinterpret_cast<const T*>(ys_), W);
    if (kRowMajor && sy[2] == 1) {
      // The next line of these rows of y, which the next blocks of the row write: fetched for
      // writing now rather than when the store reaches it.
      const char* next = static_cast<const char*>(p_.y.data) + (b * sy[0] + t0 * sy[1] + d0) * sizeof(T) +
                         kScratchAlign;
      for (int r = 0; r < steps; ++r) __builtin_prefetch(next + r * sy[1] * sizeof(T), 1);
    }
  }

  const ScanProblem& p_;
  const Blocks<T> blocks_;
  const int64_t N_;
  const int N_int_;
  const int64_t slots_;  // blocks whose A, D, dt_bias are kept: every one (kRowMajor) or one
  Scratch scratch_;
  std::vector<int64_t> prepared_block_;  // per slot: the block whose A, D, dt_bias it holds
  int64_t slot_ = 0;                     // the running item's
  V *A_, *h_, *D_, *bias_, *xs_, *dts_, *dtx_, *gate_, *ys_;
  T *Bs_, *Cs_;
};

// ---- step mode (seq == 1, the state update): lanes over the state axis ----------------------


// One timestep for the `lanes` channels of a block. Channel c's state row is `vecs` vectors at
// h + c * h_stride and its A row `vecs` vectors at A + c * A_stride (any alignment), padded
// with zeros in A, B, C (and h) past the state size;
// dt[c] (as discretize leaves it) and dtx[c] are its scalars (read as broadcast operands). Returns y (before D and z)
// with channel c in lane c. kFullVecs > 0 instantiates the common full block of W channels whose
// state is kFullVecs vectors, fully unrolled so the W accumulators stay in registers. kPadded:
// the last vector has lanes past the state (`state` says how many are real), whose B padding
// times dt x is NaN where dt x is infinite (0 * inf); y sums only the real lanes of it, as the
// reference's y is that infinity there.
template <typename T, int kFullVecs, bool kPadded>
typename Lanes<T>::V step_block(int lanes, int64_t vecs, int64_t state, const T* __restrict A, int64_t A_stride,
                                T* __restrict h, int64_t h_stride, const T* __restrict dt,
                                const T* __restrict dtx, const typename Lanes<T>::V* __restrict B,
                                const typename Lanes<T>::V* __restrict C) {
  using V = typename Lanes<T>::V;
  using VU = typename Lanes<T>::Unaligned;
  constexpr int W = Lanes<T>::W;
  if constexpr (kFullVecs > 0) vecs = kFullVecs;
  V acc[W];
  for (int c = 0; c < W; ++c) acc[c] = V{};
  V lane{};
  for (int i = 0; i < W; ++i) lane[i] = static_cast<T>(i);
  [[maybe_unused]] const auto real = lane < static_cast<T>(state - (vecs - 1) * W);
  auto decay = [&](int c, int64_t k) __attribute__((always_inline)) {
    return Math<T>::decay(Lanes<T>::splat(dt[c]), *reinterpret_cast<const VU*>(A + c * A_stride + k * W));
  };
  // Channel c's state vector k decayed and given its input; y's sum for the channel.
  auto update = [&](int c, int64_t k, V a) __attribute__((always_inline)) {
    VU* hp = reinterpret_cast<VU*>(h + c * h_stride + k * W);
    const V hk = a * V(*hp) + B[k] * dtx[c];
    *hp = hk;
    const V term = hk * C[k];
    if constexpr (kPadded)
      acc[LaneSums<T>::kSlot[c]] += k == vecs - 1 ? (real ? term : V{}) : term;
    else
      acc[LaneSums<T>::kSlot[c]] += term;
  };
  if constexpr (kFullVecs > 0 && kVectorBytes == 32) {
    // AVX2's sixteen registers cannot hold exp's constants and the W accumulators at once (the
    // accumulators, B and C spilled): every decay of the block first, then the updates.
    V decays[W * kFullVecs];
#pragma GCC unroll 16
    for (int c = 0; c < W; ++c)
      for (int k = 0; k < kFullVecs; ++k) decays[c * kFullVecs + k] = decay(c, k);
#pragma GCC unroll 16
    for (int c = 0; c < W; ++c)
      for (int k = 0; k < kFullVecs; ++k) update(c, k, decays[c * kFullVecs + k]);
  } else if constexpr (kFullVecs > 0) {
#pragma GCC unroll 16
    for (int c = 0; c < W; ++c)
      for (int k = 0; k < kFullVecs; ++k) update(c, k, decay(c, k));
  } else {
    for (int c = 0; c < lanes; ++c)
      for (int64_t k = 0; k < vecs; ++k) update(c, k, decay(c, k));
  }
  return LaneSums<T>::of(acc);
}

// Items are ordered row-major (item = b * blocks + block), so a thread's consecutive items
// share a batch row, whose x, dt, z, B and C are packed once for all blocks, and walk the state
// pool row sequentially. h is kept in the state's own [channel][state] layout and is updated
// where it lies when the state pool is in the compute dtype with a contiguous, vector-multiple
// state axis (the server's pool); otherwise through a padded copy.
template <typename T>
class StepRunner {
  using V = typename Lanes<T>::V;
  static constexpr int W = Lanes<T>::W;
  static constexpr DType kDType = sizeof(T) == 4 ? DType::f32 : DType::f64;
  // Vectors per state row of the unrolled path: 64 bytes (fp32 state 16) with AVX-512 and AVX2;
  // the baseline's sixteen registers hold one vector a row (unrolled over four, it was slower).
  static constexpr int kFullVecs = kVectorBytes == 32 ? 2 : 1;

 public:
  explicit StepRunner(const ScanProblem& p)
      : p_(p), blocks_(p), N_(p.state), N_int_(static_cast<int>(p.state)), vecs_((p.state + W - 1) / W),
        in_place_(p.h0.data != nullptr && p.h0.data == p.state_out.data && p.h0.dtype == kDType &&
                  p.h0.stride[2] == 1 && p.state % W == 0),
        A_direct_(p.A.dtype == kDType && p.A.stride[1] == 1 && p.state % W == 0),
        y_direct_(p.y.dtype == kDType && p.y.stride[2] == 1),
        scratch_(Scratch::bytes<V>(blocks_.count * W * vecs_) + 6 * Scratch::bytes<V>(blocks_.count) +
                 2 * Scratch::bytes<V>(p.groups * vecs_) + Scratch::bytes<V>(W * vecs_)),
        prepared_(blocks_.count, 0) {
    A_ = scratch_.take<V>(blocks_.count * W * vecs_);
    D_ = scratch_.take<V>(blocks_.count);
    bias_ = scratch_.take<V>(blocks_.count);
    xs_ = scratch_.take<V>(blocks_.count);
    dts_ = scratch_.take<V>(blocks_.count);
    dtx_ = scratch_.take<V>(blocks_.count);
    gate_ = scratch_.take<V>(blocks_.count);
    Bs_ = scratch_.take<V>(p.groups * vecs_);
    Cs_ = scratch_.take<V>(p.groups * vecs_);
    h_ = scratch_.take<V>(W * vecs_);
    // D and dt_bias for every block, laid out like the packed rows (group-padded).
    for (int64_t g = 0; g < p_.groups; ++g) {
      const int64_t at = g * blocks_.per_group_blocks;
      if (p_.D.data != nullptr)
        load_2d(p_.D, g * blocks_.per_group * p_.D.stride[0], 0, p_.D.stride[0], 1,
                static_cast<int>(blocks_.per_group), reinterpret_cast<T*>(D_ + at), 0);
      if (p_.dt_bias.data != nullptr)
        load_2d(p_.dt_bias, g * blocks_.per_group * p_.dt_bias.stride[0], 0, p_.dt_bias.stride[0], 1,
                static_cast<int>(blocks_.per_group), reinterpret_cast<T*>(bias_ + at), 0);
    }
  }

  // Items begin .. end - 1, walked with running (row, block) counters rather than divisions
  // per item: an item (W channels of one row: 16 vectors for a state of 16) is too little work
  // to carry them (docs/performance.md, "step run range").
  void run_range(int64_t begin, int64_t end) {
    int64_t b = begin / blocks_.count;
    int64_t block = begin % blocks_.count;
    for (int64_t item = begin; item < end; ++item) {
      run(b, block);
      if (++block == blocks_.count) {
        block = 0;
        ++b;
      }
    }
  }

 private:
  void run(int64_t b, int64_t block) {
    const int64_t g = blocks_.group(block);
    const int64_t d0 = blocks_.first_channel(block);
    const int lanes = blocks_.lanes(block);
    const auto& sy = p_.y.stride;
    // The pool row: slots[b] (negative = padding row), or b itself.
    const int64_t row = p_.slots.data != nullptr ? read_slot(p_.slots, b) : b;
    if (row < 0) {
      const V zero = {};
      store_2d(p_.y, b * sy[0] + d0 * sy[2], 0, sy[2], 1, lanes, reinterpret_cast<const T*>(&zero), W);
      return;
    }
    if (b != packed_row_) {
      pack_row(b);
      packed_row_ = b;
    }
    T* h = reinterpret_cast<T*>(h_);
    int64_t h_stride = vecs_ * W;
    const auto& si = p_.h0.stride;
    if (in_place_) {
      h = static_cast<T*>(p_.h0.data) + row * si[0] + d0 * si[1];
      h_stride = si[1];
    } else {
      // The copy's padding lanes past the state are zeroed for every item: step_block steps them
      // too, and a NaN or inf dt x leaves NaN there (0 * NaN), which later items' y would sum.
      const int64_t loaded = p_.h0.data != nullptr ? N_ : 0;
      if (loaded < h_stride)
        for (int c = 0; c < lanes; ++c)
          std::memset(static_cast<void*>(h + c * h_stride + loaded), 0, (h_stride - loaded) * sizeof(T));
      if (p_.h0.data != nullptr)
        load_2d(p_.h0, row * si[0] + d0 * si[1], si[1], si[2], lanes, N_int_, h, static_cast<int>(h_stride));
    }
    const T* A = reinterpret_cast<const T*>(A_ + block * W * vecs_);
    int64_t A_stride = vecs_ * W;
    if (A_direct_) {
      A = static_cast<const T*>(p_.A.data) + d0 * p_.A.stride[0];
      A_stride = p_.A.stride[0];
    } else if (!prepared_[block]) {
      prepare_A(block, d0, lanes);
      prepared_[block] = 1;
    }
    const T* dt = reinterpret_cast<const T*>(dts_ + block);
    const T* dtx = reinterpret_cast<const T*>(dtx_ + block);
    const V* Bg = Bs_ + g * vecs_;
    const V* Cg = Cs_ + g * vecs_;
    const bool full = lanes == W && vecs_ == kFullVecs, padded = N_ % W != 0;
    V y;
    if (full && !padded)
      y = step_block<T, kFullVecs, false>(lanes, vecs_, N_, A, A_stride, h, h_stride, dt, dtx, Bg, Cg);
    else if (full)
      y = step_block<T, kFullVecs, true>(lanes, vecs_, N_, A, A_stride, h, h_stride, dt, dtx, Bg, Cg);
    else if (!padded)
      y = step_block<T, 0, false>(lanes, vecs_, N_, A, A_stride, h, h_stride, dt, dtx, Bg, Cg);
    else
      y = step_block<T, 0, true>(lanes, vecs_, N_, A, A_stride, h, h_stride, dt, dtx, Bg, Cg);
    if (!in_place_ && p_.state_out.data != nullptr) {
      const auto& so = p_.state_out.stride;
      store_2d(p_.state_out, row * so[0] + d0 * so[1], so[1], so[2], lanes, N_int_, h,
               static_cast<int>(h_stride));
    }
    if (p_.D.data != nullptr) y += D_[block] * xs_[block];
    if (p_.z.data != nullptr) y *= gate_[block];
    if (y_direct_ && lanes == W) {
      *reinterpret_cast<typename Lanes<T>::Unaligned*>(static_cast<char*>(p_.y.data) + (b * sy[0] + d0) * sizeof(T)) = y;
    } else {
      store_2d(p_.y, b * sy[0] + d0 * sy[2], 0, sy[2], 1, lanes, reinterpret_cast<const T*>(&y), W);
    }
  }

  // The block's A as [lanes][padded state]; zero past the state.
  void prepare_A(int64_t block, int64_t d0, int lanes) {
    T* A = reinterpret_cast<T*>(A_ + block * W * vecs_);
    const auto& sa = p_.A.stride;
    load_2d(p_.A, d0 * sa[0], sa[0], sa[1], lanes, N_int_, A, static_cast<int>(vecs_ * W));
  }

  // Row b of x, discretized dt, dt * x, silu(z) for every block, and B, C for every group. A
  // group's channels land block after block; lanes past a group's end keep their zeros.
  void pack_row(int64_t b) {
    const int cols = static_cast<int>(blocks_.per_group);
    for (int64_t g = 0; g < p_.groups; ++g) {
      const int64_t c0 = g * blocks_.per_group;
      const int64_t at = g * blocks_.per_group_blocks;
      load_2d(p_.x, b * p_.x.stride[0] + c0 * p_.x.stride[2], 0, p_.x.stride[2], 1, cols,
              reinterpret_cast<T*>(xs_ + at), 0);
      load_2d(p_.dt, b * p_.dt.stride[0] + c0 * p_.dt.stride[2], 0, p_.dt.stride[2], 1, cols,
              reinterpret_cast<T*>(dts_ + at), 0);
      if (p_.z.data != nullptr)
        load_2d(p_.z, b * p_.z.stride[0] + c0 * p_.z.stride[2], 0, p_.z.stride[2], 1, cols,
                reinterpret_cast<T*>(gate_ + at), 0);
      load_2d(p_.B, b * p_.B.stride[0] + g * p_.B.stride[2], 0, p_.B.stride[3], 1, N_int_,
              reinterpret_cast<T*>(Bs_ + g * vecs_), 0);
      load_2d(p_.C, b * p_.C.stride[0] + g * p_.C.stride[2], 0, p_.C.stride[3], 1, N_int_,
              reinterpret_cast<T*>(Cs_ + g * vecs_), 0);
    }
    const int count = static_cast<int>(blocks_.count);
    discretize<T>(p_, count, dts_, xs_, dtx_, bias_, 1);
    if (p_.z.data != nullptr)
      for (int i = 0; i < count; ++i) gate_[i] = Math<T>::silu(gate_[i]);
  }

  const ScanProblem& p_;
  const Blocks<T> blocks_;
  const int64_t N_;
  const int N_int_;
  const int64_t vecs_;  // vectors per (zero-padded) state row
  const bool in_place_;
  const bool A_direct_;  // A read where it lies (as the state); else copied per block, padded
  const bool y_direct_;  // a full block's y stored where it lies as one vector, not via store_2d
  Scratch scratch_;
  std::vector<char> prepared_;  // per block: A copied
  int64_t packed_row_ = -1;
  V *A_, *D_, *bias_, *xs_, *dts_, *dtx_, *gate_, *Bs_, *Cs_, *h_;
};

template <typename T>
void run_queue(const ScanProblem& p, WorkQueue& queue, int seat) {
  auto drain = [&](auto& runner) {
    int64_t begin, end;
    while (queue.take(seat, &begin, &end)) runner.run_range(begin, end);
  };
  if (p.seq == 1) {
    StepRunner<T> runner(p);
    drain(runner);
  } else {
    SequenceRunner<T> runner(p);
    drain(runner);
  }
}

}  // namespace

// The runners decode items with the same Blocks, so the count cannot drift from theirs.
int64_t work_items(const ScanProblem& p) {
  return p.batch * (p.compute_f64 ? Blocks<double>(p).count : Blocks<float>(p).count);
}

int64_t work_per_item(const ScanProblem& p) {
  return steps_per_row(p.seq, p.batch, p.cu_seqlens) * (p.compute_f64 ? Lanes<double>::W : Lanes<float>::W) * p.state;
}

void run_items(const ScanProblem& p, WorkQueue& queue, int seat) {
  if (p.compute_f64) {
    run_queue<double>(p, queue, seat);
  } else {
    run_queue<float>(p, queue, seat);
  }
}

void silu_in_place(float* values, int64_t count) {
  using V = Lanes<float>::V;
  using VU = Lanes<float>::Unaligned;
  constexpr int W = Lanes<float>::W;
  int64_t i = 0;
  for (; i + W <= count; i += W) {
    VU* v = reinterpret_cast<VU*>(values + i);
    *v = Math<float>::silu(V(*v));
  }
  // The tail through the same vector math, zero-padded: a value's silu must not depend on where
  // it falls, or a row's result would change with the rows a pass holds beside it.
  if (i < count) {
    alignas(64) float tail[W] = {};
    std::copy(values + i, values + count, tail);
    VU* v = reinterpret_cast<VU*>(tail);
    *v = Math<float>::silu(V(*v));
    std::copy(tail, tail + (count - i), values + i);
  }
}

const char* simd_description() {
#if defined(__AVX512F__)
  return "avx512 (64-byte vectors)";
#elif defined(__AVX2__)
  return "avx2 (32-byte vectors)";
#elif defined(__ARM_NEON)
  return "baseline (16-byte vectors, neon)";
#else
  return "baseline (16-byte vectors, generic)";
#endif
}

}  // namespace scan_bridge
