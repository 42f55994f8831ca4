// The selective scan's backward pass for the CPU (see scan_backward.h for the contract).
//
// Lanes run over channels, as in the forward's sequence mode: h, its gradient dh and A are
// [state] vectors of W channel lanes, and B_t, C_t are broadcast. With g_t the gradient of the
// gated output, walking t backwards:
//   dy_t = g_t silu(z_t);  dz_t = g_t (C_t . h_t + D x_t) silu'(z_t)      (without z: dy_t = g_t)
//   dh  += dy_t C_t                                                    (dh carried from t + 1)
//   dC_t += dy_t h_t;  dB_t += dh (delta_t x_t);  dD += dy_t x_t
//   dx_t = dy_t D + delta_t (dh . B_t);  q = dh a_t h_{t-1} (a_t = exp(delta_t A))
//   ddelta_t = x_t (dh . B_t) + q . A;  dA += delta_t q;  dh <- a_t dh
// and ddt_t = ddelta_t d(delta_t)/d(dt_t): 0 where the clamp holds delta (torch.clamp's
// gradient), times softplus' derivative sigmoid(dt_t + bias) (1 past its threshold, 20).
// dB and dC sum over a group's channels: each chunk's per-lane terms go through one lane-sum
// tree per W state elements into the seat's accumulators.

#include "scan_backward.h"

#include <algorithm>
#include <cstring>

#include "simd.h"

namespace scan_bridge {
namespace {

template <typename T>
class BackwardRunner {
  using V = typename Lanes<T>::V;
  using Unaligned = typename Lanes<T>::Unaligned;
  static constexpr int W = Lanes<T>::W;

 public:
  explicit BackwardRunner(const ScanBackwardProblem<T>& p)
      : p_(p),
        N_(p.state),
        bc_stride_(p.groups * p.state),
        per_group_(p.dim / p.groups),
        per_group_blocks_((per_group_ + W - 1) / W),
        longest_(longest_sequence(p)),
        chunk_(chunk_steps(p, longest_)),
        chunks_((longest_ + chunk_ - 1) / chunk_),
        scratch_(Scratch::bytes<V>(chunks_ * N_) + 3 * Scratch::bytes<V>(N_) + 4 * Scratch::bytes<V>(1) +
                 11 * Scratch::bytes<V>(chunk_) + Scratch::bytes<V>((chunk_ + 1) * N_) +
                 Scratch::bytes<V>(chunk_ * N_) + 2 * Scratch::bytes<V>(N_)) {
    for (int l = 0; l < W; ++l) lane_[l] = static_cast<T>(l);
    ckpt_ = scratch_.take<V>(chunks_ * N_);
    A_ = scratch_.take<V>(N_);
    dh_ = scratch_.take<V>(N_);
    dA_ = scratch_.take<V>(N_);
    D_ = scratch_.take<V>(1);
    dD_ = scratch_.take<V>(1);
    bias_ = scratch_.take<V>(1);
    dbias_ = scratch_.take<V>(1);
    xs_ = scratch_.take<V>(chunk_);
    dls_ = scratch_.take<V>(chunk_);
    slope_ = scratch_.take<V>(chunk_);
    kept_ = scratch_.take<V>(chunk_);
    dts_ = scratch_.take<V>(chunk_);
    dtx_ = scratch_.take<V>(chunk_);
    gs_ = scratch_.take<V>(chunk_);
    zs_ = scratch_.take<V>(chunk_);
    dxs_ = scratch_.take<V>(chunk_);
    dds_ = scratch_.take<V>(chunk_);
    dzs_ = scratch_.take<V>(chunk_);
    hist_ = scratch_.take<V>((chunk_ + 1) * N_);
    decay_ = scratch_.take<V>(chunk_ * N_);
    dBp_ = scratch_.take<V>(N_);
    dCp_ = scratch_.take<V>(N_);
  }

  // The steps of a chunk: the whole (longest) sequence where its states and decays fit in
  // kWholeSequenceBytes, which spares the checkpoint walk, else kBackwardChunk.
  static int64_t chunk_steps(const ScanBackwardProblem<T>& p, int64_t longest) {
    const int64_t bytes = static_cast<int64_t>(sizeof(V)) * (2 * longest + 1) * p.state;
    return bytes <= kWholeSequenceBytes ? std::max<int64_t>(longest, 1) : kBackwardChunk;
  }

  void run_range(int64_t begin, int64_t end, int seat) {
    for (int64_t item = begin; item < end; ++item) run(item, seat);
  }

 private:
  // Row-major items (item = b * blocks + block), as the forward orders them with vectors
  // narrower than a cache line: a line of x, dt, dy then holds several blocks' channels, and
  // consecutive items read it while it is in cache.
  void run(int64_t item, int seat) {
    const int64_t blocks = p_.groups * per_group_blocks_;
    const int64_t b = item / blocks;
    const int64_t block = item % blocks;
    const int64_t g = block / per_group_blocks_;
    const int64_t d0 = g * per_group_ + (block % per_group_blocks_) * W;
    const int lanes = static_cast<int>(std::min<int64_t>(W, per_group_ - (block % per_group_blocks_) * W));
    if (block != prepared_block_) {
      prepare_block(d0, lanes);
      prepared_block_ = block;
    }
    // Where the item's sequence starts among the operands' [row, time] positions, its length
    // and chunks: packed sequences share one row, each from its own first time.
    first_ = p_.cu_seqlens == nullptr ? b * p_.seq : p_.cu_seqlens[b];
    length_ = p_.cu_seqlens == nullptr ? p_.seq : p_.cu_seqlens[b + 1] - first_;
    item_chunks_ = (length_ + chunk_ - 1) / chunk_;
    checkpoint_pass(b, g, d0, lanes);
    reverse_pass(b, g, d0, lanes, seat);
  }

  void prepare_block(int64_t d0, int lanes) {
    std::memset(static_cast<void*>(A_), 0, N_ * sizeof(V));
    for (int l = 0; l < lanes; ++l)
      for (int64_t n = 0; n < N_; ++n) A_[n][l] = p_.A[(d0 + l) * N_ + n];
    D_[0] = V{};
    if (p_.D != nullptr)
      for (int l = 0; l < lanes; ++l) D_[0][l] = p_.D[d0 + l];
    bias_[0] = V{};
    if (p_.dt_bias != nullptr)
      for (int l = 0; l < lanes; ++l) bias_[0][l] = p_.dt_bias[d0 + l];
  }

  // tile[t][l] = src at the item's time t0 + t, channel d0 + l; lanes past `lanes` are zero. A
  // full block moves as one unaligned vector: a memcpy of a run-time length is a library call
  // per row.
  void load_tile(const T* src, int64_t t0, int steps, int64_t d0, int lanes, V* tile) const {
    const T* row = src + (first_ + t0) * p_.dim + d0;
    for (int t = 0; t < steps; ++t, row += p_.dim) {
      if (lanes == W) {
        tile[t] = *reinterpret_cast<const Unaligned*>(row);
      } else {
        tile[t] = V{};
        std::memcpy(static_cast<void*>(tile + t), row, lanes * sizeof(T));
      }
    }
  }

  void store_tile(T* dst, int64_t t0, int steps, int64_t d0, int lanes, const V* tile) const {
    T* row = dst + (first_ + t0) * p_.dim + d0;
    for (int t = 0; t < steps; ++t, row += p_.dim) {
      if (lanes == W)
        *reinterpret_cast<Unaligned*>(row) = tile[t];
      else
        std::memcpy(row, static_cast<const void*>(tile + t), lanes * sizeof(T));
    }
  }

  // x, delta (plain and as Math<T>::decay takes it), d(delta)/d(dt) and delta x for a chunk, and
  // where its B and C rows start (read in place: a row is `bc_stride_` apart).
  void pack(int64_t g, int64_t t0, int steps, int64_t d0, int lanes) {
    load_tile(p_.x, t0, steps, d0, lanes, xs_);
    load_tile(p_.dt, t0, steps, d0, lanes, dls_);
    const T lo = static_cast<T>(p_.dt_min), hi = static_cast<T>(p_.dt_max);
    const V one = Lanes<T>::splat(static_cast<T>(1)), zero = V{};
    for (int t = 0; t < steps; ++t) {
      const V v = dls_[t] + bias_[0];
      V d = v, slope = one, kept = one;
      if (p_.dt_softplus) {
        d = Math<T>::softplus(v);
        slope = v > static_cast<T>(20) ? one : Math<T>::sigmoid(v);
      }
      // `kept`: zero where the clamp cut dt. The forward's clamp lets NaN through; torch.clamp's
      // gradient is 0 for it (its comparisons are false), so the test is written the other way round.
      if (p_.has_dt_min) {
        kept = d >= lo ? kept : zero;
        d = d < lo ? lo : d;
      }
      if (p_.has_dt_max) {
        kept = d <= hi ? kept : zero;
        d = d > hi ? hi : d;
      }
      dls_[t] = d;
      slope_[t] = slope;
      kept_[t] = kept;
      dtx_[t] = d * xs_[t];
      dts_[t] = Math<T>::scale_dt(d);
    }
    const int64_t first = (first_ + t0) * bc_stride_ + g * N_;
    Bs_ = p_.B + first;
    Cs_ = p_.C + first;
  }

  // The states entering each chunk, from h0 (the last chunk's own steps are not needed).
  void checkpoint_pass(int64_t b, int64_t g, int64_t d0, int lanes) {
    V* h = ckpt_;
    load_state(p_.h0, b, d0, lanes, h);
    for (int64_t c = 0; c + 1 < item_chunks_; ++c) {
      const int64_t t0 = c * chunk_;
      const int steps = static_cast<int>(chunk_);
      std::memcpy(static_cast<void*>(h + N_), static_cast<const void*>(h), N_ * sizeof(V));
      h += N_;
      pack(g, t0, steps, d0, lanes);
      for (int t = 0; t < steps; ++t) advance(t, h, h, nullptr);
    }
  }

  // state[b, d0 + l, n] as [n][lanes] (zeros where absent or past `lanes`).
  void load_state(const T* src, int64_t b, int64_t d0, int lanes, V* out) const {
    std::memset(static_cast<void*>(out), 0, N_ * sizeof(V));
    if (src == nullptr) return;
    for (int l = 0; l < lanes; ++l)
      for (int64_t n = 0; n < N_; ++n) out[n][l] = src[(b * p_.dim + d0 + l) * N_ + n];
  }

  void reverse_pass(int64_t b, int64_t g, int64_t d0, int lanes, int seat) {
    load_state(p_.dstate, b, d0, lanes, dh_);
    std::memset(static_cast<void*>(dA_), 0, N_ * sizeof(V));
    dD_[0] = dbias_[0] = V{};
    for (int64_t c = item_chunks_ - 1; c >= 0; --c) {
      const int64_t t0 = c * chunk_;
      const int steps = static_cast<int>(std::min<int64_t>(chunk_, length_ - t0));
      pack(g, t0, steps, d0, lanes);
      load_tile(p_.dy, t0, steps, d0, lanes, gs_);
      if (p_.z != nullptr) load_tile(p_.z, t0, steps, d0, lanes, zs_);
      recompute(c, steps);
      const int64_t seat_offset = static_cast<int64_t>(seat) * positions_ * bc_stride_;
      for (int t = steps - 1; t >= 0; --t) {
        reverse_step(t);
        // This step's dB and dC terms are summed over the lanes at once, while in L1.
        const int64_t at = seat_offset + (first_ + t0 + t) * bc_stride_ + g * N_;
        add_lane_sums(dBp_, p_.dB + at, lanes);
        add_lane_sums(dCp_, p_.dC + at, lanes);
      }
      store_tile(p_.dx, t0, steps, d0, lanes, dxs_);
      store_tile(p_.ddt, t0, steps, d0, lanes, dds_);
      if (p_.z != nullptr) store_tile(p_.dz, t0, steps, d0, lanes, dzs_);
    }
    if (p_.dh0 != nullptr)
      for (int l = 0; l < lanes; ++l)
        for (int64_t n = 0; n < N_; ++n) p_.dh0[(b * p_.dim + d0 + l) * N_ + n] = dh_[n][l];
    T* dA = p_.dA + static_cast<int64_t>(seat) * p_.dim * N_;
    for (int l = 0; l < lanes; ++l)
      for (int64_t n = 0; n < N_; ++n) dA[(d0 + l) * N_ + n] += dA_[n][l];
    T* dD = p_.dD + static_cast<int64_t>(seat) * p_.dim;
    for (int l = 0; l < lanes; ++l) dD[d0 + l] += dD_[0][l];
    T* dbias = p_.ddt_bias + static_cast<int64_t>(seat) * p_.dim;
    for (int l = 0; l < lanes; ++l) dbias[d0 + l] += dbias_[0][l];
  }

  // hist_[t + 1] = h_t for the chunk's steps (hist_[0]: its checkpoint), with the decays.
  void recompute(int64_t c, int steps) {
    std::memcpy(static_cast<void*>(hist_), static_cast<const void*>(ckpt_ + c * N_), N_ * sizeof(V));
    for (int t = 0; t < steps; ++t) advance(t, hist_ + t * N_, hist_ + (t + 1) * N_, decay_ + t * N_);
  }

  // cur = a_t prev + (delta_t x_t) B_t for step t of the packed chunk (cur may be prev); the
  // decays a_t go to `decays` where it is given (one per state element).
  void advance(int t, const V* prev, V* cur, V* decays) {
    const V u = dtx_[t];
    const T* Bt = Bs_ + t * bc_stride_;
    for (int64_t n = 0; n < N_; ++n) {
      const V a = Math<T>::decay(dts_[t], A_[n]);
      if (decays != nullptr) decays[n] = a;
      cur[n] = a * prev[n] + u * Bt[n];
    }
  }

  void reverse_step(int t) {
    const V x = xs_[t];
    const V* h = hist_ + (t + 1) * N_;
    const V* h_prev = hist_ + t * N_;
    const T* Bt = Bs_ + t * bc_stride_;
    const T* Ct = Cs_ + t * bc_stride_;
    V dy = gs_[t];
    if (p_.z != nullptr) {
      // Without D no D x term at all: 0 * inf would make an infinite x's y NaN.
      V y = p_.D != nullptr ? D_[0] * x : V{};
      for (int64_t n = 0; n < N_; ++n) y += h[n] * Ct[n];
      const V z = zs_[t];
      const V sg = Math<T>::sigmoid(z);
      dzs_[t] = dy * y * sg * (static_cast<T>(1) + z * (static_cast<T>(1) - sg));
      dy = dy * z * sg;
    }
    dD_[0] += dy * x;
    const V u = dtx_[t];
    const V dl = dls_[t];
    V* dB = dBp_;
    V* dC = dCp_;
    V dhB = {}, qA = {};
    const V* a = decay_ + t * N_;
    for (int64_t n = 0; n < N_; ++n) {
      const V dh = dh_[n] + dy * Ct[n];
      dC[n] = dy * h[n];
      dB[n] = dh * u;
      dhB += dh * Bt[n];
      const V q = dh * a[n] * h_prev[n];
      dA_[n] += q * dl;
      qA += q * A_[n];
      dh_[n] = a[n] * dh;
    }
    dxs_[t] = p_.D != nullptr ? dy * D_[0] + dl * dhB : dl * dhB;
    // Where the clamp cut dt, torch.clamp selects a zero gradient: an infinite one times a zero
    // would be NaN. A softplus slope that underflowed to zero multiplies, as torch's does.
    dds_[t] = kept_[t] == V{} ? V{} : (x * dhB + qA) * slope_[t];
    dbias_[0] += dds_[t];
  }

  // The lane of a LaneSums result that holds input i's sum.
  struct SumOfInput {
    static constexpr int lane(int i) {
      for (int c = 0; c < W; ++c)
        if (LaneSums<T>::kSlot[c] == i) return c;
      return 0;
    }
  };

  // out[n] += the sum of the first `lanes` lanes of v[n], for n < state: W sums at a time, put
  // back in input order by one shuffle and added to `out` as one vector where W of them fit.
  // The lanes past a partial block's channels are left out by a select, not summed as zeros:
  // there an infinite B or C times the padding's zero dy is NaN.
  void add_lane_sums(const V* v, T* out, int lanes) {
    const T channels = static_cast<T>(lanes);
    for (int64_t n0 = 0; n0 < N_; n0 += W) {
      V tmp[W];
      for (int i = 0; i < W; ++i) {
        tmp[i] = n0 + i < N_ ? v[n0 + i] : V{};
        if (lanes < W) tmp[i] = lane_ < channels ? tmp[i] : V{};
      }
      const V sums = Shuffles<T>::template apply<SumOfInput>(LaneSums<T>::of(tmp), V{});
      if (n0 + W <= N_) {
        *reinterpret_cast<typename Lanes<T>::Unaligned*>(out + n0) += sums;
      } else {
        for (int64_t n = n0; n < N_; ++n) out[n] += sums[n - n0];
      }
    }
  }

  const ScanBackwardProblem<T>& p_;
  const int64_t N_, bc_stride_, per_group_, per_group_blocks_;
  const int64_t longest_;  // steps of the longest sequence
  const int64_t chunk_;    // steps in a chunk
  const int64_t chunks_;   // of the longest sequence: the checkpoints' room
  // [row, time] positions of the [batch, seq, ...] operands: each seat's dB and dC hold as many.
  const int64_t positions_ = p_.cu_seqlens == nullptr ? p_.batch * p_.seq : p_.seq;
  Scratch scratch_;
  int64_t prepared_block_ = -1;
  int64_t first_ = 0, length_ = 0, item_chunks_ = 0;  // the running item's sequence (run())
  V *ckpt_, *A_, *dh_, *dA_, *D_, *dD_, *bias_, *dbias_, *xs_, *dls_, *slope_, *kept_, *dts_, *dtx_, *gs_, *zs_, *dxs_,
      *dds_, *dzs_;
  const T *Bs_ = nullptr, *Cs_ = nullptr;  // the packed chunk's first B and C rows
  V *hist_, *decay_, *dBp_, *dCp_;
  V lane_;  // each lane's index
};

}  // namespace

template <typename T>
int64_t scan_backward_items(const ScanBackwardProblem<T>& p) {
  constexpr int W = Lanes<T>::W;
  const int64_t per_group = p.dim / p.groups;
  return p.groups * ((per_group + W - 1) / W) * p.batch;
}

template <typename T>
int64_t scan_backward_work_per_item(const ScanBackwardProblem<T>& p) {
  return steps_per_row(p.seq, p.batch, p.cu_seqlens) * Lanes<T>::W * p.state;
}

template <typename T>
void scan_backward_run(const ScanBackwardProblem<T>& p, WorkQueue& queue, int seat) {
  BackwardRunner<T> runner(p);
  int64_t begin, end;
  while (queue.take(seat, &begin, &end)) runner.run_range(begin, end, seat);
}

template int64_t scan_backward_items<float>(const ScanBackwardProblem<float>&);
template int64_t scan_backward_items<double>(const ScanBackwardProblem<double>&);
template int64_t scan_backward_work_per_item<float>(const ScanBackwardProblem<float>&);
template int64_t scan_backward_work_per_item<double>(const ScanBackwardProblem<double>&);
template void scan_backward_run<float>(const ScanBackwardProblem<float>&, WorkQueue&, int);
template void scan_backward_run<double>(const ScanBackwardProblem<double>&, WorkQueue&, int);

}  // namespace scan_bridge
