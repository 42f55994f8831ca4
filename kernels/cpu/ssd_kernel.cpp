// Mamba-2 (SSD) scan and state update (ssd_kernel.h). Written as plain loops over contiguous
// rows that GCC vectorizes for whichever SIMD variant build.py compiles: the scan keeps a head's
// state transposed, [state][headdim], so its inner loop runs along headdim with no horizontal
// sums; the update works on the pool in place along the state axis.
#include "ssd_kernel.h"

#include "simd.h"  // kVectorBytes: the vector the variant executes whole

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace scan_bridge {

// Partial sums of a dot product along the state axis: a multiple of every variant's lane count.
constexpr int kLanes = 16;

// A typedef inside a class: on an alias template GCC drops the attribute (T is dependent).
template <typename T>
struct VectorOf {
  typedef T type __attribute__((vector_size(kVectorBytes)));
};
template <typename T>
using Vec = typename VectorOf<T>::type;
template <typename T>
constexpr int kWidth = kVectorBytes / sizeof(T);
// Vectors of headdim one item carries through the whole sequence: its [state][block] slice of the
// state stays in L1 (state 128: 16 KiB of fp32 with AVX-512), where a whole head's would not.
constexpr int kBlockVectors = 2;

// One timestep of K vectors of headdim: h[n, :] = decay h[n, :] + B[n] u; y = sum_n C[n] h[n, :],
// the sums kept in registers across the whole state axis.
template <typename T, int K>
inline void ssd_scan_block(Vec<T>* __restrict S, int64_t stride, int64_t N, T decay, const Vec<T>* u,
                           const T* __restrict Bt, const T* __restrict Ct, Vec<T>* acc) {
  Vec<T> in[K], sum[K];
  for (int k = 0; k < K; ++k) {
    in[k] = u[k];
    sum[k] = Vec<T>{};
  }
  for (int64_t n = 0; n < N; ++n) {
    Vec<T>* __restrict row = S + n * stride;
    const T bn = Bt[n], cn = Ct[n];
    for (int k = 0; k < K; ++k) {
      const Vec<T> s = decay * row[k] + bn * in[k];
      row[k] = s;
      sum[k] += cn * s;
    }
  }
  for (int k = 0; k < K; ++k) acc[k] = sum[k];
}

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
  for (int64_t item = begin; item < end; ++item) {
    const int64_t bh = item / blocks, b = bh / H, h = bh % H, g = h / heads_per_group;
    const int64_t first = (item % blocks) * kBlockLanes;
    const int64_t lanes = std::min<int64_t>(kBlockLanes, P - first);
    const int64_t vectors = (lanes + W - 1) / W;
    // Lanes past headdim stay zero: their u is zero throughout.
    std::memset(flat, 0, sizeof(T) * static_cast<size_t>(N * kBlockLanes));
    if (p.h0 != nullptr) {
      const T* h0 = p.h0 + (b * H + h) * P * N;
      for (int64_t i = 0; i < lanes; ++i)
        for (int64_t n = 0; n < N; ++n) flat[n * kBlockLanes + i] = h0[(first + i) * N + n];
    }
    const T A = p.A[h];
    Vec<T> u[kBlockVectors], acc[kBlockVectors];
    for (int64_t t = 0; t < p.seq; ++t) {
      const int64_t bt = b * p.seq + t;
      const T dt = p.dt[bt * H + h];
      const T decay = std::exp(dt * A);
      const T* x = p.x + (bt * H + h) * P + first;
      T* ul = reinterpret_cast<T*>(u);
      for (int64_t i = 0; i < kBlockLanes; ++i) ul[i] = i < lanes ? dt * x[i] : T(0);
      const T* Bt = p.B + (bt * G + g) * N;
      const T* Ct = p.C + (bt * G + g) * N;
      switch (vectors) {
        case 4: ssd_scan_block<T, 4>(S, kBlockVectors, N, decay, u, Bt, Ct, acc); break;
        case 3: ssd_scan_block<T, 3>(S, kBlockVectors, N, decay, u, Bt, Ct, acc); break;
        case 2: ssd_scan_block<T, 2>(S, kBlockVectors, N, decay, u, Bt, Ct, acc); break;
        default: ssd_scan_block<T, 1>(S, kBlockVectors, N, decay, u, Bt, Ct, acc); break;
      }
      std::memcpy(p.y + (bt * H + h) * P + first, acc, sizeof(T) * static_cast<size_t>(lanes));
    }
    if (p.state_out != nullptr) {
      T* out = p.state_out + (b * H + h) * P * N;
      for (int64_t i = 0; i < lanes; ++i)
        for (int64_t n = 0; n < N; ++n) out[(first + i) * N + n] = flat[n * kBlockLanes + i];
    }
  }
}

template <typename T>
void ssd_update_items(const SsdUpdateProblem<T>& p, int64_t begin, int64_t end) {
  const int64_t H = p.heads, P = p.headdim, N = p.state, G = p.groups;
  const int64_t heads_per_group = H / G;
  for (int64_t item = begin; item < end; ++item) {
    const int64_t b = item / H, h = item % H, g = h / heads_per_group;
    T* __restrict y = p.y + (b * H + h) * P;
    const int64_t row = p.rows[b];
    if (row < 0) {
      std::memset(y, 0, sizeof(T) * static_cast<size_t>(P));
      continue;
    }
    const T dt = p.dt[b * H + h];
    const T decay = std::exp(dt * p.A[h]);
    const T* __restrict x = p.x + (b * H + h) * P;
    const T* __restrict Bb = p.B + (b * G + g) * N;
    const T* __restrict Cb = p.C + (b * G + g) * N;
    T* __restrict S = p.pool + row * p.pool_row_stride + h * P * N;
    for (int64_t i = 0; i < P; ++i) {
      const T u = dt * x[i];
      T* __restrict s = S + i * N;
      // C . h in kLanes partial sums, so the compiler vectorizes the loop (a single running sum
      // is an ordered reduction it must keep scalar).
      T part[kLanes] = {};
      int64_t n = 0;
      for (; n + kLanes <= N; n += kLanes) {
        for (int k = 0; k < kLanes; ++k) {
          const T v = decay * s[n + k] + Bb[n + k] * u;
          s[n + k] = v;
          part[k] += Cb[n + k] * v;
        }
      }
      for (int k = 0; n < N; ++n, ++k) {
        const T v = decay * s[n] + Bb[n] * u;
        s[n] = v;
        part[k] += Cb[n] * v;
      }
      T sum = T(0);
      for (int k = 0; k < kLanes; ++k) sum += part[k];
      y[i] = sum;
    }
  }
}

template int64_t ssd_scan_item_count<float>(const SsdScanProblem<float>&);
template int64_t ssd_scan_item_count<double>(const SsdScanProblem<double>&);
template void ssd_scan_items<float>(const SsdScanProblem<float>&, int64_t, int64_t);
template void ssd_scan_items<double>(const SsdScanProblem<double>&, int64_t, int64_t);
template void ssd_update_items<float>(const SsdUpdateProblem<float>&, int64_t, int64_t);
template void ssd_update_items<double>(const SsdUpdateProblem<double>&, int64_t, int64_t);

}  // namespace scan_bridge
