// Mamba-2's (SSD) backward pass for the CPU, in the chunked matrix form: scan_backward.h's
// contract with `scalar_decay` set and a head's headdim as `channels_per_dt`.
//
// Within a chunk, with a_t = delta_t A (the log decay), cs_t = a_0 + ... + a_t,
// E[t, s] = exp(cs_t - cs_s) for s <= t (else 0), w_s = exp(cs_last - cs_s), u_s = delta_s x_s
// and h_in the state entering the chunk, a head's ungated output and final state are
//   y_t = sum_s E[t, s] (C_t . B_s) u_s + exp(cs_t) h_in C_t + D x_t,
//   h_out = exp(cs_last) h_in + sum_s w_s u_s (x) B_s,
// and given gy (the ungated output's gradient) and dH (h_out's), their adjoints are products of
// [Q, Q], [Q, headdim], [Q, state] and [headdim, state] matrices:
//   du_s = sum_t E[t, s] (C_t . B_s) gy_t + w_s dH B_s
//   dB_s = sum_t E[t, s] (gy_t . u_s) C_t + w_s dH^T u_s
//   dC_t = sum_s E[t, s] (gy_t . u_s) B_s + exp(cs_t) h_in^T gy_t
//   dh_in = exp(cs_last) dH + sum_t exp(cs_t) gy_t (x) C_t
// with a_t's gradient gathered from the same terms: those of exp(cs_t) as cs_t's, summed backwards
// into a_0 .. a_t, and those of exp(cs_t - cs_s) (E and w) directly into a_(s+1) .. a_t.
// A reverse scan stores and reloads every state element several times a step; here a chunk's
// work is a dozen products done in registers by a small tiled product (docs/performance.md,
// "backward pass").
//
// Items are (batch row, head). An item walks its chunks forwards once, keeping the state that
// enters each (one [headdim, state] matrix a chunk, not the whole history), then backwards.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "scan_backward.h"
#include "simd.h"

namespace scan_bridge {
namespace {

// Head `head` of `heads` at times first .. first + length of the packed operands: delta_t (dt
// through bias, softplus and clamp, as ssd_kernel.cpp takes it), d(delta)/d(dt) within the
// clamp's range, and whether dt lay in it (`kept`, 1 or 0).
template <typename T>
void discretize_head(const ScanBackwardProblem<T>& p, int64_t head, int64_t heads, int64_t first, int64_t length,
                     T* deltas, T* slopes, T* kept) {
  const T lo = static_cast<T>(p.dt_min), hi = static_cast<T>(p.dt_max);
  const T bias = p.dt_bias == nullptr ? T(0) : p.dt_bias[head];
  for (int64_t t = 0; t < length; ++t) {
    const T v = p.dt[(first + t) * heads + head] + bias;
    T d = v, slope = 1, inside = 1;
    if (p.dt_softplus && v <= T(20)) {
      d = std::log1p(std::exp(v));
      slope = T(1) / (T(1) + std::exp(-v));
    }
    // torch.clamp's gradient is 0 outside the range and for NaN (its comparisons are false).
    if (p.has_dt_min) {
      inside = d >= lo ? inside : T(0);
      d = d < lo ? lo : d;
    }
    if (p.has_dt_max) {
      inside = d <= hi ? inside : T(0);
      d = d > hi ? hi : d;
    }
    deltas[t] = d;
    slopes[t] = slope;
    kept[t] = inside;
  }
}

// A step's log decay delta A in fp64, floored at -1024, where its exp is already 0 in fp32 and
// fp64: an A of -inf or a huge delta would otherwise make cs_t - cs_s NaN or leave the later
// steps' spans to its rounding. NaN stays NaN (the comparison is false).
inline double log_decay(double delta, double A) {
  constexpr double kFloor = -1024.0;
  const double a = delta * A;
  return a < kFloor ? kFloor : a;
}

// out[i, :] (+)= sum_k a(i, k) b[k, :] for i < m over nv vectors of columns. `out` and `b` are
// row-major in whole vectors (their row strides ldo, ldb counted in vectors); a(i, k) =
// a[i * ars + k * acs], so a stored matrix serves as `a` either way round.
// Steps a chunk: the [step, step] products grow with it, the per-chunk work shrinks. Sixteen
// with 16-byte vectors, whose products are slower (docs/performance.md, "backward pass").
constexpr int64_t kChunk = kVectorBytes >= 32 ? 32 : 16;

// The entries of `a` a product reads: all, or for a square `a` (m = k) only a triangle, for E's
// products (E is zero past its diagonal): a zero times a row of b holding inf is NaN, where the
// recurrence never multiplies that row in.
enum class Part { kAll, kLower /* a(i, k) for k <= i */, kUpper /* for k >= i */ };

template <typename T>
struct Product {
  using V = typename Lanes<T>::V;
  // A tile of rows x vectors stays in registers with its row of b and a broadcast of a.
  static constexpr int kRows = 6;
  static constexpr int kCols = 2;

  template <Part kPart = Part::kAll>
  static void run(int64_t m, int64_t nv, int64_t k, const T* a, int64_t ars, int64_t acs, const V* b,
                  int64_t ldb, V* out, int64_t ldo, bool add) {
    for (int64_t j = 0; j < nv; j += kCols)
      for (int64_t i = 0; i < m; i += kRows) {
        const int64_t rows = std::min<int64_t>(kRows, m - i);
        if (nv - j >= 2)
          tile_rows<2, kPart>(rows, i, k, a + i * ars, ars, acs, b + j, ldb, out + i * ldo + j, ldo, add);
        else
          tile_rows<1, kPart>(rows, i, k, a + i * ars, ars, acs, b + j, ldb, out + i * ldo + j, ldo, add);
      }
  }

 private:
  template <int NR, Part kPart, int MR = kRows>
  static void tile_rows(int64_t rows, int64_t i0, int64_t k, const T* a, int64_t ars, int64_t acs, const V* b,
                        int64_t ldb, V* out, int64_t ldo, bool add) {
    if constexpr (MR > 1) {
      if (rows < MR) {
        tile_rows<NR, kPart, MR - 1>(rows, i0, k, a, ars, acs, b, ldb, out, ldo, add);
        return;
      }
    }
    tile<MR, NR, kPart>(i0, k, a, ars, acs, b, ldb, out, ldo, add);
  }

  // Rows i0 .. i0 + MR. For a triangle, every row takes the k on its side of the tile's
  // diagonal band, and the band's k = i0 + d only the rows r whose triangle holds it (r >= d
  // below, r <= d above): in ascending k either way, as the full product sums.
  template <int MR, int NR, Part kPart>
  static void tile(int64_t i0, int64_t k, const T* a, int64_t ars, int64_t acs, const V* b, int64_t ldb, V* out,
                   int64_t ldo, bool add) {
    V acc[MR][NR];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) acc[i][j] = add ? out[i * ldo + j] : V{};
    if constexpr (kPart == Part::kUpper)
      for (int d = 0; d < MR; ++d) step<NR>(i0 + d, 0, d + 1, a, ars, acs, b, ldb, acc);
    const int64_t begin = kPart == Part::kUpper ? i0 + MR : 0;
    const int64_t end = kPart == Part::kLower ? i0 + 1 : k;
    for (int64_t kk = begin; kk < end; ++kk) step<NR>(kk, 0, MR, a, ars, acs, b, ldb, acc);
    if constexpr (kPart == Part::kLower)
      for (int d = 1; d < MR; ++d) step<NR>(i0 + d, d, MR, a, ars, acs, b, ldb, acc);
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) out[i * ldo + j] = acc[i][j];
  }

  // acc[r] += a(r, kk) b[kk] for the tile's rows first <= r < last.
  template <int NR, int MR>
  static inline __attribute__((always_inline)) void step(int64_t kk, int first, int last, const T* a, int64_t ars,
                                                         int64_t acs, const V* b, int64_t ldb, V (&acc)[MR][NR]) {
    const V* bk = b + kk * ldb;
    const T* ak = a + kk * acs;
    V bv[NR];
    for (int j = 0; j < NR; ++j) bv[j] = bk[j];
    for (int i = first; i < last; ++i) {
      const V ai = Lanes<T>::splat(ak[i * ars]);
      for (int j = 0; j < NR; ++j) acc[i][j] += ai * bv[j];
    }
  }
};

template <typename T>
class SsdBackwardRunner {
  using V = typename Lanes<T>::V;
  static constexpr int W = Lanes<T>::W;
  using Unaligned = typename Lanes<T>::Unaligned;
  using Mul = Product<T>;

 public:
  explicit SsdBackwardRunner(const ScanBackwardProblem<T>& p)
      : p_(p),
        P_(p.channels_per_dt),
        H_(p.dim / p.channels_per_dt),
        N_(p.state),
        PV_((P_ + W - 1) / W),
        NV_((N_ + W - 1) / W),
        Q_(kChunk),
        QV_((Q_ + W - 1) / W),
        heads_per_group_(H_ / p.groups),
        longest_(longest_sequence(p)),
        chunks_(std::max<int64_t>(1, (longest_ + Q_ - 1) / Q_)),
        scratch_(Scratch::bytes<V>(chunks_ * PV_ * W * NV_) + 8 * Scratch::bytes<V>(QV_ * W * PV_) +
                 7 * Scratch::bytes<V>(QV_ * W * NV_) + 4 * Scratch::bytes<V>(QV_ * W * QV_) +
                 Scratch::bytes<V>(NV_ * W * QV_) + Scratch::bytes<V>(PV_ * W * QV_) +
                 2 * Scratch::bytes<V>(PV_ * W * NV_) + 2 * Scratch::bytes<V>(NV_ * W * PV_) +
                 2 * Scratch::bytes<V>(PV_) + Scratch::bytes<V>(QV_) + 3 * Scratch::bytes<double>(Q_) +
                 3 * Scratch::bytes<T>(QV_ * W) + 3 * Scratch::bytes<T>(longest_)) {
    // Matrices have whole vectors of rows as well as of columns, for transposing W x W blocks;
    // their padding rows and lanes stay zero.
    hin_ = scratch_.take<V>(chunks_ * PV_ * W * NV_);
    for (V** m : {&x_, &u_, &uw_, &g_, &z_, &gy_, &y_, &du_}) *m = scratch_.take<V>(QV_ * W * PV_);
    for (V** m : {&b_, &c_, &bw_, &ce_, &db_, &dc_, &zc_}) *m = scratch_.take<V>(QV_ * W * NV_);
    for (V** m : {&gm_, &eg_, &er_, &rr_}) *m = scratch_.take<V>(QV_ * W * QV_);
    bt_ = scratch_.take<V>(NV_ * W * QV_);
    ut_ = scratch_.take<V>(PV_ * W * QV_);
    dh_ = scratch_.take<V>(PV_ * W * NV_);
    dhn_ = scratch_.take<V>(PV_ * W * NV_);
    dht_ = scratch_.take<V>(NV_ * W * PV_);
    hint_ = scratch_.take<V>(NV_ * W * PV_);
    D_ = scratch_.take<V>(PV_);
    dD_ = scratch_.take<V>(PV_);
    colsums_ = scratch_.take<V>(QV_);
    cs_ = scratch_.take<double>(Q_);
    dcs_ = scratch_.take<double>(Q_);
    da_spans_ = scratch_.take<double>(Q_);
    for (T** v : {&ecs_, &w_, &dots_}) *v = scratch_.take<T>(QV_ * W);
    deltas_ = scratch_.take<T>(longest_);
    slopes_ = scratch_.take<T>(longest_);
    kept_ = scratch_.take<T>(longest_);
    for (int l = 0; l < W; ++l) lane_[l] = static_cast<T>(l);
  }

  void run_range(int64_t begin, int64_t end, int seat) {
    for (int64_t item = begin; item < end; ++item) run(item, seat);
  }

 private:
  static T* lanes(V* v) { return reinterpret_cast<T*>(v); }
  static const T* lanes(const V* v) { return reinterpret_cast<const T*>(v); }

  void run(int64_t item, int seat) {
    b_index_ = item / H_;
    h_ = item % H_;
    g_index_ = h_ / heads_per_group_;
    A_ = p_.A[h_];
    first_ = p_.cu_seqlens == nullptr ? b_index_ * p_.seq : p_.cu_seqlens[b_index_];
    length_ = p_.cu_seqlens == nullptr ? p_.seq : p_.cu_seqlens[b_index_ + 1] - first_;
    item_chunks_ = (length_ + Q_ - 1) / Q_;
    discretize_head(p_, h_, H_, first_, length_, deltas_, slopes_, kept_);
    std::memset(static_cast<void*>(D_), 0, PV_ * sizeof(V));
    if (p_.D != nullptr) std::memcpy(static_cast<void*>(D_), p_.D + h_ * P_, P_ * sizeof(T));
    chunk_states();
    reverse_pass(seat);
  }

  // n values from src to dst, whole vectors inline: GCC turns a loop that only moves values into
  // a call to memcpy, which costs more than a row of a few vectors, unless the value is opaque.
  static void copy(T* dst, const T* src, int64_t n) {
    int64_t i = 0;
    for (; i + W <= n; i += W) {
      V v = *reinterpret_cast<const Unaligned*>(src + i);
#if defined(__x86_64__)
      asm("" : "+x"(v));
#elif defined(__aarch64__)
      asm("" : "+w"(v));
#endif
      *reinterpret_cast<Unaligned*>(dst + i) = v;
    }
    for (; i < n; ++i) dst[i] = src[i];
  }

  // Rows t0 .. t0 + steps of a [.., seq, dim] operand's head columns into `out` (PV_ vectors a
  // row; the lanes past headdim stay zero, as every buffer's padding does).
  void load_head_rows(const T* src, int64_t t0, int64_t steps, V* out) const {
    for (int64_t t = 0; t < steps; ++t) copy(lanes(out + t * PV_), src + (first_ + t0 + t) * p_.dim + h_ * P_, P_);
  }

  void store_head_rows(const V* in, int64_t t0, int64_t steps, T* dst) const {
    for (int64_t t = 0; t < steps; ++t) copy(dst + (first_ + t0 + t) * p_.dim + h_ * P_, lanes(in + t * PV_), P_);
  }

  // The head's [headdim, state] rows of a [batch, dim, state] tensor (zeros for nullptr). The
  // padding lanes past the state are zeroed too: a NaN or inf delta leaves NaN there in dH
  // (0 * NaN), which the next item would sum into its own cs gradient.
  void load_state(const T* src, V* out) const {
    const int64_t loaded = src == nullptr ? 0 : N_;
    for (int64_t r = 0; r < P_; ++r) {
      T* row = lanes(out + r * NV_);
      if (src != nullptr) std::memcpy(row, src + ((b_index_ * H_ + h_) * P_ + r) * N_, N_ * sizeof(T));
      std::fill(row + loaded, row + NV_ * W, T(0));
    }
  }

  // dst[c][r] = src[r][c] for the W x W blocks covering rows < rows and every one of src's
  // `src_ld` vectors of columns (dst has `dst_ld` vectors a row).
  static void transpose(const V* src, int64_t rows, int64_t src_ld, V* dst, int64_t dst_ld) {
    for (int64_t rb = 0; rb < (rows + W - 1) / W; ++rb)
      for (int64_t cb = 0; cb < src_ld; ++cb) {
        V m[W];
        for (int i = 0; i < W; ++i) m[i] = src[(rb * W + i) * src_ld + cb];
        Shuffles<T>::transpose(m);
        for (int i = 0; i < W; ++i) dst[(cb * W + i) * dst_ld + rb] = m[i];
      }
  }

  // Chunk c's operands (x, u, B, C and their weighted copies) and its cumulative log decays;
  // returns its steps.
  int64_t prepare(int64_t c) {
    const int64_t t0 = c * Q_, steps = std::min(Q_, length_ - t0);
    load_head_rows(p_.x, t0, steps, x_);
    // Summed in fp64: cs_t - cs_s then loses nothing to the sums' rounding.
    double sum = 0;
    for (int64_t t = 0; t < steps; ++t) {
      sum += log_decay(deltas_[t0 + t], A_);
      cs_[t] = sum;
    }
    for (int64_t t = 0; t < QV_ * W; ++t) {
      w_[t] = t < steps ? static_cast<T>(sum - cs_[t]) : T(0);
      ecs_[t] = t < steps ? static_cast<T>(cs_[t]) : T(0);
    }
    // A NaN or +inf log decay (-inf is floored) leaves cs non-finite from its step on, where
    // cs_t - cs_s is NaN for the spans after that step too; such a chunk sums each span over its
    // own steps instead.
    chunk_deltas_ = deltas_ + t0;
    finite_spans_ = std::isfinite(sum);
    if (!finite_spans_) spans_to(steps - 1, w_);
    for (int64_t j = 0; j < QV_; ++j) {
      reinterpret_cast<V*>(w_)[j] = exp_lanes<T>(reinterpret_cast<V*>(w_)[j]);
      reinterpret_cast<V*>(ecs_)[j] = exp_lanes<T>(reinterpret_cast<V*>(ecs_)[j]);
    }
    for (int64_t t = 0; t < steps; ++t) {
      const int64_t at = (first_ + t0 + t) * p_.groups + g_index_;
      copy(lanes(b_ + t * NV_), p_.B + at * N_, N_);
      copy(lanes(c_ + t * NV_), p_.C + at * N_, N_);
      const V delta = Lanes<T>::splat(deltas_[t0 + t]), w = Lanes<T>::splat(w_[t]);
      for (int64_t j = 0; j < PV_; ++j) {
        u_[t * PV_ + j] = delta * x_[t * PV_ + j];
        uw_[t * PV_ + j] = w * u_[t * PV_ + j];
      }
      for (int64_t j = 0; j < NV_; ++j) bw_[t * NV_ + j] = w * b_[t * NV_ + j];
    }
    return steps;
  }

  // hin_[c] = the state entering chunk c, from h0 (the last chunk's end is not needed).
  void chunk_states() {
    load_state(p_.h0, hin_);
    const int64_t size = PV_ * W * NV_;
    for (int64_t c = 0; c + 1 < item_chunks_; ++c) {
      const int64_t steps = prepare(c);
      const V decay = Lanes<T>::splat(ecs_[steps - 1]);
      V* next = hin_ + (c + 1) * size;
      for (int64_t i = 0; i < size; ++i) next[i] = decay * hin_[c * size + i];
      Mul::run(P_, NV_, steps, lanes(uw_), 1, PV_ * W, b_, NV_, next, NV_, true);
    }
  }

  // out[s] = cs_t - cs_s for s <= t, summed over its own steps' log decays (0 past t).
  void spans_to(int64_t t, T* out) const {
    double sum = 0;
    for (int64_t s = t; s >= 0; --s) {
      out[s] = static_cast<T>(sum);
      sum += log_decay(chunk_deltas_[s], A_);
    }
    std::fill(out + t + 1, out + QV_ * W, T(0));
  }

  // er_[t, s] = E[t, s], eg_[t, s] = E[t, s] G[t, s], both zero for s > t.
  void decay_matrices(int64_t steps) {
    for (int64_t t = 0; t < steps; ++t) {
      T* e = lanes(er_ + t * QV_);
      for (int64_t s = 0; s < QV_ * W; ++s) e[s] = s <= t ? static_cast<T>(cs_[t] - cs_[s]) : T(0);
      if (!finite_spans_) spans_to(t, e);
      for (int64_t j = 0; j <= t / W; ++j) {
        er_[t * QV_ + j] = exp_lanes<T>(er_[t * QV_ + j]);
        eg_[t * QV_ + j] = er_[t * QV_ + j] * gm_[t * QV_ + j];
      }
      T* eg = lanes(eg_ + t * QV_);
      for (int64_t s = t + 1; s < QV_ * W; ++s) e[s] = eg[s] = T(0);
    }
  }

  // gy_ from dy (and z: then y is recomputed, dz written, and gy is the gated output's).
  void output_gradient(int64_t t0, int64_t steps, const V* hin) {
    if (p_.z == nullptr) {
      load_head_rows(p_.dy, t0, steps, gy_);
      return;
    }
    load_head_rows(p_.dy, t0, steps, g_);
    load_head_rows(p_.z, t0, steps, z_);
    transpose(hin, P_, NV_, hint_, PV_);
    Mul::template run<Part::kLower>(steps, PV_, steps, lanes(eg_), QV_ * W, 1, u_, PV_, y_, PV_, false);
    Mul::run(steps, PV_, N_, lanes(ce_), NV_ * W, 1, hint_, PV_, y_, PV_, true);
    const V one = Lanes<T>::splat(T(1));
    for (int64_t t = 0; t < steps; ++t)
      for (int64_t j = 0; j < PV_; ++j) {
        const int64_t i = t * PV_ + j;
        const V y = y_[i] + D_[j] * x_[i];
        const V z = z_[i], sg = Math<T>::sigmoid(z);
        y_[i] = g_[i] * y * sg * (one + z * (one - sg));  // dz
        gy_[i] = g_[i] * z * sg;
      }
    if (p_.dz != nullptr) store_head_rows(y_, t0, steps, p_.dz);
  }

  static T lane_sum(V v) {
    T sum = 0;
    for (int l = 0; l < W; ++l) sum += v[l];
    return sum;
  }

  // Row dot products of two [steps, vectors] matrices into dots_.
  void row_dots(const V* a, const V* b, int64_t steps, int64_t vectors) {
    for (int64_t t = 0; t < steps; ++t) {
      V s = {};
      for (int64_t j = 0; j < vectors; ++j) s += a[t * vectors + j] * b[t * vectors + j];
      dots_[t] = lane_sum(s);
    }
  }

  void reverse_pass(int seat) {
    load_state(p_.dstate, dh_);
    std::memset(static_cast<void*>(dD_), 0, PV_ * sizeof(V));
    T dA = 0, dbias = 0;
    const int64_t positions = p_.cu_seqlens == nullptr ? p_.batch * p_.seq : p_.seq;
    T* dB_seat = p_.dB + static_cast<int64_t>(seat) * positions * p_.groups * N_;
    T* dC_seat = p_.dC + static_cast<int64_t>(seat) * positions * p_.groups * N_;
    const int64_t channel0 = h_ * P_;
    for (int64_t c = item_chunks_ - 1; c >= 0; --c) {
      const int64_t t0 = c * Q_;
      const int64_t steps = prepare(c);
      const int64_t last = steps - 1;
      const V* hin = hin_ + c * PV_ * W * NV_;
      for (int64_t t = 0; t < steps; ++t) {
        const V e = Lanes<T>::splat(ecs_[t]);
        for (int64_t j = 0; j < NV_; ++j) ce_[t * NV_ + j] = e * c_[t * NV_ + j];
      }
      transpose(b_, steps, NV_, bt_, QV_);
      transpose(u_, steps, PV_, ut_, QV_);
      transpose(dh_, P_, NV_, dht_, PV_);
      // G = C B^T, then the decay-weighted E and E o G.
      Mul::run(steps, QV_, N_, lanes(c_), NV_ * W, 1, bt_, QV_, gm_, QV_, false);
      decay_matrices(steps);
      output_gradient(t0, steps, hin);
      // R = gy u^T; er_ becomes E o R, zero past the diagonal, where E's zero would not cancel a
      // NaN or inf in R (from a later step's u, or from rows past `steps`: an earlier item's).
      // M = E o G o R gives a_r the sum of M[t, s] over s < r <= t, gathered from the sums of
      // M's columns over t >= r. (As row sums less column sums, terms that cancel, a NaN or inf
      // M[t, s] reached a_0 .. a_s too, and M[t, t] could dwarf the rest where the decay is strong.)
      Mul::run(steps, QV_, P_, lanes(gy_), PV_ * W, 1, ut_, QV_, rr_, QV_, false);
      std::memset(static_cast<void*>(colsums_), 0, QV_ * sizeof(V));
      std::fill(dcs_, dcs_ + steps, 0.0);
      for (int64_t t = last; t >= 0; --t) {
        const int64_t diagonal = t / W;
        const T lane_t = static_cast<T>(t % W);
        V before_t = {};
        for (int64_t j = 0; j <= diagonal; ++j) {
          const int64_t i = t * QV_ + j;
          er_[i] *= rr_[i];
          if (j == diagonal) er_[i] = lane_ <= lane_t ? er_[i] : V{};
          colsums_[j] += er_[i] * gm_[i];
          before_t += j < diagonal ? colsums_[j] : (lane_ < lane_t ? colsums_[j] : V{});
        }
        da_spans_[t] = lane_sum(before_t);
      }
      // du from dH first: its dot with u_s, through w_s = exp(cs_last - cs_s), is a_r's for s < r.
      Mul::run(steps, PV_, N_, lanes(bw_), NV_ * W, 1, dht_, PV_, du_, PV_, false);
      row_dots(u_, du_, steps, PV_);
      double through_state = 0;
      for (int64_t s = 0; s < steps; ++s) {
        da_spans_[s] += through_state;
        through_state += dots_[s];
      }
      V hd = {};
      for (int64_t i = 0; i < P_ * NV_; ++i) hd += dh_[i] * hin[i];
      dcs_[last] += static_cast<double>(ecs_[last]) * lane_sum(hd);
      Mul::template run<Part::kUpper>(steps, PV_, steps, lanes(eg_), 1, QV_ * W, gy_, PV_, du_, PV_, true);
      // dB and dC.
      Mul::template run<Part::kUpper>(steps, NV_, steps, lanes(er_), 1, QV_ * W, c_, NV_, db_, NV_, false);
      Mul::run(steps, NV_, P_, lanes(uw_), PV_ * W, 1, dh_, NV_, db_, NV_, true);
      Mul::template run<Part::kLower>(steps, NV_, steps, lanes(er_), QV_ * W, 1, b_, NV_, dc_, NV_, false);
      Mul::run(steps, NV_, P_, lanes(gy_), PV_ * W, 1, hin, NV_, zc_, NV_, false);
      row_dots(c_, zc_, steps, NV_);
      for (int64_t t = 0; t < steps; ++t) {
        dcs_[t] += static_cast<double>(ecs_[t]) * dots_[t];
        const V e = Lanes<T>::splat(ecs_[t]);
        for (int64_t j = 0; j < NV_; ++j) dc_[t * NV_ + j] += e * zc_[t * NV_ + j];
      }
      // The state entering the chunk.
      const V decay = Lanes<T>::splat(ecs_[last]);
      for (int64_t i = 0; i < P_ * NV_; ++i) dhn_[i] = decay * dh_[i];
      Mul::run(P_, NV_, steps, lanes(gy_), 1, PV_ * W, ce_, NV_, dhn_, NV_, true);
      std::swap(dh_, dhn_);
      // Per step: a_t's gradient (cs's summed from t on, and its spans'), then delta's, dt's, dx
      // and dD.
      row_dots(x_, du_, steps, PV_);
      double dcs_from_t = 0;
      for (int64_t t = last; t >= 0; --t) {
        dcs_from_t += dcs_[t];
        const T da = static_cast<T>(dcs_from_t + da_spans_[t]);
        const T delta = deltas_[t0 + t];
        dA += da * delta;
        // Where the clamp cut dt, a zero selected, as torch.clamp's, not inf * 0.
        const T ddt = kept_[t0 + t] == T(0) ? T(0) : (da * A_ + dots_[t]) * slopes_[t0 + t];
        dbias += ddt;
        p_.ddt[(first_ + t0 + t) * H_ + h_] = ddt;
        const V d = Lanes<T>::splat(delta);
        for (int64_t j = 0; j < PV_; ++j) {
          const int64_t i = t * PV_ + j;
          du_[i] = d * du_[i] + D_[j] * gy_[i];
          dD_[j] += gy_[i] * x_[i];
        }
      }
      store_head_rows(du_, t0, steps, p_.dx);
      for (int64_t t = 0; t < steps; ++t) {
        const int64_t at = ((first_ + t0 + t) * p_.groups + g_index_) * N_;
        const T* db = lanes(db_ + t * NV_);
        const T* dc = lanes(dc_ + t * NV_);
        for (int64_t n = 0; n < N_; ++n) {
          dB_seat[at + n] += db[n];
          dC_seat[at + n] += dc[n];
        }
      }
    }
    if (p_.dh0 != nullptr)
      for (int64_t r = 0; r < P_; ++r)
        std::memcpy(p_.dh0 + ((b_index_ * H_ + h_) * P_ + r) * N_, lanes(dh_ + r * NV_), N_ * sizeof(T));
    p_.dA[(static_cast<int64_t>(seat) * p_.dim + channel0) * N_] += dA;
    p_.ddt_bias[static_cast<int64_t>(seat) * p_.dim + channel0] += dbias;
    const T* dD = lanes(dD_);
    for (int64_t r = 0; r < P_; ++r) p_.dD[static_cast<int64_t>(seat) * p_.dim + channel0 + r] += dD[r];
  }

  const ScanBackwardProblem<T>& p_;
  const int64_t P_, H_, N_, PV_, NV_, Q_, QV_, heads_per_group_, longest_, chunks_;
  Scratch scratch_;
  // The running item (run()).
  int64_t b_index_ = 0, h_ = 0, g_index_ = 0, first_ = 0, length_ = 0, item_chunks_ = 0;
  T A_ = 0;
  // The states entering the item's chunks: [chunk, headdim (padded), NV_].
  V* hin_;
  // A chunk's [step, headdim] matrices: x, u = delta x, w u, dy (g), z, gy, y (then dz), du
  // (then dx).
  V *x_, *u_, *uw_, *g_, *z_, *gy_, *y_, *du_;
  // Its [step, state] matrices: B, C, w B, exp(cs) C, dB, dC, gy h_in.
  V *b_, *c_, *bw_, *ce_, *db_, *dc_, *zc_;
  // Its [step, step] matrices: G = C B^T, E o G, E (then E o R), R = gy u^T.
  V *gm_, *eg_, *er_, *rr_;
  // B^T, u^T; dH and the next one; dH^T and h_in^T; D and dD; the column sums of E o G o R
  // over the steps from t on.
  V *bt_, *ut_, *dh_, *dhn_, *dht_, *hint_, *D_, *dD_, *colsums_;
  // cs; cs's gradient from the factors exp(cs_t); a_t's from the factors exp(cs_t - cs_s).
  double *cs_, *dcs_, *da_spans_;
  // The prepared chunk's: whether its cs is finite, and its deltas.
  bool finite_spans_ = true;
  const T* chunk_deltas_ = nullptr;
  V lane_;  // each lane's index
  T *ecs_, *w_, *dots_, *deltas_, *slopes_, *kept_;
};

}  // namespace

template <typename T>
int64_t ssd_backward_items(const ScanBackwardProblem<T>& p) {
  return p.batch * (p.dim / p.channels_per_dt);
}

template <typename T>
int64_t ssd_backward_work_per_item(const ScanBackwardProblem<T>& p) {
  return steps_per_row(p.seq, p.batch, p.cu_seqlens) * p.channels_per_dt * p.state;
}

template <typename T>
void ssd_backward_run(const ScanBackwardProblem<T>& p, WorkQueue& queue, int seat) {
  SsdBackwardRunner<T> runner(p);
  int64_t begin, end;
  while (queue.take(seat, &begin, &end)) runner.run_range(begin, end, seat);
}

template int64_t ssd_backward_items<float>(const ScanBackwardProblem<float>&);
template int64_t ssd_backward_items<double>(const ScanBackwardProblem<double>&);
template int64_t ssd_backward_work_per_item<float>(const ScanBackwardProblem<float>&);
template int64_t ssd_backward_work_per_item<double>(const ScanBackwardProblem<double>&);
template void ssd_backward_run<float>(const ScanBackwardProblem<float>&, WorkQueue&, int);
template void ssd_backward_run<double>(const ScanBackwardProblem<double>&, WorkQueue&, int);

}  // namespace scan_bridge
