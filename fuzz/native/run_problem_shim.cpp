// The CPU kernels behind the C signatures the native step path calls (scan_kernel.h's
// RunProblemFn, ssd_kernel.h's RunSsdUpdateFn), for the fuzzing build of bridge/native/step.cpp
// (fuzz/native_build.py).
//
// Why not the real one: the "cpu" backend's capsule comes from scan_kernels/cpu/binding.cpp, an ATen
// extension that needs torch and cannot be built with clang's sanitizers and loaded beside an
// uninstrumented torch. This runs the same kernel code (scan_kernel.cpp, ssd_kernel.cpp,
// compiled into the same sanitized library) on the calling thread only: the binding's helper
// threads split the same work items and add no reads or writes of their own.

#include <cstdio>
#include <exception>
#include <type_traits>

#include "scan_kernel.h"
#include "ssd_kernel.h"

extern "C" __attribute__((visibility("default"))) int scan_bridge_fuzz_run_problem(
    const scan_bridge::ScanProblem* p, size_t problem_size, char* error, size_t error_size) {
  if (problem_size != sizeof(scan_bridge::ScanProblem)) {
    std::snprintf(error, error_size, "ScanProblem size %zu, expected %zu", problem_size,
                  sizeof(scan_bridge::ScanProblem));
    return 1;
  }
  try {
    scan_bridge::WorkQueue queue(scan_bridge::work_items(*p), 1, 1);
    scan_bridge::run_items(*p, queue, 0);
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(error, error_size, "%s", e.what());
    return 1;
  }
}

static_assert(std::is_same_v<decltype(&scan_bridge_fuzz_run_problem), scan_bridge::RunProblemFn>);

extern "C" __attribute__((visibility("default"))) int scan_bridge_fuzz_run_ssd_update(
    const scan_bridge::SsdUpdateProblem<float>* p, size_t problem_size, char* error, size_t error_size) {
  if (problem_size != sizeof(*p)) {
    std::snprintf(error, error_size, "SsdUpdateProblem size %zu, expected %zu", problem_size, sizeof(*p));
    return 1;
  }
  try {
    scan_bridge::ssd_update_items(*p, 0, p->batch * p->heads);
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(error, error_size, "%s", e.what());
    return 1;
  }
}

static_assert(std::is_same_v<decltype(&scan_bridge_fuzz_run_ssd_update), scan_bridge::RunSsdUpdateFn>);
