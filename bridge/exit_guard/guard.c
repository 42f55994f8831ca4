// The exit guard: a process that shares the server's memory and holds nothing else but the read
// end of a pipe whose write end only the server holds (exit_guard/__init__.py says why).
//
// A process killed by a signal frees its memory before it closes its descriptors, and the
// clients learn of its death only from the closing. Its memory is freed only when no process
// uses it any more: while the guard shares it, the server's exit goes straight on to closing
// its descriptors; the guard sees its pipe's end of file, exits, and frees the memory then.
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>

#ifndef SYS_close_range
#define SYS_close_range 436
#endif

#if defined(__x86_64__) || defined(__aarch64__)
// Raw system calls: the guard runs on the server's memory with the server's thread pointer, so
// it calls nothing of libc's, whose errno and locks belong to the server's threads.
static long guard_syscall(long n, long a, long b, long c, long d) {
#if defined(__x86_64__)
  long ret;
  register long r10 __asm__("r10") = d;
  __asm__ volatile("syscall" : "=a"(ret) : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10) : "rcx", "r11", "memory");
  return ret;
#else
  register long x8 __asm__("x8") = n;
  register long x0 __asm__("x0") = a;
  register long x1 __asm__("x1") = b;
  register long x2 __asm__("x2") = c;
  register long x3 __asm__("x3") = d;
  __asm__ volatile("svc 0" : "+r"(x0) : "r"(x8), "r"(x1), "r"(x2), "r"(x3) : "memory");
  return x0;
#endif
}

// Every descriptor but `keep`: the guard must not hold the server's pipes and sockets open,
// nor the write end of its own pipe.
static void close_all_but(long keep) {
  if (guard_syscall(SYS_close_range, keep + 1, ~0U, 0, 0) == 0 &&
      (keep == 0 || guard_syscall(SYS_close_range, 0, keep - 1, 0, 0) == 0))
    return;
  // Kernels before 5.9: one by one, up to the descriptor limit.
  struct rlimit limit = {1024, 1024};
  guard_syscall(SYS_prlimit64, 0, RLIMIT_NOFILE, 0, (long)&limit);
  for (long fd = 0; fd < (long)limit.rlim_cur; ++fd)
    if (fd != keep) guard_syscall(SYS_close, fd, 0, 0, 0);
}

static int guard_main(void* arg) {
  const long fd = (long)(intptr_t)arg;
  // The server's signal handlers are its own: a signal sent to the whole process group (a
  // terminal's ^C) must not run them here. SIGKILL still ends the guard.
  const uint64_t all = ~(uint64_t)0;
  guard_syscall(SYS_rt_sigprocmask, SIG_SETMASK, (long)&all, 0, sizeof all);
  close_all_but(fd);
  char byte;
  for (;;) {
    const long n = guard_syscall(SYS_read, fd, (long)&byte, 1, 0);
    if (n == 0 || (n < 0 && n != -EINTR)) break;
  }
  guard_syscall(SYS_exit, 0, 0, 0, 0);
  return 0;
}
#endif

// Starts the guard watching `read_fd`: its pid, or -1 where it cannot run here.
int exit_guard_start(int read_fd) {
#if defined(__x86_64__) || defined(__aarch64__)
  const size_t size = 64 * 1024;
  void* stack = mmap(0, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
  if (stack == MAP_FAILED) return -1;
  // The guard starts with every signal blocked: until its own mask is set it has the server's
  // handlers, and a signal delivered to it then (one pending when it is first scheduled) would
  // run one of them on the server's memory, as though the server had received it. Signals
  // arriving for this thread meanwhile stay pending and are delivered once its mask is back.
  sigset_t all, previous;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &previous);
  const int pid = clone(guard_main, (char*)stack + size, CLONE_VM | SIGCHLD, (void*)(intptr_t)read_fd);
  pthread_sigmask(SIG_SETMASK, &previous, 0);
  if (pid < 0) munmap(stack, size);
  return pid;
#else
  (void)read_fd;
  return -1;
#endif
}
