// SIMD building blocks shared by the CPU kernels' translation units (scan_kernel.cpp,
// scan_backward.cpp): the target's vector width, lanes as GCC vector extensions, compile-time
// lane shuffles and lane sums, the vector math (exp2, decay, softplus, silu, sigmoid), and
// aligned scratch. Everything is internal to each including file (an unnamed namespace).
#pragma once

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <type_traits>
#include <utility>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__))
#include <immintrin.h>
#endif

namespace scan_bridge {
namespace {

// Narrower targets get vectors they execute whole: wider ones, split by the compiler into
// several registers, double the live registers of every loop and spill the state.
#if defined(__AVX512F__)
constexpr int kVectorBytes = 64;
#elif defined(__AVX2__)
constexpr int kVectorBytes = 32;
#else
constexpr int kVectorBytes = 16;
#endif
// Scratch regions start on their own cache lines, whatever the vector width.
constexpr int kScratchAlign = 64;

template <typename T>
struct Lanes {
  typedef T V __attribute__((vector_size(kVectorBytes)));
  // V at any address, aliasing the T it is read from or written over (the state pool, A, y).
  typedef T Unaligned __attribute__((vector_size(kVectorBytes), aligned(1), may_alias));
  static constexpr int W = kVectorBytes / sizeof(T);
  // x in every lane, as one broadcast (a load from memory where x is). x - 0 is x for every
  // x, so the compiler drops the subtraction; x + 0 is not (-0 + 0 = +0), so `x + V{}` costs a
  // scalar add before the broadcast, and GCC 12 turns a lane-by-lane fill into 16 masked
  // broadcasts.
  static inline V splat(T x) { return x - V{}; }
};

// ---- lane shuffles ------------------------------------------------------------------------

// Two-input lane shuffles with compile-time masks. A mask lane holds the lane of (a, b) it
// takes: a's lanes are 0..W-1, b's W..2W-1. GCC picks the instruction from the pattern.
template <typename T>
struct Shuffles {
  using V = typename Lanes<T>::V;
  static constexpr int W = Lanes<T>::W;
  typedef std::conditional_t<sizeof(T) == 4, int32_t, int64_t> I;
  typedef I M __attribute__((vector_size(kVectorBytes)));

  template <typename Source, size_t... Is>
  static constexpr M mask(std::index_sequence<Is...>) {
    return M{static_cast<I>(Source::lane(static_cast<int>(Is)))...};
  }
  template <typename Source>
  static inline V apply(V a, V b) {
    constexpr M m = mask<Source>(std::make_index_sequence<W>());
    return __builtin_shuffle(a, b, m);
  }

  // Block transposition at stage H: per 2H-lane block, `low` = the first H lanes of a then the
  // first H lanes of b, `high` = the last H lanes of a then the last H lanes of b.
  template <int H, bool kHigh>
  struct Interleave {
    static constexpr int lane(int i) {
      const int base = i / (2 * H) * (2 * H), j = i % (2 * H), shift = kHigh ? H : 0;
      return j < H ? base + j + shift : W + base + j - H + shift;
    }
  };

  // m[r] becomes column r of the W x W matrix whose rows were m[0..W).
  template <int H = W / 2>
  static void transpose(V* m) {
    for (int i = 0; i < W; ++i) {
      if (i & H) continue;
      const V a = m[i], b = m[i + H];
      m[i] = apply<Interleave<H, false>>(a, b);
      m[i + H] = apply<Interleave<H, true>>(a, b);
    }
    if constexpr (H > 1) transpose<H / 2>(m);
  }
};

// ---- vector math ----------------------------------------------------------------------

template <typename T>
struct Math;

template <>
struct Math<float> {
  using V = Lanes<float>::V;
  static constexpr float kLog2e = 1.4426950408889634f;

  // 2^t.
#if defined(__AVX512F__)
  // 2^t = 2^n * 2^(j/16) * 2^r with t = n + j/16 + r, |r| <= 1/32: the 16 values 2^(j/16) sit
  // in one register (vpermps picks them by the low bits of t + 1.5 * 2^19, which is t rounded
  // to 1/16), 2^r is a degree-3 polynomial fitted for minimax relative error (1.6e-9), and
  // vscalef applies 2^floor(n + j/16) = 2^n over the whole range (overflow to inf, underflow
  // to 0, NaN through). 1.1e-7 relative error at most, unbiased but for the table's rounding.
  // Fewer multiply-adds than a polynomial over [-0.5, 0.5]: those pipes bound the kernels.
  // For |t| < 1/32, q = 1 + t p(t) exactly as computed, so decays close to 1 (long memories)
  // keep their full precision.
  static inline V exp2(V t) {
    const __m512 table = _mm512_setr_ps(
        1.0f, 1.0442737340927124f, 1.0905077457427979f, 1.1387885808944702f, 1.1892070770263672f,
        1.2418577671051025f, 1.2968395948410034f, 1.3542555570602417f, 1.4142135381698608f,
        1.4768261909484863f, 1.5422108173370361f, 1.610490322113037f, 1.6817928552627563f,
        1.7562521696090698f, 1.8340080976486206f, 1.9152065515518188f);
    constexpr float kShift = 786432.0f;  // 1.5 * 2^19: its ulp is 1/16
    const V s = t + kShift;
    const V k = s - kShift;  // n + j/16
    const V r = t - k;
    const V T = _mm512_permutexvar_ps(_mm512_castps_si512(s), table);
    const V p = (0.055502135306596756f * r + 0.24023428559303284f) * r + 0.6931471824645996f;
    return _mm512_maskz_scalef_ps(0xFFFF, T + (T * r) * p, k);
  }
#else
  // Degree-5 polynomial for 2^f on f in [-0.5, 0.5], fitted for minimax relative error (1.7e-7
  // at most evaluated in fp32, -2e-8 on average), times 2^round(t) built in the exponent bits.
  // p(0) = 1 and f = t for |t| < 0.5, so decays close to 1 keep their full precision.
  static inline V exp2(V t) {
    constexpr float c1 = 0.6931470036506653f, c2 = 0.24022242426872253f,
                    c3 = 0.05550733953714371f, c4 = 0.009671509265899658f,
                    c5 = 0.0013264698209241033f;
    typedef int32_t VI __attribute__((vector_size(kVectorBytes)));
    // Clamp so 2^n is 0 (n = -127: its exponent field is 0), a normal float or inf, NaN passing
    // through: below 2^-126.5 the result is 0, as exp's underflow is (a clamp at -126 left
    // 2^-126, so a decay to 0 kept a trace of a huge state, and 0 times inf was not NaN).
#if defined(__AVX2__)
    // One vmaxps and one vminps, where GCC makes a compare and a blend of each comparison
    // below; they return their second operand when either is NaN.
    t = _mm256_min_ps(_mm256_set1_ps(128.0f), _mm256_max_ps(_mm256_set1_ps(-127.0f), t));
#else
    // Comparisons are false for NaN.
    t = t < -127.0f ? -127.0f : t;
    t = t > 128.0f ? 128.0f : t;
#endif
    // Adding 1.5 * 2^23 + 127 rounds t to an integer whose low mantissa bits hold n + 127, the
    // biased exponent of 2^n: shifted into the exponent field, they are 2^n.
    constexpr float kShift = 12582912.0f + 127.0f;
    const V s = t + kShift;
    const V n = s - kShift;
    const V f = t - n;
    const V p = (((((c5 * f + c4) * f + c3) * f + c2) * f + c1) * f + 1.0f);
    const VI bits = (VI)s << 23;
    return p * (V)bits;
  }
#endif

  // exp(dt A) = exp2((dt log2e) A): the scale goes on dt, once per (t, channel) when dt is
  // discretized, not on A. A rounded A log2e would be off by up to half an ulp identically at
  // every step of a channel, a bias that compounds over sequences whose state grows; dt's
  // rounding changes from step to step like that of dt * A itself.
  static constexpr float kDecayScale = kLog2e;
  static inline V decay(V scaled_dt, V A) { return exp2(scaled_dt * A); }
  // The backward's dt * kDecayScale, held at fp32's largest where a finite dt past 2.4e38 would
  // round to inf: inf * A is NaN for A = 0, where exp(dt A) is 1. An infinite dt stays so. Not
  // the forward's: there even one min cost the AVX2 step 2% (docs/performance.md, "dt scale").
  static inline V scale_dt(V dt) {
    const V max = Lanes<float>::splat(3.4028234663852886e38f);
    const V scaled = dt * kDecayScale;
    const V held = dt > 0.0f ? max : -max;
    return ((scaled > max) | (scaled < -max)) & (dt <= max) & (dt >= -max) ? held : scaled;
  }

  // torch's softplus (threshold 20): max(x, 0) + log1p(exp(-|x|)), with
  // log1p(e) = 2 atanh(s), s = e / (2 + e) <= 1/3, and atanh(s) / s = 1 + s^2 q(s^2) with q a
  // cubic fitted for minimax relative error on s <= 1/3 (4.5e-9; the odd series needs 6 terms
  // after the 1 to reach 5e-9, two multiply-adds more).
  // exp2's argument |x| log2e is rounded to fp32 first: up to 2^-24 |x| of relative error in e
  // (1.8e-6 at x = -30, where softplus(x) is e), plus 1.3e-8 |x| from log2e's own rounding.
  // Whether a compiler's fused multiply-adds recover the first varies, so the 1e-6 softplus
  // test can fail on some builds. Carrying the product exactly (a hi + lo pair) made the step
  // slower (docs/performance.md, "softplus exact argument") for an error that only a dt far
  // below softplus's working range carries.
  static inline V softplus(V x) {
    const V ax = x < 0.0f ? -x : x;
    const V e = exp2(-ax * kLog2e);
    const V s = e / (e + 2.0f);
    const V s2 = s * s;
    const V q = ((0.14005890488624573f * s2 + 0.14000922441482544f) * s2 + 0.2001076191663742f) * s2 +
                0.3333320915699005f;
    const V series = 1.0f + s2 * q;
    const V r = (x > 0.0f ? x : 0.0f) + 2.0f * s * series;
    return x > 20.0f ? x : r;
  }

  static inline V silu(V z) { return z / (1.0f + exp2(-z * kLog2e)); }
  static inline V sigmoid(V z) { return 1.0f / (1.0f + exp2(-z * kLog2e)); }
};

// float64 is the precision path (x given as float64): libm per lane, within an ulp or so.
template <>
struct Math<double> {
  using V = Lanes<double>::V;
  static constexpr int W = Lanes<double>::W;

  static constexpr double kDecayScale = 1.0;
  static inline V scale_dt(V dt) { return dt; }
  static inline V decay(V dt, V A) {
    V r;
    for (int i = 0; i < W; ++i) r[i] = std::exp(dt[i] * A[i]);
    return r;
  }
  static inline V softplus(V x) {
    V r;
    for (int i = 0; i < W; ++i) r[i] = x[i] > 20.0 ? x[i] : std::log1p(std::exp(x[i]));
    return r;
  }
  static inline V silu(V z) {
    V r;
    for (int i = 0; i < W; ++i) r[i] = z[i] / (1.0 + std::exp(-z[i]));
    return r;
  }
  static inline V sigmoid(V z) {
    V r;
    for (int i = 0; i < W; ++i) r[i] = 1.0 / (1.0 + std::exp(-z[i]));
    return r;
  }
};

// exp of each lane, through the decays' own exp (the vector one in fp32, libm's in fp64).
template <typename T>
inline typename Lanes<T>::V exp_lanes(typename Lanes<T>::V v) {
  return Math<T>::decay(v * Math<T>::kDecayScale, Lanes<T>::splat(T(1)));
}

// Cache-line aligned scratch, zero-filled.
class Scratch {
 public:
  explicit Scratch(size_t bytes) {
    const size_t rounded = (bytes + kScratchAlign - 1) / kScratchAlign * kScratchAlign;
    mem_ = std::aligned_alloc(kScratchAlign, rounded);
    if (mem_ == nullptr) throw std::bad_alloc();
    std::memset(mem_, 0, rounded);
  }
  ~Scratch() { std::free(mem_); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  // Consecutive carving: `count` objects of type U, each region starting 64-byte aligned.
  template <typename U>
  U* take(int64_t count) {
    U* at = reinterpret_cast<U*>(static_cast<char*>(mem_) + used_);
    used_ += bytes<U>(count);
    return at;
  }
  template <typename U>
  static int64_t bytes(int64_t count) {
    return (count * static_cast<int64_t>(sizeof(U)) + kScratchAlign - 1) / kScratchAlign * kScratchAlign;
  }

 private:
  void* mem_ = nullptr;
  int64_t used_ = 0;
};

// Sums of the lanes of W vectors at once, as one vector: a tree of W - 1 adds of shuffle
// pairs. Stage H (W/2 .. 1) folds pairs (v[c], v[c + H]) into v[c]: within groups of G lanes,
// `low` takes the even H-lane blocks of a then those of b, `high` the odd ones, and low + high
// halves the partial sums of every input. G is the whole vector while an H-block spans a
// 128-bit lane or more, else one 128-bit lane, so every shuffle is a cheap whole-lane
// (vshuff32x4) or in-lane (vshufps) one rather than a general two-source permute. The sums
// come out in a fixed lane order: kSlot[c] is the input whose sum lands in lane c.
template <typename T>
struct LaneSums {
  using V = typename Lanes<T>::V;
  static constexpr int W = Lanes<T>::W;

  template <int H, bool kHigh>
  struct Fold {
    static constexpr int lane(int i) {
      const int group = H * static_cast<int>(sizeof(T)) >= 16 ? W : 16 / static_cast<int>(sizeof(T));
      const int start = i / group * group, k = i % group, half = group / 2;
      const int m = k % half;
      const int taken = start + (2 * (m / H) + (kHigh ? 1 : 0)) * H + m % H;
      return k < half ? taken : W + taken;
    }
  };

  template <int H>
  static constexpr int fold_lane(bool high, int i) {
    return high ? Fold<H, true>::lane(i) : Fold<H, false>::lane(i);
  }
  template <int H>
  static constexpr void fold_owners(std::array<std::array<int, W>, W>& v, bool& consistent) {
    for (int c = 0; c < H; ++c) {
      std::array<int, W> folded{};
      for (int j = 0; j < W; ++j) {
        const int lo = fold_lane<H>(false, j), hi = fold_lane<H>(true, j);
        const int lo_owner = lo < W ? v[c][lo] : v[c + H][lo - W];
        const int hi_owner = hi < W ? v[c][hi] : v[c + H][hi - W];
        consistent = consistent && lo_owner == hi_owner;
        folded[j] = lo_owner;
      }
      v[c] = folded;
    }
    if constexpr (H > 1) fold_owners<H / 2>(v, consistent);
  }
  // The tree run on input indices: which input's sum each lane of the result holds (-1 for
  // all lanes if some fold would add partial sums of two different inputs).
  static constexpr std::array<int, W> owners() {
    std::array<std::array<int, W>, W> v{};
    for (int i = 0; i < W; ++i)
      for (int j = 0; j < W; ++j) v[i][j] = i;
    bool consistent = true;
    fold_owners<W / 2>(v, consistent);
    if (!consistent) v[0].fill(-1);
    return v[0];
  }
  static constexpr std::array<int, W> kSlot = owners();
  static_assert(kSlot[0] >= 0, "the fold masks must pair lanes of the same input");

  template <int H = W / 2>
  static inline __attribute__((always_inline)) V of(V* v) {
    for (int c = 0; c < H; ++c)
      v[c] = Shuffles<T>::template apply<Fold<H, false>>(v[c], v[c + H]) +
             Shuffles<T>::template apply<Fold<H, true>>(v[c], v[c + H]);
    if constexpr (H > 1) {
      return of<H / 2>(v);
    } else {
      return v[0];
    }
  }
};

}  // namespace
}  // namespace scan_bridge
