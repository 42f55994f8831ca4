// HelperPool (scan_kernels/cpu/helper_pool.h) under load, for ThreadSanitizer: several threads call
// run() at once, many times, each call summing an array split among the caller and the helpers
// through a shared range counter, and every call's sum is checked. Some calls throw, from the
// caller's share or from a helper's, and run() must hand the error back; calls inside a
// HelperPool::Alone scope (some nested in a second) must get no help; a forked child calls
// run() too. Then one caller alone makes calls whose share waits for a helper to take part (or
// throw): those are certain to be helped, however the helpers were scheduled before. Exits 0
// when every check held (tests/test_sanitizers.py builds and runs it).
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "helper_pool.h"

using scan_bridge::HelperPool;

namespace {

constexpr int64_t kElements = 1 << 14;
constexpr int64_t kRange = 512;

struct Outcome {
  int64_t sum = 0;
  bool threw = false;
  std::string error;
  bool helped = false;  // a helper took ranges
};

// How long a caller's share waits for a helper (await_help): far past any wake-up, however loaded.
constexpr std::chrono::seconds kHelpWait{20};

// One call of run(): sums 0 .. kElements-1 (stored in `data`); `throwing_seat` (or -1) throws
// instead of taking ranges. With `await_help` the caller's share (seat 0) starts only once the
// throwing helper threw (a helper took a range, where none throws), or kHelpWait passed.
Outcome one_call(const std::vector<int64_t>& data, int helpers, HelperPool::Wake wake, int throwing_seat,
                 bool await_help = false) {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> sum{0};
  std::atomic<bool> helped{false};
  std::atomic<bool> thrown{false};
  Outcome outcome;
  try {
    HelperPool::shared().run(
        helpers,
        [&](int seat) {
          if (seat == throwing_seat) {
            thrown.store(true);
            throw std::runtime_error("seat " + std::to_string(seat));
          }
          if (seat == 0 && await_help) {
            const auto until = std::chrono::steady_clock::now() + kHelpWait;
            // The thrower, when there is one (other helpers may take every range before it comes).
            std::atomic<bool>& awaited = throwing_seat > 0 ? thrown : helped;
            while (!awaited.load() && std::chrono::steady_clock::now() < until) std::this_thread::yield();
          }
          for (;;) {
            const int64_t begin = next.fetch_add(kRange);
            if (begin >= kElements) return;
            if (seat != 0) helped.store(true);
            int64_t part = 0;
            for (int64_t i = begin; i < begin + kRange && i < kElements; ++i) part += data[i];
            sum.fetch_add(part);
          }
        },
        wake);
  } catch (const std::exception& e) {
    outcome.threw = true;
    outcome.error = e.what();
  }
  outcome.sum = sum.load();
  outcome.helped = helped.load();
  return outcome;
}

}  // namespace

int main(int argc, char** argv) {
  const int callers = argc > 1 ? std::stoi(argv[1]) : 3;
  const int calls = argc > 2 ? std::stoi(argv[2]) : 400;
  std::vector<int64_t> data(kElements);
  for (int64_t i = 0; i < kElements; ++i) data[i] = i;
  const int64_t expected = kElements * (kElements - 1) / 2;
  std::atomic<int> failures{0};
  std::atomic<int> helped_calls{0};
  std::atomic<int> helper_errors{0};
  auto fail = [&](const std::string& what) {
    if (failures.fetch_add(1) < 10) std::fprintf(stderr, "FAIL: %s\n", what.c_str());
  };

  auto caller = [&](int index) {
    for (int c = 0; c < calls; ++c) {
      const int helpers = (c + index) % 4;
      const auto wake = c % 3 == 0 ? HelperPool::Wake::if_calls_close : HelperPool::Wake::always;
      const int throwing_seat = c % 7 == 0 ? (c / 7) % (helpers + 1) : -1;
      const bool alone = c % 5 == 1;
      const HelperPool::Alone scope(alone), nested(alone && c % 2 == 0), off(false);
      const Outcome got = one_call(data, helpers, wake, throwing_seat);
      const std::string call = "caller " + std::to_string(index) + " call " + std::to_string(c);
      if (alone && got.helped) fail(call + ": a helper took part inside an Alone scope");
      helped_calls += got.helped;
      helper_errors += throwing_seat > 0 && got.threw;
      if (throwing_seat == 0) {
        // The caller's own share threw: always handed back.
        if (!got.threw || got.error != "seat 0") fail(call + ": the caller's error was not handed back");
      } else if (throwing_seat > 0) {
        // A helper's: handed back when that helper took part (one that woke late never does);
        // it threw before taking a range, so the others summed everything.
        if (got.threw && got.error != "seat " + std::to_string(throwing_seat)) fail(call + ": " + got.error);
        if (got.sum != expected) fail(call + ": sum " + std::to_string(got.sum));
      } else if (got.threw || got.sum != expected) {
        fail(call + ": sum " + std::to_string(got.sum) + (got.threw ? ", threw " + got.error : ""));
      }
    }
  };
  std::vector<std::thread> threads;
  for (int i = 0; i < callers; ++i) threads.emplace_back(caller, i);
  for (auto& t : threads) t.join();

  // After fork() the child has none of the pool's threads: its calls run on the calling thread.
  const pid_t child = fork();
  if (child == 0) {
    const Outcome got = one_call(data, 3, HelperPool::Wake::always, -1);
    _exit(got.threw || got.sum != expected ? 1 : 0);
  }
  int status = 0;
  if (child < 0 || waitpid(child, &status, 0) != child || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
    fail("the forked child's call");

  // One caller, nothing replacing its call in the pool: the helpers woken for it take part.
  for (int c = 0; c < 24; ++c) {
    const int helpers = 1 + c % 3;
    const int throwing_seat = c % 2 == 0 ? 1 + (c / 2) % helpers : -1;
    const Outcome got = one_call(data, helpers, HelperPool::Wake::always, throwing_seat, true);
    const std::string call = "lone call " + std::to_string(c);
    if (throwing_seat > 0) {
      if (!got.threw || got.error != "seat " + std::to_string(throwing_seat))
        fail(call + ": the helper's error was not handed back" + (got.threw ? " (" + got.error + ")" : ""));
      helper_errors += got.threw;
    } else if (!got.helped) {
      fail(call + ": no helper took part");
    }
    helped_calls += got.helped;
    if (got.sum != expected) fail(call + ": sum " + std::to_string(got.sum));
  }

  if (failures.load() != 0) {
    std::fprintf(stderr, "%d failure(s)\n", failures.load());
    return 1;
  }
  // What the run exercised, for the test to check: calls a helper took part in, and helpers'
  // errors handed back.
  std::printf("%d callers x %d calls: every sum and error as expected; helped %d, helper errors %d\n", callers,
              calls, helped_calls.load(), helper_errors.load());
  return 0;
}
