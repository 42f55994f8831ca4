// Mamba-2's (SSD) backward pass for the CPU: scan_backward.h's contract with `scalar_decay` set
// and a head's headdim as `channels_per_dt`.
//
// Lanes run along the state axis, as the state is stored ([head, headdim, state]): each row of
// headdim keeps its state as ceil(state / W) vectors, and B_t, C_t are vectors too. With one
// decay a_t per head and step, walking t backwards through a row p (g: the gradient of the gated
// output, dy the ungated one, u = delta_t x_t[p]):
//   dh[p]  += dy[p] C_t;   dC_t += dy[p] h_t[p];   dB_t += u dh[p]
//   dx_t[p] = dy[p] D[p] + delta_t (dh[p] . B_t);  q_t += dh[p] . h_{t-1}[p];  dh[p] <- a_t dh[p]
//   ddelta_t = sum_p x_t[p] (dh[p] . B_t) + A a_t q_t;  dA += delta_t a_t q_t
// so dB and dC sum over rows in registers, and only the dot products with B_t and h_{t-1} are
// sums across lanes: a vector per row and step, folded W at a time after each chunk (with z,
// y_t[p] = C_t . h_t[p] likewise, in the chunk's recompute). The Mamba-1 runner
// (scan_backward.cpp) puts lanes on channels instead, where every state element has its own
// decay; for a head, that is two sums across lanes per state element and step.
//
// Items are (batch row, head, block of rows). An item keeps its states at chunk boundaries and
// recomputes a chunk's states before walking it back, as the Mamba-1 runner does.

#include <algorithm>
#include <cmath>
#include <cstring>

#include "scan_backward.h"
#include "simd.h"

namespace scan_bridge {
namespace {

// Rows of headdim an item walks: a step's own work (its decay, B_t, C_t, the sums of dB_t and
// dC_t, the rows' loads from x and dy) is shared by as many rows, and a chunk's states stay in
// L2 (docs/performance.md, "backward pass").
constexpr int64_t kSsdRows = 32;
// State vectors one sweep over the rows keeps in registers, with their B, C, dB and dC.
constexpr int kSweepVectors = kVectorBytes == 64 ? 4 : 2;

// Rows of headdim in an item's block.
template <typename T>
int64_t block_rows(const ScanBackwardProblem<T>& p) {
  return std::min<int64_t>(p.channels_per_dt, kSsdRows);
}

template <typename T>
class SsdBackwardRunner {
  using V = typename Lanes<T>::V;
  using Unaligned = typename Lanes<T>::Unaligned;
  static constexpr int W = Lanes<T>::W;

 public:
  explicit SsdBackwardRunner(const ScanBackwardProblem<T>& p)
      : p_(p),
        P_(p.channels_per_dt),
        H_(p.dim / p.channels_per_dt),
        N_(p.state),
        NV_((p.state + W - 1) / W),
        heads_per_group_(H_ / p.groups),
        rows_(block_rows(p)),
        RV_((rows_ + W - 1) / W),
        blocks_((P_ + rows_ - 1) / rows_),
        row_vectors_(rows_ * NV_),
        longest_(longest_sequence(p)),
        chunk_(chunk_steps(longest_, row_vectors_)),
        chunks_(std::max<int64_t>(1, (longest_ + chunk_ - 1) / chunk_)),  // h0 has room with no steps
        scratch_(Scratch::bytes<V>(chunks_ * row_vectors_) + Scratch::bytes<V>((chunk_ + 1) * row_vectors_) +
                 Scratch::bytes<V>(row_vectors_) + 2 * Scratch::bytes<V>(chunk_ * NV_) +
                 Scratch::bytes<V>(chunk_ * RV_ * W) + 2 * Scratch::bytes<V>(chunk_) +
                 7 * Scratch::bytes<V>(chunk_ * RV_) + 2 * Scratch::bytes<V>(RV_) + Scratch::bytes<T>(chunk_) +
                 3 * Scratch::bytes<T>(longest_)) {
    ckpt_ = scratch_.take<V>(chunks_ * row_vectors_);
    hist_ = scratch_.take<V>((chunk_ + 1) * row_vectors_);
    dh_ = scratch_.take<V>(row_vectors_);
    Bs_ = scratch_.take<V>(chunk_ * NV_);
    Cs_ = scratch_.take<V>(chunk_ * NV_);
    parts_ = scratch_.take<V>(chunk_ * RV_ * W);
    qparts_ = scratch_.take<V>(chunk_);
    dtparts_ = scratch_.take<V>(chunk_);
    xs_ = scratch_.take<V>(chunk_ * RV_);
    us_ = scratch_.take<V>(chunk_ * RV_);
    gs_ = scratch_.take<V>(chunk_ * RV_);
    zs_ = scratch_.take<V>(chunk_ * RV_);
    dzs_ = scratch_.take<V>(chunk_ * RV_);
    dxs_ = scratch_.take<V>(chunk_ * RV_);
    sums_ = scratch_.take<V>(chunk_ * RV_);
    D_ = scratch_.take<V>(RV_);
    dD_ = scratch_.take<V>(RV_);
    qs_ = scratch_.take<T>(chunk_);
    head_deltas_ = scratch_.take<T>(longest_);
    head_slopes_ = scratch_.take<T>(longest_);
    head_decays_ = scratch_.take<T>(longest_);
  }

  // The whole (longest) sequence where its states fit in kWholeSequenceBytes, which spares the
  // checkpoint walk, else kBackwardChunk steps.
  static int64_t chunk_steps(int64_t longest, int64_t row_vectors) {
    const int64_t bytes = static_cast<int64_t>(sizeof(V)) * (longest + 1) * row_vectors;
    return bytes <= kWholeSequenceBytes ? std::max<int64_t>(longest, 1) : kBackwardChunk;
  }

  void run_range(int64_t begin, int64_t end, int seat) {
    for (int64_t item = begin; item < end; ++item) run(item, seat);
  }

 private:
  void run(int64_t item, int seat) {
    const int64_t bh = item / blocks_;
    b_ = bh / H_;
    h_ = bh % H_;
    g_ = h_ / heads_per_group_;
    r0_ = (item % blocks_) * rows_;
    rows_here_ = std::min(rows_, P_ - r0_);
    channel0_ = h_ * P_ + r0_;
    A_ = p_.A[h_];
    first_ = p_.cu_seqlens == nullptr ? b_ * p_.seq : p_.cu_seqlens[b_];
    length_ = p_.cu_seqlens == nullptr ? p_.seq : p_.cu_seqlens[b_ + 1] - first_;
    item_chunks_ = (length_ + chunk_ - 1) / chunk_;
    // A head's blocks are consecutive items, and a seat takes consecutive items.
    if (bh != prepared_head_) {
      discretize_head();
      prepared_head_ = bh;
    }
    load_row_vectors(p_.D, D_);
    checkpoint_pass();
    reverse_pass(seat);
  }

  // The block's rows of `src`, one [.., dim] row (or nullptr: zeros), as RV_ vectors, zero past
  // the block.
  void load_row_vectors(const T* src, V* out) const {
    if (src == nullptr) {
      std::memset(static_cast<void*>(out), 0, RV_ * sizeof(V));
      return;
    }
    src += channel0_;
    if (rows_here_ == RV_ * W) {
      for (int64_t j = 0; j < RV_; ++j) out[j] = *reinterpret_cast<const Unaligned*>(src + j * W);
      return;
    }
    T* lanes = reinterpret_cast<T*>(out);
    for (int64_t r = 0; r < RV_ * W; ++r) lanes[r] = r < rows_here_ ? src[r] : T(0);
  }

  void store_row_vectors(const V* in, T* dst) const {
    dst += channel0_;
    if (rows_here_ == RV_ * W) {
      for (int64_t j = 0; j < RV_; ++j) *reinterpret_cast<Unaligned*>(dst + j * W) = in[j];
      return;
    }
    const T* lanes = reinterpret_cast<const T*>(in);
    for (int64_t r = 0; r < rows_here_; ++r) dst[r] = lanes[r];
  }

  // The block's rows of a [batch, dim, state] tensor as padded state vectors (zeros where absent).
  void load_rows(const T* src, V* out) const {
    std::memset(static_cast<void*>(out), 0, row_vectors_ * sizeof(V));
    if (src == nullptr) return;
    for (int64_t r = 0; r < rows_here_; ++r)
      std::memcpy(static_cast<void*>(out + r * NV_), src + (b_ * p_.dim + channel0_ + r) * N_, N_ * sizeof(T));
  }

  // The head's delta at every step (dt through bias, softplus and clamp, as ssd_kernel.cpp
  // takes it), d(delta)/d(dt) and the decay.
  void discretize_head() {
    const T lo = static_cast<T>(p_.dt_min), hi = static_cast<T>(p_.dt_max);
    const T bias = p_.dt_bias == nullptr ? T(0) : p_.dt_bias[h_];
    for (int64_t t = 0; t < length_; ++t) {
      const T v = p_.dt[(first_ + t) * H_ + h_] + bias;
      T d = v, slope = 1;
      if (p_.dt_softplus && v <= T(20)) {
        d = std::log1p(std::exp(v));
        slope = T(1) / (T(1) + std::exp(-v));
      }
      // torch.clamp's gradient is 0 outside the range and for NaN (its comparisons are false).
      if (p_.has_dt_min) {
        slope = d >= lo ? slope : T(0);
        d = d < lo ? lo : d;
      }
      if (p_.has_dt_max) {
        slope = d <= hi ? slope : T(0);
        d = d > hi ? hi : d;
      }
      head_deltas_[t] = d;
      head_slopes_[t] = slope;
      head_decays_[t] = std::exp(d * A_);
    }
  }

  // The block's rows of `src` ([.., seq, dim]) at times t0 .. t0 + steps of the sequence
  // (those within it) on their way to the cache: a block's rows are a dim apart, too far for the
  // hardware's prefetcher to follow.
  void prefetch_rows(const T* src, int64_t t0, int64_t steps) const {
    const int64_t begin = std::max<int64_t>(t0, 0), end = std::min(t0 + steps, length_);
    for (int64_t t = begin; t < end; ++t) {
      const T* row = src + (first_ + t) * p_.dim + channel0_;
      __builtin_prefetch(row);
      __builtin_prefetch(row + rows_here_ - 1);
    }
  }

  // A chunk's per-step values: x and delta x per row, B_t and C_t as padded vectors.
  void pack(int64_t t0, int64_t steps) {
    deltas_ = head_deltas_ + t0;
    slopes_ = head_slopes_ + t0;
    decays_ = head_decays_ + t0;
    for (int64_t t = 0; t < steps; ++t) {
      const int64_t at = first_ + t0 + t;
      load_row_vectors(p_.x + at * p_.dim, xs_ + t * RV_);
      const V d = Lanes<T>::splat(deltas_[t]);
      for (int64_t j = 0; j < RV_; ++j) us_[t * RV_ + j] = d * xs_[t * RV_ + j];
      const T* B = p_.B + (at * p_.groups + g_) * N_;
      const T* C = p_.C + (at * p_.groups + g_) * N_;
      T* Bt = reinterpret_cast<T*>(Bs_ + t * NV_);
      T* Ct = reinterpret_cast<T*>(Cs_ + t * NV_);
      for (int64_t n = 0; n < N_; ++n) {
        Bt[n] = B[n];
        Ct[n] = C[n];
      }
    }
  }

  // Row r's delta x at step t, in every lane.
  V u_of(int64_t t, int64_t r) const { return Lanes<T>::splat(reinterpret_cast<const T*>(us_ + t * RV_)[r]); }

  // h_t = a_t h_{t-1} + u_t[p] B_t for every row, from `prev` into `cur` (which may be `prev`);
  // with `ys`, C_t . h_t[p] per row as a vector of partial sums.
  void advance(int64_t t, const V* prev, V* cur, V* ys) {
    if (ys != nullptr) std::memset(static_cast<void*>(ys + t * RV_ * W), 0, RV_ * W * sizeof(V));
    for (int64_t k0 = 0; k0 < NV_; k0 += kSweepVectors) {
      switch (std::min<int64_t>(kSweepVectors, NV_ - k0)) {
        case 4: advance_sweep<4>(t, k0, prev, cur, ys); break;
        case 3: advance_sweep<3>(t, k0, prev, cur, ys); break;
        case 2: advance_sweep<2>(t, k0, prev, cur, ys); break;
        default: advance_sweep<1>(t, k0, prev, cur, ys); break;
      }
    }
  }

  // advance() over K state vectors from k0: a fixed count, so the rows' loop keeps them in
  // registers.
  template <int K>
  void advance_sweep(int64_t t, int64_t k0, const V* prev, V* cur, V* ys) const {
    const V a = Lanes<T>::splat(decays_[t]);
    V b[K], c[K];
    for (int k = 0; k < K; ++k) {
      b[k] = Bs_[t * NV_ + k0 + k];
      c[k] = Cs_[t * NV_ + k0 + k];
    }
    for (int64_t r = 0; r < rows_here_; ++r) {
      const V u = u_of(t, r);
      const V* from = prev + r * NV_ + k0;
      V* to = cur + r * NV_ + k0;
      V s[K];
      for (int k = 0; k < K; ++k) s[k] = a * from[k] + u * b[k];
      for (int k = 0; k < K; ++k) to[k] = s[k];
      if (ys != nullptr) {
        V y = {};
        for (int k = 0; k < K; ++k) y += c[k] * s[k];
        ys[t * RV_ * W + r] += y;
      }
    }
  }

  // The states entering each chunk, from h0 (the last chunk's own steps are not needed).
  void checkpoint_pass() {
    V* h = ckpt_;
    load_rows(p_.h0, h);
    for (int64_t c = 0; c + 1 < item_chunks_; ++c) {
      std::memcpy(static_cast<void*>(h + row_vectors_), static_cast<const void*>(h), row_vectors_ * sizeof(V));
      h += row_vectors_;
      prefetch_rows(p_.x, (c + 1) * chunk_, chunk_);
      pack(c * chunk_, chunk_);
      for (int64_t t = 0; t < chunk_; ++t) advance(t, h, h, nullptr);
    }
  }

  // out[i] = the sum of v[i]'s lanes, i < count: W at a time through one lane-sum tree.
  static void lane_sums(const V* v, int64_t count, T* out) {
    for (int64_t i0 = 0; i0 < count; i0 += W) {
      const int64_t n = std::min<int64_t>(W, count - i0);
      V tmp[W];
      for (int i = 0; i < W; ++i) tmp[i] = i < n ? v[i0 + i] : V{};
      const V sums = LaneSums<T>::of(tmp);
      for (int c = 0; c < W; ++c)
        if (LaneSums<T>::kSlot[c] < n) out[i0 + LaneSums<T>::kSlot[c]] = sums[c];
    }
  }

  // hist_[t + 1] = h_t over the chunk (hist_[0]: its checkpoint). With z, the ungated output's
  // gradient replaces g in gs_, and dz is found.
  void recompute(int64_t c, int64_t steps) {
    std::memcpy(static_cast<void*>(hist_), static_cast<const void*>(ckpt_ + c * row_vectors_),
                row_vectors_ * sizeof(V));
    V* ys = p_.z != nullptr ? parts_ : nullptr;
    for (int64_t t = 0; t < steps; ++t) advance(t, hist_ + t * row_vectors_, hist_ + (t + 1) * row_vectors_, ys);
    if (ys == nullptr) return;
    lane_sums(parts_, steps * RV_ * W, reinterpret_cast<T*>(sums_));
    const V one = Lanes<T>::splat(T(1));
    for (int64_t i = 0; i < steps * RV_; ++i) {
      const V y = sums_[i] + D_[i % RV_] * xs_[i];
      const V z = zs_[i], sg = Math<T>::sigmoid(z);
      dzs_[i] = gs_[i] * y * sg * (one + z * (one - sg));
      gs_[i] *= z * sg;
    }
  }

  // Step t's adjoint over K state vectors from k0, every row: dh updated in place, dB_t and dC_t
  // summed over the rows in registers and added into the seat's, the rows' dh . B_t partial
  // sums into parts_ and dh . h_{t-1} into q.
  template <int K>
  void adjoint_sweep(int64_t t, int64_t k0, V& q, T* dB, T* dC) {
    // q in K sums: one would chain every row's multiply-adds, each waiting on the last.
    V b[K], c[K], dBs[K], dCs[K], qs[K];
    for (int k = 0; k < K; ++k) {
      b[k] = Bs_[t * NV_ + k0 + k];
      c[k] = Cs_[t * NV_ + k0 + k];
      dBs[k] = dCs[k] = qs[k] = V{};
    }
    const V a = Lanes<T>::splat(decays_[t]);
    const V* h = hist_ + (t + 1) * row_vectors_ + k0;
    const V* h_prev = hist_ + t * row_vectors_ + k0;
    const T* dys = reinterpret_cast<const T*>(gs_ + t * RV_);
    for (int64_t r = 0; r < rows_here_; ++r) {
      const V dy = Lanes<T>::splat(dys[r]);
      const V u = u_of(t, r);
      V* dh = dh_ + r * NV_ + k0;
      V part = {};
      for (int k = 0; k < K; ++k) {
        const V g = dh[k] + dy * c[k];
        dCs[k] += dy * h[r * NV_ + k];
        dBs[k] += u * g;
        part += g * b[k];
        qs[k] += g * h_prev[r * NV_ + k];
        dh[k] = a * g;
      }
      parts_[t * RV_ * W + r] += part;
    }
    for (int k = 0; k < K; ++k) q += qs[k];
    for (int k = 0; k < K; ++k) {
      const int64_t n0 = (k0 + k) * W;
      if (n0 + W <= N_) {
        *reinterpret_cast<Unaligned*>(dB + n0) += dBs[k];
        *reinterpret_cast<Unaligned*>(dC + n0) += dCs[k];
      } else {
        for (int64_t n = n0; n < N_; ++n) {
          dB[n] += dBs[k][n - n0];
          dC[n] += dCs[k][n - n0];
        }
      }
    }
  }

  void reverse_pass(int seat) {
    load_rows(p_.dstate, dh_);
    std::memset(static_cast<void*>(dD_), 0, RV_ * sizeof(V));
    T dA = 0, dbias = 0;
    const int64_t positions = p_.cu_seqlens == nullptr ? p_.batch * p_.seq : p_.seq;
    T* dB_seat = p_.dB + static_cast<int64_t>(seat) * positions * p_.groups * N_;
    T* dC_seat = p_.dC + static_cast<int64_t>(seat) * positions * p_.groups * N_;
    for (int64_t c = item_chunks_ - 1; c >= 0; --c) {
      const int64_t t0 = c * chunk_;
      const int64_t steps = std::min(chunk_, length_ - t0);
      prefetch_rows(p_.x, t0 - chunk_, chunk_);
      prefetch_rows(p_.dy, t0 - chunk_, chunk_);
      if (p_.z != nullptr) prefetch_rows(p_.z, t0 - chunk_, chunk_);
      pack(t0, steps);
      for (int64_t t = 0; t < steps; ++t) {
        const int64_t at = (first_ + t0 + t) * p_.dim;
        load_row_vectors(p_.dy + at, gs_ + t * RV_);
        if (p_.z != nullptr) load_row_vectors(p_.z + at, zs_ + t * RV_);
      }
      recompute(c, steps);
      std::memset(static_cast<void*>(parts_), 0, steps * RV_ * W * sizeof(V));
      for (int64_t t = steps - 1; t >= 0; --t) {
        const int64_t bc = ((first_ + t0 + t) * p_.groups + g_) * N_;
        V q = {};
        for (int64_t k0 = 0; k0 < NV_; k0 += kSweepVectors) {
          switch (std::min<int64_t>(kSweepVectors, NV_ - k0)) {
            case 4: adjoint_sweep<4>(t, k0, q, dB_seat + bc, dC_seat + bc); break;
            case 3: adjoint_sweep<3>(t, k0, q, dB_seat + bc, dC_seat + bc); break;
            case 2: adjoint_sweep<2>(t, k0, q, dB_seat + bc, dC_seat + bc); break;
            default: adjoint_sweep<1>(t, k0, q, dB_seat + bc, dC_seat + bc); break;
          }
        }
        qparts_[t] = q;
      }
      // Per row: dh . B_t, then dx and dD; x . (dh . B_t) summed over the rows is delta's
      // share from the inputs, q its share from the decay.
      lane_sums(parts_, steps * RV_ * W, reinterpret_cast<T*>(sums_));
      for (int64_t t = 0; t < steps; ++t) {
        const V delta = Lanes<T>::splat(deltas_[t]);
        V ddelta = {};
        for (int64_t j = 0; j < RV_; ++j) {
          const int64_t i = t * RV_ + j;
          dxs_[i] = gs_[i] * D_[j] + delta * sums_[i];
          dD_[j] += gs_[i] * xs_[i];
          ddelta += xs_[i] * sums_[i];
        }
        dtparts_[t] = ddelta;
      }
      lane_sums(qparts_, steps, qs_);
      T* ddeltas = reinterpret_cast<T*>(parts_);  // the partial sums are spent
      lane_sums(dtparts_, steps, ddeltas);
      for (int64_t t = 0; t < steps; ++t) {
        const int64_t at = (first_ + t0 + t) * p_.dim;
        const T delta = deltas_[t];
        const T q = qs_[t] * decays_[t];
        dA += q * delta;
        const T ddt = (ddeltas[t] + q * A_) * slopes_[t];
        dbias += ddt;
        // The block's share of the head's ddt, summed over the blocks by the binding.
        p_.ddt[at + channel0_] = ddt;
        store_row_vectors(dxs_ + t * RV_, p_.dx + at);
        if (p_.z != nullptr) store_row_vectors(dzs_ + t * RV_, p_.dz + at);
      }
    }
    if (p_.dh0 != nullptr)
      for (int64_t r = 0; r < rows_here_; ++r)
        std::memcpy(p_.dh0 + (b_ * p_.dim + channel0_ + r) * N_, static_cast<const void*>(dh_ + r * NV_),
                    N_ * sizeof(T));
    p_.dA[(static_cast<int64_t>(seat) * p_.dim + channel0_) * N_] += dA;
    p_.ddt_bias[static_cast<int64_t>(seat) * p_.dim + channel0_] += dbias;
    const T* dD = reinterpret_cast<const T*>(dD_);
    for (int64_t r = 0; r < rows_here_; ++r) p_.dD[static_cast<int64_t>(seat) * p_.dim + channel0_ + r] += dD[r];
  }

  const ScanBackwardProblem<T>& p_;
  const int64_t P_, H_, N_, NV_, heads_per_group_;
  const int64_t rows_;         // rows of headdim in a block
  const int64_t RV_;           // vectors of a block's rows (per-row values of a step)
  const int64_t blocks_;       // blocks of a head
  const int64_t row_vectors_;  // a block's state: rows_ x NV_ vectors
  const int64_t longest_, chunk_, chunks_;
  Scratch scratch_;
  // The running item (run()).
  int64_t b_ = 0, h_ = 0, g_ = 0, r0_ = 0, rows_here_ = 0, channel0_ = 0;
  int64_t first_ = 0, length_ = 0, item_chunks_ = 0;
  int64_t prepared_head_ = -1;  // batch row x heads + head of the discretized steps
  T A_ = 0;
  // State-sized: checkpoints, the chunk's states, dh; B_t and C_t; per row (a vector each):
  // parts_; per step: qparts_, dtparts_.
  V *ckpt_, *hist_, *dh_, *Bs_, *Cs_, *parts_, *qparts_, *dtparts_;
  // Per step, the block's rows as RV_ vectors; D_ and dD_ likewise.
  V *xs_, *us_, *gs_, *zs_, *dzs_, *dxs_, *sums_, *D_, *dD_;
  T *qs_, *head_deltas_, *head_slopes_, *head_decays_;
  const T *deltas_ = nullptr, *slopes_ = nullptr, *decays_ = nullptr;  // the packed chunk's
};

}  // namespace

template <typename T>
int64_t ssd_backward_items(const ScanBackwardProblem<T>& p) {
  const int64_t rows = block_rows(p);
  return p.batch * (p.dim / p.channels_per_dt) * ((p.channels_per_dt + rows - 1) / rows);
}

template <typename T>
int64_t ssd_backward_work_per_item(const ScanBackwardProblem<T>& p) {
  return steps_per_row(p.seq, p.batch, p.cu_seqlens) * block_rows(p) * p.state;
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
