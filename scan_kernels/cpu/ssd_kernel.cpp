// Mamba-2 (SSD) scan and state update (ssd_kernel.h). The scan keeps a head's state
// transposed, [state][headdim], so its inner loop runs along headdim with no horizontal sums, and
// scaled by the decay since a recent step (ScaledSteps), so a step adds to it without first
// multiplying it; the update works on the pool in place along the state axis, W rows of headdim at a time, their
// sums over the state folded into one vector by LaneSums.
#include "ssd_kernel.h"

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace scan_bridge {

// Partial sums of a dot product along the state axis where it is no multiple of the vector:
// a multiple of every variant's lane count.
constexpr int kLanes = 16;

template <typename T>
using Vec = typename Lanes<T>::V;
template <typename T>
constexpr int kWidth = Lanes<T>::W;
// Vectors of headdim one item carries through the whole sequence: its [state][block] slice of the
// state stays in L1 (state 128: 16 KiB of fp32 with AVX-512), where a whole head's would not.
// Narrower vectors take four, so that a timestep's own work (its decay, inputs and y) is shared
// by as many state elements: with two, the AVX2 and baseline scans were slower
// (docs/performance.md, "SSD CPU kernel"); four are what the baseline's sixteen registers hold.
constexpr int kBlockVectors = kVectorBytes == 64 ? 2 : 4;

// dt <- clamp(softplus(dt + bias)) for head h; softplus with torch's threshold 20.
template <typename T>
inline T discretized_dt(T dt, const SsdOptions<T>& o, int64_t h) {
  if (o.dt_bias != nullptr) dt += o.dt_bias[h];
  if (o.dt_softplus) dt = dt > T(20) ? dt : std::log1p(std::exp(dt));
  if (o.has_dt_min) dt = dt < o.dt_min ? o.dt_min : dt;
  if (o.has_dt_max) dt = dt > o.dt_max ? o.dt_max : dt;
  return dt;
}

// y[i] <- (y[i] + D[i] x[i]) silu(z[i]) for i < n, each factor where given.
template <typename T>
inline void skip_and_gate(T* __restrict y, const T* __restrict x, const T* __restrict D, const T* __restrict z,
                          int64_t n) {
  using V = Vec<T>;
  using VU = typename Lanes<T>::Unaligned;
  constexpr int W = kWidth<T>;
  if (D == nullptr && z == nullptr) return;
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    V v = *reinterpret_cast<VU*>(y + i);
    if (D != nullptr) v += V(*reinterpret_cast<const VU*>(D + i)) * V(*reinterpret_cast<const VU*>(x + i));
    if (z != nullptr) v *= Math<T>::silu(*reinterpret_cast<const VU*>(z + i));
    *reinterpret_cast<VU*>(y + i) = v;
  }
  for (; i < n; ++i) {
    T v = y[i];
    if (D != nullptr) v += D[i] * x[i];
    if (z != nullptr) v *= z[i] / (T(1) + std::exp(-z[i]));
    y[i] = v;
  }
}

// Timesteps a pass over a block's state: each element is loaded and stored once for them all.
// With one a pass the loop ran well short of its multiply-adds' rate, with or without the
// multiply that the scaled state drops (docs/performance.md, "SSD CPU kernel").
constexpr int kStepsPerPass = 2;

// M timesteps of K vectors of headdim on the scaled state (see ScaledSteps): for each,
// h[n, :] = decay h[n, :] + B[n] u, or with `rescale` false h[n, :] += B[n] u, a multiply fewer a
// state element; y = sum_n C[n] h[n, :], the sums kept in registers across the whole state axis.
template <typename T, int M, int K, bool rescale>
inline void ssd_scan_block(Vec<T>* __restrict S, int64_t stride, int64_t N, const T* decay,
                           const Vec<T> (*u)[kBlockVectors], const T* const* Bt, const T* const* Ct,
                           Vec<T> (*acc)[kBlockVectors]) {
  Vec<T> in[M][K], sum[M][K];
  for (int m = 0; m < M; ++m)
    for (int k = 0; k < K; ++k) {
      in[m][k] = u[m][k];
      sum[m][k] = Vec<T>{};
    }
  for (int64_t n = 0; n < N; ++n) {
    Vec<T>* __restrict row = S + n * stride;
    Vec<T> s[K];
    for (int k = 0; k < K; ++k) s[k] = row[k];
    for (int m = 0; m < M; ++m) {
      const T bn = Bt[m][n], cn = Ct[m][n];
      for (int k = 0; k < K; ++k) {
        s[k] = rescale ? decay[m] * s[k] + bn * in[m][k] : s[k] + bn * in[m][k];
        sum[m][k] += cn * s[k];
      }
    }
    for (int k = 0; k < K; ++k) row[k] = s[k];
  }
  for (int m = 0; m < M; ++m)
    for (int k = 0; k < K; ++k) acc[m][k] = sum[m][k];
}

// The pass over a block of `vectors` vectors (at most K = kBlockVectors).
template <typename T, int M, bool rescale, int K = kBlockVectors>
inline void ssd_scan_pass(int vectors, Vec<T>* __restrict S, int64_t stride, int64_t N, const T* decay,
                          const Vec<T> (*u)[kBlockVectors], const T* const* Bt, const T* const* Ct,
                          Vec<T> (*acc)[kBlockVectors]) {
  if constexpr (K > 1) {
    if (vectors < K) {
      ssd_scan_pass<T, M, rescale, K - 1>(vectors, S, stride, N, decay, u, Bt, Ct, acc);
      return;
    }
  }
  ssd_scan_block<T, M, K, rescale>(S, stride, N, decay, u, Bt, Ct, acc);
}

// Steps ahead whose x, z and y lines are fetched: a block's lines of one step lie a whole
// [heads, headdim] row apart from the next step's, too far for the hardware's prefetchers.
constexpr int64_t kPrefetchSteps = 8;

template <typename T>
inline void prefetch_block(const SsdScanProblem<T>& p, int64_t row, int64_t first, int64_t lanes) {
  const int64_t at = row * p.headdim + first;
  for (int64_t i = 0; i < lanes; i += kScratchAlign / static_cast<int64_t>(sizeof(T))) {
    __builtin_prefetch(p.x + at + i);
    if (p.options.z != nullptr) __builtin_prefetch(p.options.z + at + i);
    __builtin_prefetch(p.y + at + i, 1);
  }
}

// How far the scaled state may drift from the true one, as a log: e^30 leaves fp32 over 10^25
// of headroom above the state's own magnitude.
constexpr double kMaxLogScale = 30;

// One sequence's per-step factors for a head: the kernel keeps g_t = h_t / exp(cs_t - cs_r),
// cs the cumulative log decay and r the last rescaled step, so that a step is
// g_t = g_(t-1) + exp(cs_r - cs_t) delta_t x_t (x) B_t and y_t = exp(cs_t - cs_r) C_t . g_t.
// Where |cs_t - cs_r| would pass kMaxLogScale the step rescales instead (g_t = h_t, the plain
// recurrence with decay exp(cs_t - cs_r)) and r = t.
template <typename T>
struct ScaledSteps {
  using V = Vec<T>;
  static constexpr int W = kWidth<T>;
  // Per step t, in whole vectors of steps: exp(cs_r - cs_t) delta_t (delta_t where the step
  // rescales), exp(cs_t - cs_r) (1 where it rescales), and the decay the step multiplies the
  // state by: exp(cs_t - cs_r) with the r before where it rescales, else 1.
  std::vector<V> input, output, decay;
  std::vector<uint8_t> rescales;

  T in(int64_t t) const { return reinterpret_cast<const T*>(input.data())[t]; }
  T out(int64_t t) const { return reinterpret_cast<const T*>(output.data())[t]; }
  T decay_at(int64_t t) const { return reinterpret_cast<const T*>(decay.data())[t]; }

  void compute(const SsdScanProblem<T>& p, int64_t h, int64_t first_time, int64_t length) {
    const int64_t vectors = (length + W - 1) / W;
    for (auto* v : {&input, &output, &decay}) v->assign(static_cast<size_t>(vectors), V{});
    rescales.resize(static_cast<size_t>(length));
    // Logs first, each vector's exps after: cs_t - cs_r (0 where the step rescales) and the
    // rescaling steps' log decays.
    T* deltas = reinterpret_cast<T*>(input.data());
    T* log_scales = reinterpret_cast<T*>(output.data());
    T* log_decays = reinterpret_cast<T*>(decay.data());
    const double A = static_cast<double>(p.A[h]);
    double since = 0;  // cs_t - cs_r, summed in fp64 so that no rounding accumulates
    for (int64_t t = 0; t < length; ++t) {
      deltas[t] = discretized_dt(p.dt[(first_time + t) * p.heads + h], p.options, h);
      since += static_cast<double>(deltas[t]) * A;
      rescales[t] = since > kMaxLogScale || since < -kMaxLogScale;
      if (rescales[t]) {
        log_decays[t] = static_cast<T>(since);
        since = 0;
      }
      log_scales[t] = static_cast<T>(since);
    }
    for (int64_t j = 0; j < vectors; ++j) {
      decay[j] = exp_lanes<T>(decay[j]);
      input[j] *= exp_lanes<T>(-output[j]);
      output[j] = exp_lanes<T>(output[j]);
    }
  }
};

template <typename T>
int64_t ssd_scan_blocks(int64_t headdim) {
  const int64_t vectors = (headdim + kWidth<T> - 1) / kWidth<T>;
  return (vectors + kBlockVectors - 1) / kBlockVectors;
}

template <typename T>
int64_t ssd_scan_item_count(const SsdScanProblem<T>& p) {
  return p.batch * p.heads * ssd_scan_blocks<T>(p.headdim);
}

template <typename T>
void ssd_scan_items(const SsdScanProblem<T>& p, int64_t begin, int64_t end) {
  using VU = typename Lanes<T>::Unaligned;
  constexpr int W = kWidth<T>;
  constexpr int64_t kBlockLanes = kBlockVectors * W;
  const int64_t H = p.heads, P = p.headdim, N = p.state, G = p.groups;
  const int64_t heads_per_group = H / G;
  const int64_t blocks = ssd_scan_blocks<T>(P);
  // One block of headdim's state, [state][block lanes], L1-resident for the whole sequence.
  thread_local std::vector<Vec<T>> state_buffer;
  state_buffer.resize(static_cast<size_t>(N * kBlockVectors));
  Vec<T>* S = state_buffer.data();
  T* flat = reinterpret_cast<T*>(S);
  // A head's factors serve each of its blocks: items of one head are consecutive.
  thread_local ScaledSteps<T> steps;
  int64_t steps_of = -1;
  for (int64_t item = begin; item < end; ++item) {
    const int64_t bh = item / blocks, b = bh / H, h = bh % H, g = h / heads_per_group;
    const int64_t first = (item % blocks) * kBlockLanes;
    const int64_t lanes = std::min<int64_t>(kBlockLanes, P - first);
    const int64_t vectors = (lanes + W - 1) / W;
    // Packed sequences share one row of the operands, each from its own first time.
    const int64_t first_time = p.cu_seqlens == nullptr ? b * p.seq : p.cu_seqlens[b];
    const int64_t length = (p.cu_seqlens == nullptr ? first_time + p.seq : p.cu_seqlens[b + 1]) - first_time;
    if (steps_of != bh) {
      steps.compute(p, h, first_time, length);
      steps_of = bh;
    }
    // Lanes past headdim stay zero: their u is zero throughout.
    std::memset(flat, 0, sizeof(T) * static_cast<size_t>(N * kBlockLanes));
    const int64_t state_at = p.state_rows != nullptr ? p.state_rows[b] * p.state_row_stride : b * H * P * N;
    if (p.h0 != nullptr) {
      const T* h0 = p.h0 + state_at + h * P * N;
      for (int64_t i = 0; i < lanes; ++i)
        for (int64_t n = 0; n < N; ++n) flat[n * kBlockLanes + i] = h0[(first + i) * N + n];
    }
    const T* D = p.options.D == nullptr ? nullptr : p.options.D + h * P + first;
    Vec<T> u[kStepsPerPass][kBlockVectors], acc[kStepsPerPass][kBlockVectors];
    T decay[kStepsPerPass];
    const T* Bt[kStepsPerPass];
    const T* Ct[kStepsPerPass];
    for (int64_t t0 = 0; t0 < length; t0 += kStepsPerPass) {
      const int count = static_cast<int>(std::min<int64_t>(kStepsPerPass, length - t0));
      bool rescale = false;
      for (int m = 0; m < count; ++m) {
        const int64_t t = t0 + m, bt = first_time + t;
        const T scale = steps.in(t);
        const T* x = p.x + (bt * H + h) * P + first;
        if (t + kPrefetchSteps < length) prefetch_block(p, (bt + kPrefetchSteps) * H + h, first, lanes);
        // A full block's inputs as whole vectors: written lane by lane, they were read back as
        // vectors before the stores had left the store buffer, a stall on every step.
        if (lanes == kBlockLanes) {
          const Vec<T> scales = Lanes<T>::splat(scale);
          for (int k = 0; k < kBlockVectors; ++k)
            u[m][k] = scales * Vec<T>(*reinterpret_cast<const VU*>(x + k * W));
        } else {
          T* ul = reinterpret_cast<T*>(u[m]);
          for (int64_t i = 0; i < kBlockLanes; ++i) ul[i] = i < lanes ? scale * x[i] : T(0);
        }
        Bt[m] = p.B + (bt * G + g) * N;
        Ct[m] = p.C + (bt * G + g) * N;
        rescale |= steps.rescales[t] != 0;
        decay[m] = steps.decay_at(t);
      }
      if (count == kStepsPerPass) {
        if (rescale) ssd_scan_pass<T, kStepsPerPass, true>(vectors, S, kBlockVectors, N, decay, u, Bt, Ct, acc);
        else ssd_scan_pass<T, kStepsPerPass, false>(vectors, S, kBlockVectors, N, decay, u, Bt, Ct, acc);
      } else {
        if (rescale) ssd_scan_pass<T, 1, true>(vectors, S, kBlockVectors, N, decay, u, Bt, Ct, acc);
        else ssd_scan_pass<T, 1, false>(vectors, S, kBlockVectors, N, decay, u, Bt, Ct, acc);
      }
      for (int m = 0; m < count; ++m) {
        const int64_t t = t0 + m, bt = first_time + t;
        const Vec<T> out = Lanes<T>::splat(steps.out(t));
        const T* x = p.x + (bt * H + h) * P + first;
        T* y = p.y + (bt * H + h) * P + first;
        if (lanes == kBlockLanes) {
          for (int k = 0; k < kBlockVectors; ++k) *reinterpret_cast<VU*>(y + k * W) = out * acc[m][k];
        } else {
          for (int k = 0; k < kBlockVectors; ++k) acc[m][k] *= out;
          std::memcpy(y, acc[m], sizeof(T) * static_cast<size_t>(lanes));
        }
        skip_and_gate(y, x, D, p.options.z == nullptr ? nullptr : p.options.z + (bt * H + h) * P + first, lanes);
      }
    }
    if (p.state_out != nullptr) {
      // The scaled state back to the true one.
      const T scale = length > 0 ? steps.out(length - 1) : T(1);
      T* out = p.state_out + state_at + h * P * N;
      for (int64_t i = 0; i < lanes; ++i)
        for (int64_t n = 0; n < N; ++n) out[(first + i) * N + n] = scale * flat[n * kBlockLanes + i];
    }
  }
}

// W rows of headdim (rows c of S, N apart; x[c] their inputs) one timestep on: the state
// axis in `vecs` vectors, B and C as such; y[0 .. W) = C . h of each row, the W sums folded
// into one vector at the end.
template <typename T>
inline void ssd_update_rows(T* __restrict S, int64_t N, int64_t vecs, T decay, T dt, const T* __restrict x,
                            const T* __restrict B, const T* __restrict C, T* __restrict y) {
  using V = Vec<T>;
  using VU = typename Lanes<T>::Unaligned;
  constexpr int W = kWidth<T>;
  const V a = Lanes<T>::splat(decay);
  V acc[W];
  for (int c = 0; c < W; ++c) acc[c] = V{};
#pragma GCC unroll 16
  for (int c = 0; c < W; ++c) {
    const V u = Lanes<T>::splat(dt * x[c]);
    V& sum = acc[LaneSums<T>::kSlot[c]];
    T* row = S + c * N;
    for (int64_t k = 0; k < vecs; ++k) {
      VU* s = reinterpret_cast<VU*>(row + k * W);
      const V v = a * V(*s) + V(*reinterpret_cast<const VU*>(B + k * W)) * u;
      *s = v;
      sum += v * V(*reinterpret_cast<const VU*>(C + k * W));
    }
  }
  const V out = LaneSums<T>::of(acc);
  std::memcpy(y, &out, sizeof(V));
}

// One row of headdim, any state size: C . h in kLanes partial sums, so the compiler vectorizes
// the loop (a single running sum is an ordered reduction it must keep scalar).
template <typename T>
inline T ssd_update_row(T* __restrict s, int64_t N, T decay, T u, const T* __restrict B, const T* __restrict C) {
  T part[kLanes] = {};
  int64_t n = 0;
  for (; n + kLanes <= N; n += kLanes) {
    for (int k = 0; k < kLanes; ++k) {
      const T v = decay * s[n + k] + B[n + k] * u;
      s[n + k] = v;
      part[k] += C[n + k] * v;
    }
  }
  for (int k = 0; n < N; ++n, ++k) {
    const T v = decay * s[n] + B[n] * u;
    s[n] = v;
    part[k] += C[n] * v;
  }
  T sum = T(0);
  for (int k = 0; k < kLanes; ++k) sum += part[k];
  return sum;
}

template <typename T>
void ssd_update_items(const SsdUpdateProblem<T>& p, int64_t begin, int64_t end) {
  constexpr int W = kWidth<T>;
  const int64_t H = p.heads, P = p.headdim, N = p.state, G = p.groups;
  const int64_t heads_per_group = H / G;
  const SsdOptions<T>& o = p.options;
  // Whole vectors along the state axis (every state size that is a multiple of W): W rows of
  // headdim at a time; other rows one by one.
  const int64_t vecs = N % W == 0 ? N / W : 0;
  for (int64_t item = begin; item < end; ++item) {
    const int64_t b = item / H, h = item % H, g = h / heads_per_group;
    T* __restrict y = p.y + (b * H + h) * P;
    const int64_t row = p.rows[b];
    if (row < 0) {
      std::memset(y, 0, sizeof(T) * static_cast<size_t>(P));
      continue;
    }
    const T dt = discretized_dt(p.dt[b * H + h], o, h);
    const T decay = std::exp(dt * p.A[h]);
    const T* __restrict x = p.x + (b * H + h) * P;
    const T* __restrict Bb = p.B + (b * G + g) * N;
    const T* __restrict Cb = p.C + (b * G + g) * N;
    T* __restrict S = p.pool + row * p.pool_row_stride + h * P * N;
    int64_t i = 0;
    if (vecs > 0)
      for (; i + W <= P; i += W) ssd_update_rows(S + i * N, N, vecs, decay, dt, x + i, Bb, Cb, y + i);
    for (; i < P; ++i) y[i] = ssd_update_row(S + i * N, N, decay, dt * x[i], Bb, Cb);
    skip_and_gate(y, x, o.D == nullptr ? nullptr : o.D + h * P, o.z == nullptr ? nullptr : o.z + (b * H + h) * P, P);
  }
}

template int64_t ssd_scan_item_count<float>(const SsdScanProblem<float>&);
template int64_t ssd_scan_item_count<double>(const SsdScanProblem<double>&);
template void ssd_scan_items<float>(const SsdScanProblem<float>&, int64_t, int64_t);
template void ssd_scan_items<double>(const SsdScanProblem<double>&, int64_t, int64_t);
template void ssd_update_items<float>(const SsdUpdateProblem<float>&, int64_t, int64_t);
template void ssd_update_items<double>(const SsdUpdateProblem<double>&, int64_t, int64_t);

}  // namespace scan_bridge
