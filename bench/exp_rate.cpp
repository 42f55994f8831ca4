// How many fp32 decays exp(dt * A) a second the C++ kernels' own vector math computes on this
// CPU, per SIMD variant: the exp throughput bound of a Mamba-1 scan, which computes one decay
// per state element. Built from scan_kernels/cpu/scan_kernel.cpp itself (included, so the probe
// times the very inline code the kernels use), with the variant's flags.
//
//   exp_rate THREADS SECONDS  ->  prints "decays_per_second simd_description"
#include "scan_kernel.cpp"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

using scan_bridge::Lanes;
using scan_bridge::Math;

namespace {

constexpr int kVectors = 64;  // one L1-resident tile of inputs, as the scan's chunks are

volatile float g_sink;

// Decays over the tile until `seconds` pass; returns how many it computed.
double run(double seconds, int seed) {
  using V = Lanes<float>::V;
  constexpr int W = Lanes<float>::W;
  alignas(64) float dt[kVectors * W], a[kVectors * W];
  unsigned s = 12345u + seed;
  for (int i = 0; i < kVectors * W; ++i) {
    s = s * 1664525u + 1013904223u;
    const float u = (s >> 8) * (1.0f / 16777216.0f);
    dt[i] = (0.01f + 0.49f * u) * Math<float>::kDecayScale;
    a[i] = -0.1f - 1.9f * (1.0f - u);
  }
  // Four sums, so the adds' latency never paces the decays.
  V acc[4] = {};
  long long rounds = 0;
  const auto start = std::chrono::steady_clock::now();
  const auto until = start + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < until) {
    for (int r = 0; r < 256; ++r) {
      // The tile is read again every round: the compiler may not hoist the decays out.
      asm volatile("" ::: "memory");
      for (int i = 0; i < kVectors; ++i) {
        V d, A;
        __builtin_memcpy(&d, dt + i * W, sizeof(V));
        __builtin_memcpy(&A, a + i * W, sizeof(V));
        acc[i % 4] += Math<float>::decay(d, A);
      }
    }
    rounds += 256;
  }
  float total = 0;
  for (int i = 0; i < W; ++i) total += acc[0][i] + acc[1][i] + acc[2][i] + acc[3][i];
  g_sink = total;
  return static_cast<double>(rounds) * kVectors * W;
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 1;
  const double seconds = argc > 2 ? std::atof(argv[2]) : 0.5;
  std::vector<double> counts(threads);
  std::vector<std::thread> pool;
  const auto start = std::chrono::steady_clock::now();
  for (int t = 0; t < threads; ++t) pool.emplace_back([&, t] { counts[t] = run(seconds, t); });
  for (auto& th : pool) th.join();
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  double total = 0;
  for (double c : counts) total += c;
  std::printf("%.6e %s\n", total / elapsed, scan_bridge::simd_description());
  return 0;
}
