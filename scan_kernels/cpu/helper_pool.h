// Threads that help with a kernel call when they can, and are never waited for when they
// cannot.
//
// HelperPool::run(helpers, work) calls work(0) on the calling thread and offers it to pool
// threads 1 .. `helpers`, thread i calling work(i): a seat is a pool thread's own, the same in
// every call, so work split by seat goes to the same thread call after call.
// work must be safe to call concurrently and return when nothing is left to take (it pulls
// ranges from a shared queue). run returns once the caller's own work has returned and every
// helper that entered work has left it. A helper that wakes late -- its core busy with
// another process -- finds the call closed and does nothing.
//
// Why not at::parallel_for: OpenMP's fork/join makes every call wait until each team thread
// has been scheduled and finished a fixed share; on a small machine whose other core runs
// another process, a short state update then waits for a scheduler time slice (seen while
// developing; not a recorded benchmark).
// Here the caller starts at once, helpers join when they get a core, and the caller never
// waits for one that has not started.
//
// A call too small to be worth waking a sleeping helper for (Wake::if_calls_close) offers its
// work to the helpers only when the previous call ended less than kSpin ago, so that they are
// still polling or a stream of calls has begun. A lone call -- a 60 FPS game loop's step, long
// after the last -- then runs on the calling thread alone: on two cores, where the client waits
// on the other one, waking the helper for every step made the paced game loop's kernel stage
// slower (docs/performance.md, "helper wake"); no recording separates which of the woken
// helper's costs weighed most.
// A caller that makes several calls in a row (a model's step) decides once for all of them
// with an Alone scope: inside it every call runs on the calling thread.
//
// After fork() the child runs everything on the calling thread (the pool's threads and lock
// stay in the parent).
#pragma once

#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SCAN_BRIDGE_CPU_RELAX() _mm_pause()
#else
#define SCAN_BRIDGE_CPU_RELAX() std::this_thread::yield()
#endif

namespace scan_bridge {

class HelperPool {
 public:
  // One pool per process, never destroyed: its threads may still be parked at exit.
  static HelperPool& shared() {
    static HelperPool* pool = new HelperPool();
    return *pool;
  }

  enum class Wake {
    always,          // work worth waking a sleeping helper for
    if_calls_close,  // only when the previous call ended less than kSpin ago
  };

  // Starts helper threads 1 .. `helpers` now rather than at the first call that offers work to
  // them: a long-lived server then holds all its threads from the start, and its thread count
  // does not grow with the load it happens to meet.
  void start(int helpers) {
    if (getpid() != owner_pid_) return;
    std::lock_guard<std::mutex> lock(mutex_);
    spawn_up_to(helpers);
  }

  // While one is alive (and made `on`), run() on its thread offers nothing to the helpers: a
  // caller that makes several calls in a row (a model's step) decides once for all of them.
  class Alone {
   public:
    explicit Alone(bool on) : on_(on) { depth_ += on_; }
    ~Alone() { depth_ -= on_; }
    Alone(const Alone&) = delete;
    Alone& operator=(const Alone&) = delete;

   private:
    const bool on_;
  };

  // Whether a call starting now would find the helpers still polling: the last call ended less
  // than kSpin ago.
  bool polling() const { return now_us() - last_end_.load(std::memory_order_relaxed) < kSpin.count(); }

  void run(int helpers, const std::function<void(int)>& work, Wake wake = Wake::always) {
    const bool calls_close = polling();
    const EndRecorder end_recorder{last_end_};
    if (helpers <= 0 || depth_ > 0 || getpid() != owner_pid_ || (wake == Wake::if_calls_close && !calls_close)) {
      work(0);
      return;
    }
    auto job = std::make_shared<Job>();
    job->work = &work;
    job->helpers = helpers;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      spawn_up_to(helpers);
      job_ = job;
      generation_.fetch_add(1);
    }
    wake_.notify_all();
    std::exception_ptr error;
    try {
      work(0);
    } catch (...) {
      error = std::current_exception();
    }
    // Close the call, then wait for the helpers inside it. A helper counts itself in before it
    // checks `open` (both sequentially consistent), so it either is seen here or sees closed.
    job->open.store(false);
    // A helper inside is finishing its last range: usually microseconds; if it was preempted,
    // yield so that it can be scheduled here.
    for (int spins = 0; job->inside.load() != 0; ++spins) {
      if (spins < 4096) {
        SCAN_BRIDGE_CPU_RELAX();
      } else {
        std::this_thread::yield();
      }
    }
    if (!error && job->failed.load()) error = job->error;
    // The pool keeps the job (job_) until the next call: it must not keep the error alive too,
    // to be freed by whichever thread makes that call (ThreadSanitizer, blind to libstdc++'s
    // reference count, reports that free as a race with the catching thread; the pool's TSan
    // test, tests/cpp/helper_pool_stress.cpp, relies on this). No helper can write it any
    // more: all have left, and the closed call lets none in.
    job->error = nullptr;
    if (error) std::rethrow_exception(error);
  }

 private:
  struct Job {
    const std::function<void(int)>* work = nullptr;  // on the caller's stack: used only while open
    int helpers = 0;  // pool threads 1 .. helpers take part
    std::atomic<bool> open{true};
    std::atomic<int> inside{0};
    std::atomic<bool> failed{false};
    std::exception_ptr error;  // written by the first helper that sets `failed`
  };

  // How long an idle helper keeps polling before it sleeps: back-to-back calls (a decode loop,
  // a game loop's steps) then find it awake instead of paying a futex wake-up, at the cost of
  // up to this much spinning on its core after each call (libgomp's default wait policy spins
  // too). Sleeping at once made the game loop's kernel calls slower (docs/performance.md,
  // "helper spin").
  static constexpr std::chrono::microseconds kSpin{1000};
  // Past this much of the spin it yields its core on each poll: a reply's reader (a client on
  // the same cores) would otherwise wait up to the rest of kSpin for a core (docs/performance.md,
  // "helper yield").
  static constexpr std::chrono::microseconds kPauseSpin{50};

  static int64_t now_us() {
    return std::chrono::duration_cast<std::chrono::microseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  // Stores the time a call ended, however it ends (returning or throwing).
  struct EndRecorder {
    std::atomic<int64_t>& last_end;
    ~EndRecorder() { last_end.store(now_us(), std::memory_order_relaxed); }
  };

  HelperPool() : owner_pid_(getpid()) {}

  // Called with mutex_ held.
  void spawn_up_to(int helpers) {
    while (threads_ < helpers) std::thread(&HelperPool::helper_loop, this, ++threads_).detach();
  }

  void helper_loop(int seat) {
#if defined(__linux__)
    // Named, so that `top -H` and /proc/PID/task/*/comm tell the kernel helpers apart.
    pthread_setname_np(pthread_self(), ("scan-helper-" + std::to_string(seat)).c_str());
#endif
    uint64_t seen = generation_.load();
    for (;;) {
      const auto spin_start = std::chrono::steady_clock::now();
      for (auto now = spin_start; generation_.load() == seen && now < spin_start + kSpin;
           now = std::chrono::steady_clock::now()) {
        if (now < spin_start + kPauseSpin)
          SCAN_BRIDGE_CPU_RELAX();
        else
          std::this_thread::yield();
      }
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_.load() != seen; });
        seen = generation_.load();
        job = job_;
      }
      if (seat > job->helpers) continue;
      job->inside.fetch_add(1);
      if (job->open.load()) {
        try {
          (*job->work)(seat);
        } catch (...) {
          if (!job->failed.exchange(true)) job->error = std::current_exception();
        }
      }
      job->inside.fetch_sub(1);
    }
  }

  // Alone scopes alive on this thread.
  static inline thread_local int depth_ = 0;
  const pid_t owner_pid_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};
  // When the last call ended, in steady_clock microseconds (far in the past before the first).
  std::atomic<int64_t> last_end_{std::numeric_limits<int64_t>::min() / 2};
  std::shared_ptr<Job> job_;
  int threads_ = 0;
};

}  // namespace scan_bridge
