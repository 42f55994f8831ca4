// The GIL released for a scope: the kernels' Python entry points (binding.cpp, as a pybind11
// call_guard) and the native step's (bridge/native/step.cpp) run their work without it.
//
// Not pybind11's gil_scoped_release, for a Python thread still inside a kernel when the
// interpreter finalizes (a daemon thread, the server's worker): CPython ends it as it takes the
// GIL back, PyEval_RestoreThread calling pthread_exit, which unwinds the thread's stack. From
// gil_scoped_release's destructor, noexcept as destructors are, that unwind was std::terminate:
// "terminate called without an active exception" and SIGABRT at the process's exit. Nor may the
// unwind go on: the frames above hold Python objects, whose destructors need the GIL. So the
// thread stops here, holding nothing of Python's, until the process's exit ends it (what
// CPython itself does with such a thread from 3.14 on).
//
// The same exit waits in a tensor dropped inside the scope: torch takes the GIL to release the
// tensor's Python object when its last C++ reference but that object's goes, in a noexcept
// function. So the entry points take tensors by const reference: pybind11's argument casters
// keep those references until the GIL is back.
#pragma once

#include <Python.h>
#include <unistd.h>

namespace scan_bridge {

class ReleasedGil {
 public:
  ReleasedGil() : state_(PyEval_SaveThread()) {}
  ~ReleasedGil() {
    try {
      PyEval_RestoreThread(state_);
    } catch (...) {
      // pthread_exit's unwind, the only thing a C function can throw; a handler that returned
      // would have to rethrow it.
      for (;;) pause();
    }
  }
  ReleasedGil(const ReleasedGil&) = delete;
  ReleasedGil& operator=(const ReleasedGil&) = delete;

 private:
  PyThreadState* const state_;
};

}  // namespace scan_bridge
