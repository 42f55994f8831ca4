// The native step path: a `step` request served from its frame to its reply frame in one C++
// call, for the CPU kernels, Mamba-1 and Mamba-2 sessions alike.
//
// Why: a paced step spent much of its round trip in the server's Python per-request work
// (docs/performance.md, "native step path"). Here the request is read where it lies in the
// frame, the kernel reads its operands there and writes y straight into the reply, and the reply
// is built around it: no tensors, and no copies but of a Mamba-2 operand that lies unaligned.
//
// It serves only the plain form of a step (bridge/native/__init__.py says which); for anything
// else `parse` returns None and the request takes the general path, which gives every error
// reply. So nothing here reports a request's error to a client: a request it cannot take is
// handed on untouched, and a request it takes is known to be valid before the state is touched.
// What fails (an allocation, a kernel) is raised: before the kernel as it is, the state as it
// was, so the general path may serve the request; from the kernel on as StateWritten, its cause
// the failure, the session's state maybe moved (bridge/native/__init__.py).
//
// The kernels are the CPU backend's, called through the capsules its extension exports
// (scan_kernels/cpu/binding.cpp, "scan_bridge.run_problem" with the ScanProblem of
// scan_kernels/cpu/scan_kernel.h, "scan_bridge.run_ssd_update" with the SsdUpdateProblem of
// scan_kernels/cpu/ssd_kernel.h): this file knows the wire, the kernels do not.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <memory>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "model_step.h"
#include "released_gil.h"
#include "scan_kernel.h"
#include "ssd_kernel.h"

namespace py = pybind11;
using scan_bridge::DType;
using scan_bridge::ScanProblem;
using scan_bridge::Strided;

namespace {

// The type of a failure once the kernel began (raise_state_written), made with the module.
PyObject* state_written_type = nullptr;

// Raises the exception being handled as StateWritten caused by it (the cause as pybind11 would
// raise it): the kernel began, the session's rows may have moved, and the caller must not serve
// the request again nor take the state for what it was.
[[noreturn]] void raise_state_written() {
  try {
    throw;
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "native step: an unknown C++ exception");
  }
  py::raise_from(state_written_type, "native step: failed once its kernel began writing the state");
  throw py::error_already_set();
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// --- reading msgpack -----------------------------------------------------------------------
// Only what a plain step request holds. Every read returns false on anything else (another
// type, a truncated value); the request then goes the general way.

class Reader {
 public:
  Reader(const uint8_t* data, size_t size) : p_(data), end_(data + size) {}

  bool done() const { return p_ == end_; }
  bool next_is_str() const {
    return p_ < end_ && ((*p_ & 0xe0) == 0xa0 || *p_ == 0xd9 || *p_ == 0xda || *p_ == 0xdb);
  }

  bool map(uint32_t* n) { return header(0x80, 0x0f, 0xde, 0xdf, n); }
  bool array(uint32_t* n) { return header(0x90, 0x0f, 0xdc, 0xdd, n); }

  bool str(std::string_view* s) {
    if (p_ >= end_) return false;
    const uint8_t c = *p_;
    uint64_t n;
    if ((c & 0xe0) == 0xa0) {
      n = c & 0x1f;
      ++p_;
    } else if (c == 0xd9 || c == 0xda || c == 0xdb) {
      ++p_;
      if (!big_endian(c == 0xd9 ? 1 : c == 0xda ? 2 : 4, &n)) return false;
    } else {
      return false;
    }
    if (static_cast<uint64_t>(end_ - p_) < n) return false;
    *s = std::string_view(reinterpret_cast<const char*>(p_), n);
    p_ += n;
    return true;
  }

  // Tensor data: bin, or str (SPEC §5: Msgpax packs binaries as str).
  bool bytes(const uint8_t** data, uint64_t* n) {
    if (p_ >= end_) return false;
    const uint8_t c = *p_;
    if (c == 0xc4 || c == 0xc5 || c == 0xc6) {
      ++p_;
      if (!big_endian(c == 0xc4 ? 1 : c == 0xc5 ? 2 : 4, n)) return false;
      if (static_cast<uint64_t>(end_ - p_) < *n) return false;
      *data = p_;
      p_ += *n;
      return true;
    }
    std::string_view s;
    if (!str(&s)) return false;
    *data = reinterpret_cast<const uint8_t*>(s.data());
    *n = s.size();
    return true;
  }

  // A non-negative int in any encoding (SPEC §3: decoders accept non-minimal ones).
  bool uint(uint64_t* v) {
    if (p_ >= end_) return false;
    const uint8_t c = *p_;
    if (c <= 0x7f) {
      *v = c;
      ++p_;
      return true;
    }
    if (c >= 0xcc && c <= 0xcf) {
      ++p_;
      return big_endian(1 << (c - 0xcc), v);
    }
    int64_t value;
    if (!signed_int(&value) || value < 0) return false;  // a signed encoding of a non-negative value
    *v = static_cast<uint64_t>(value);
    return true;
  }

  // A finite number: any int or float (SPEC "number").
  bool number(double* v) {
    if (p_ >= end_) return false;
    const uint8_t c = *p_;
    if (c == 0xca) {
      ++p_;
      uint64_t raw;
      if (!big_endian(4, &raw)) return false;
      const uint32_t bits = static_cast<uint32_t>(raw);
      float f;
      std::memcpy(&f, &bits, 4);
      *v = f;
    } else if (c == 0xcb) {
      ++p_;
      uint64_t raw;
      if (!big_endian(8, &raw)) return false;
      std::memcpy(v, &raw, 8);
    } else if ((c >= 0xd0 && c <= 0xd3) || c >= 0xe0) {  // int 8-64, negative fixint
      int64_t i;
      if (!signed_int(&i)) return false;
      *v = static_cast<double>(i);
    } else {
      uint64_t u;
      if (!uint(&u)) return false;
      *v = static_cast<double>(u);
    }
    return std::isfinite(*v);
  }

  bool boolean(bool* v) {
    if (p_ >= end_ || (*p_ != 0xc2 && *p_ != 0xc3)) return false;
    *v = *p_++ == 0xc3;
    return true;
  }

  bool nil() {
    if (p_ >= end_ || *p_ != 0xc0) return false;
    ++p_;
    return true;
  }

 private:
  // A negative fixint or an int 8/16/32/64.
  bool signed_int(int64_t* v) {
    if (p_ >= end_) return false;
    const uint8_t c = *p_;
    if (c >= 0xe0) {
      *v = static_cast<int8_t>(c);
      ++p_;
      return true;
    }
    if (c < 0xd0 || c > 0xd3) return false;
    ++p_;
    uint64_t raw;
    const int size = 1 << (c - 0xd0);
    if (!big_endian(size, &raw)) return false;
    const int shift = 64 - 8 * size;
    *v = static_cast<int64_t>(raw << shift) >> shift;
    return true;
  }

  bool header(uint8_t fix, uint8_t mask, uint8_t code16, uint8_t code32, uint32_t* n) {
    if (p_ >= end_) return false;
    const uint8_t c = *p_;
    uint64_t v;
    if ((c & ~mask) == fix) {
      v = c & mask;
      ++p_;
    } else if (c == code16 || c == code32) {
      ++p_;
      if (!big_endian(c == code16 ? 2 : 4, &v)) return false;
    } else {
      return false;
    }
    *n = static_cast<uint32_t>(v);
    return true;
  }

  bool big_endian(int size, uint64_t* v) {
    if (end_ - p_ < size) return false;
    uint64_t r = 0;
    for (int i = 0; i < size; ++i) r = (r << 8) | p_[i];
    p_ += size;
    *v = r;
    return true;
  }

  const uint8_t* p_;
  const uint8_t* end_;
};

// --- the request ---------------------------------------------------------------------------

// Contiguous f32 elements and their shape (at most 3 dims): an operand inline in the frame, or
// a handle's tensor.
struct F32Array {
  const void* data = nullptr;  // nullptr: not given (inline)
  int ndim = 0;
  int64_t shape[3] = {0, 0, 0};

  bool is(int64_t d0) const { return ndim == 1 && shape[0] == d0; }
  bool is(int64_t d0, int64_t d1) const { return ndim == 2 && shape[0] == d0 && shape[1] == d1; }
  bool is(int64_t d0, int64_t d1, int64_t d2) const {
    return ndim == 3 && shape[0] == d0 && shape[1] == d1 && shape[2] == d2;
  }
  int64_t elements() const {
    int64_t n = 1;
    for (int d = 0; d < ndim; ++d) n *= shape[d];
    return n;
  }
};

enum Operand { kX, kDt, kB, kC, kZ, kA, kD, kDtBias, kOperands };
constexpr const char* kOperandNames[kOperands] = {"x", "dt", "B", "C", "z", "A", "D", "dt_bias"};
// Per-row operands must come inline; the shared ones (A, D, dt_bias) may be handles.
constexpr bool kMayBeHandle[kOperands] = {false, false, false, false, false, true, true, true};

// A model step's token ids inline: [n] i32, i64 or u8.
struct TokenIds {
  const void* data = nullptr;  // nullptr: not given
  scan_bridge::TokenType type = scan_bridge::TokenType::none;
  int64_t n = 0;

  int64_t at(int64_t i) const { return scan_bridge::token_at(data, type, i); }
};

// A model step's "output": unnamed (the model's default: logits where it has a head).
enum class Output { unnamed, hidden, logits };

// A plain step or model step request read from a frame, which it keeps alive: its inline
// operands point into it.
struct StepRequest {
  py::object frame;
  py::object id;  // int or str, echoed in the reply
  bool model_step = false;  // the op: "model_step", else "step"
  std::string session;
  F32Array operands[kOperands];
  std::optional<std::string> handles[kOperands];
  F32Array embeds;  // a model step's input: embeddings, or
  TokenIds tokens;  // token ids
  Output output = Output::unnamed;  // a model step's "output"
  uint32_t args_seen = 0;  // a bit per argument given (read_args)
  bool return_state = false;  // the reply carries the session's state after the step
  std::optional<std::string> snapshot_into;  // a model step's: the snapshot that takes the state before it
  bool dt_softplus = false;
  std::optional<double> dt_min, dt_max;
  std::optional<uint64_t> deadline_us;  // the envelope's budget (SPEC §4); the caller checks it

  bool given(Operand o) const { return operands[o].data != nullptr || handles[o].has_value(); }
};

bool ascii(std::string_view s) {
  for (unsigned char c : s)
    if (c >= 0x80) return false;
  return true;
}

// The three entries of an inline tensor map, {"dtype", "shape", "data"} in any order: the
// element width `width_of(dtype)` gives (0: a dtype not taken), at most 3 axes, each in
// [1, 2^30], and the data's length checked against them.
template <typename WidthOf>
bool read_inline(Reader& r, WidthOf width_of, int* ndim, int64_t* shape, const void** data) {
  bool seen_dtype = false, seen_shape = false;
  uint64_t nbytes = 0, width = 0;
  for (int i = 0; i < 3; ++i) {
    std::string_view key;
    if (!r.str(&key)) return false;
    if (key == "dtype" && !seen_dtype) {
      std::string_view dtype;
      if (!r.str(&dtype) || (width = width_of(dtype)) == 0) return false;
      seen_dtype = true;
    } else if (key == "shape" && !seen_shape) {
      uint32_t n;
      if (!r.array(&n) || n < 1 || n > 3) return false;
      *ndim = static_cast<int>(n);
      for (uint32_t d = 0; d < n; ++d) {
        uint64_t size;
        if (!r.uint(&size) || size == 0 || size > (1u << 30)) return false;
        shape[d] = static_cast<int64_t>(size);
      }
      seen_shape = true;
    } else if (key == "data" && *data == nullptr) {
      const uint8_t* bytes;
      if (!r.bytes(&bytes, &nbytes)) return false;
      *data = bytes;
    } else {
      return false;
    }
  }
  if (!seen_dtype || !seen_shape || *data == nullptr) return false;
  // Each axis is at most 2^30, so three of them could wrap the product: checked multiplies.
  uint64_t elements = 1;
  for (int d = 0; d < *ndim; ++d)
    if (__builtin_mul_overflow(elements, static_cast<uint64_t>(shape[d]), &elements)) return false;
  uint64_t expected;
  return !__builtin_mul_overflow(elements, width, &expected) && nbytes == expected;
}

// {"dtype": "f32", "shape": [...], "data": ...} with at most 3 dims, or {"handle": str} where
// `may_be_handle`.
bool read_operand(Reader& r, bool may_be_handle, F32Array* t, std::optional<std::string>* handle) {
  uint32_t keys;
  if (!r.map(&keys)) return false;
  if (keys == 1) {
    std::string_view key, value;
    if (!may_be_handle || !r.str(&key) || key != "handle" || !r.str(&value) || value.empty() || !ascii(value))
      return false;
    handle->emplace(value);
    return true;
  }
  return keys == 3 && read_inline(r, [](std::string_view dtype) { return dtype == "f32" ? 4 : 0; }, &t->ndim,
                                  t->shape, &t->data);
}

// {"dtype": "i32" | "i64" | "u8", "shape": [n], "data": ...}.
bool read_tokens(Reader& r, TokenIds* t) {
  uint32_t keys;
  if (!r.map(&keys) || keys != 3) return false;
  int ndim = 0;
  int64_t shape[3] = {0, 0, 0};
  const auto width_of = [t](std::string_view dtype) {
    using scan_bridge::TokenType;
    t->type = dtype == "i32" ? TokenType::i32 : dtype == "i64" ? TokenType::i64 : dtype == "u8" ? TokenType::u8
                                                                                                 : TokenType::none;
    return t->type == TokenType::i32 ? 4 : t->type == TokenType::i64 ? 8 : t->type == TokenType::u8 ? 1 : 0;
  };
  if (!read_inline(r, width_of, &ndim, shape, &t->data) || ndim != 1) return false;
  t->n = shape[0];
  return true;
}

// nil for an optional argument is "absent" (SPEC §3).
bool read_args(Reader& r, StepRequest* req) {
  uint32_t keys;
  if (!r.map(&keys)) return false;
  uint32_t seen = 0;  // one bit per argument: a key given twice goes the general way
  for (uint32_t i = 0; i < keys; ++i) {
    std::string_view key;
    if (!r.str(&key)) return false;
    int bit;
    if (key == "session") {
      bit = 0;
      std::string_view session;
      if (!r.str(&session) || !ascii(session)) return false;
      req->session.assign(session);
    } else if (key == "dt_softplus") {
      bit = 1;
      if (!r.nil() && !r.boolean(&req->dt_softplus)) return false;
    } else if (key == "dt_min" || key == "dt_max") {
      bit = key == "dt_min" ? 2 : 3;
      if (!r.nil()) {
        double v;
        // Beyond float32's range the general path refuses the bound by name (kernels' checks).
        if (!r.number(&v) || std::fabs(v) > std::numeric_limits<float>::max()) return false;
        (key == "dt_min" ? req->dt_min : req->dt_max) = v;
      }
    } else if (key == "embeds") {
      bit = 4 + kOperands;
      if (!read_operand(r, false, &req->embeds, nullptr) || req->embeds.ndim != 2) return false;
    } else if (key == "tokens") {
      bit = 6 + kOperands;
      if (!read_tokens(r, &req->tokens)) return false;
    } else if (key == "return_state") {
      bit = 7 + kOperands;
      if (!r.nil() && !r.boolean(&req->return_state)) return false;
    } else if (key == "snapshot_into") {
      bit = 8 + kOperands;
      std::string_view snapshot;
      if (!r.nil()) {
        if (!r.str(&snapshot) || snapshot.empty() || !ascii(snapshot)) return false;
        req->snapshot_into.emplace(snapshot);
      }
    } else if (key == "output") {
      bit = 5 + kOperands;
      std::string_view output;
      if (!r.nil()) {
        if (!r.str(&output) || (output != "hidden" && output != "logits")) return false;
        req->output = output == "hidden" ? Output::hidden : Output::logits;
      }
    } else {
      bit = -1;
      for (int o = 0; o < kOperands; ++o) {
        if (key == kOperandNames[o]) {
          bit = 4 + o;
          if (!r.nil() && !read_operand(r, kMayBeHandle[o], &req->operands[o], &req->handles[o]))
            return false;
          break;
        }
      }
      if (bit < 0) return false;
    }
    if (seen & (1u << bit)) return false;
    seen |= 1u << bit;
  }
  req->args_seen = seen;
  return !req->session.empty();
}

// Whether the args read are those of the request's op: a step's operands (x, dt, A, B, C at
// least), or a model step's embeds (and output, snapshot_into) alone; return_state for either.
bool args_fit_op(const StepRequest& req) {
  // session, embeds, output, tokens, snapshot_into
  constexpr uint32_t kModelArgs = 1u | 1u << (4 + kOperands) | 1u << (5 + kOperands) | 1u << (6 + kOperands) |
                                  1u << (8 + kOperands);
  constexpr uint32_t kReturnState = 1u << (7 + kOperands);
  if (req.model_step)
    return (req.embeds.data != nullptr) != (req.tokens.data != nullptr) &&
           (req.args_seen & ~(kModelArgs | kReturnState)) == 0;
  return (req.args_seen & kModelArgs & ~1u) == 0 && req.given(kX) && req.given(kDt) && req.given(kA) &&
         req.given(kB) && req.given(kC);
}

// The request when `frame` is a plain step or model step request, else None. Its `id`,
// `session` and `handles` (name -> handle id, for A, D and dt_bias given as handles) are for the
// caller to resolve; `run`, `run_ssd` and `run_model` do the rest.
py::object parse(py::buffer frame) {
  const py::buffer_info info = frame.request();
  Reader r(static_cast<const uint8_t*>(info.ptr), static_cast<size_t>(info.size * info.itemsize));
  uint32_t keys;
  if (!r.map(&keys) || keys < 3 || keys > 5) return py::none();
  auto req = std::make_unique<StepRequest>();
  req->frame = frame;
  bool seen_v = false, seen_id = false, seen_op = false, seen_args = false, seen_deadline = false;
  for (uint32_t i = 0; i < keys; ++i) {
    std::string_view key;
    if (!r.str(&key)) return py::none();
    if (key == "v" && !seen_v) {
      uint64_t v;
      if (!r.uint(&v) || v != 1) return py::none();
      seen_v = true;
    } else if (key == "id" && !seen_id) {
      uint64_t n;
      std::string_view s;
      if (r.next_is_str()) {
        if (!r.str(&s) || s.empty() || !ascii(s)) return py::none();
        req->id = py::str(s.data(), s.size());
      } else {
        if (!r.uint(&n)) return py::none();
        req->id = py::int_(n);
      }
      seen_id = true;
    } else if (key == "op" && !seen_op) {
      std::string_view op;
      if (!r.str(&op) || (op != "step" && op != "model_step")) return py::none();
      req->model_step = op == "model_step";
      seen_op = true;
    } else if (key == "args" && !seen_args) {
      if (!read_args(r, req.get())) return py::none();
      seen_args = true;
    } else if (key == "deadline_us" && !seen_deadline) {
      uint64_t budget;
      if (!r.uint(&budget)) return py::none();  // nil too: the general path reads that
      req->deadline_us = budget;
      seen_deadline = true;
    } else {
      return py::none();
    }
  }
  if (!seen_id || !seen_op || !seen_args || !r.done() || !args_fit_op(*req)) return py::none();
  return py::cast(req.release(), py::return_value_policy::take_ownership);
}

py::dict handles_of(const StepRequest& req) {
  py::dict out;
  for (int o = kA; o <= kDtBias; ++o)
    if (req.handles[o]) out[kOperandNames[o]] = *req.handles[o];
  return out;
}

// --- writing the reply ---------------------------------------------------------------------

class Writer {
 public:
  explicit Writer(char* out) : p_(reinterpret_cast<uint8_t*>(out)), start_(p_) {}
  size_t size() const { return static_cast<size_t>(p_ - start_); }
  uint8_t* position() { return p_; }
  void skip(size_t n) { p_ += n; }

  void raw(const char* s) {
    const size_t n = std::strlen(s);
    std::memcpy(p_, s, n);
    p_ += n;
  }
  void fixstr(const char* s) {
    const size_t n = std::strlen(s);
    *p_++ = static_cast<uint8_t>(0xa0 | n);
    raw(s);
  }
  void uint(uint64_t v) {
    if (v <= 0x7f) {
      *p_++ = static_cast<uint8_t>(v);
    } else if (v <= 0xff) {
      *p_++ = 0xcc;
      be(v, 1);
    } else if (v <= 0xffff) {
      *p_++ = 0xcd;
      be(v, 2);
    } else if (v <= 0xffffffffu) {
      *p_++ = 0xce;
      be(v, 4);
    } else {
      *p_++ = 0xcf;
      be(v, 8);
    }
  }
  void str(std::string_view s) {
    const size_t n = s.size();
    if (n < 32) {
      *p_++ = static_cast<uint8_t>(0xa0 | n);
    } else if (n <= 0xff) {
      *p_++ = 0xd9;
      be(n, 1);
    } else if (n <= 0xffff) {
      *p_++ = 0xda;
      be(n, 2);
    } else {
      *p_++ = 0xdb;
      be(n, 4);
    }
    std::memcpy(p_, s.data(), n);
    p_ += n;
  }
  void bin_header(uint64_t n) {
    if (n <= 0xff) {
      *p_++ = 0xc4;
      be(n, 1);
    } else if (n <= 0xffff) {
      *p_++ = 0xc5;
      be(n, 2);
    } else {
      *p_++ = 0xc6;
      be(n, 4);
    }
  }
  void map_header(size_t n) {
    if (n < 16) {
      *p_++ = static_cast<uint8_t>(0x80 | n);
    } else {
      *p_++ = 0xde;
      be(n, 2);
    }
  }
  // An f32 tensor map {"dtype", "shape": [rows, *axes], "data"}, its `nbytes` of data left to
  // the caller to fill: returns where they go.
  void* tensor_f32(uint64_t rows, const int64_t* axes, const int64_t* axes_end, uint64_t nbytes) {
    raw("\x83\xa5""dtype\xa3""f32\xa5shape");
    *p_++ = static_cast<uint8_t>(0x90 | (1 + (axes_end - axes)));
    uint(rows);
    for (const int64_t* d = axes; d != axes_end; ++d) uint(static_cast<uint64_t>(*d));
    raw("\xa4""data");
    bin_header(nbytes);
    void* data = p_;
    p_ += nbytes;
    return data;
  }
  void f64(double v) {
    uint64_t bits;
    std::memcpy(&bits, &v, 8);
    *p_++ = 0xcb;
    be(bits, 8);
  }

 private:
  void be(uint64_t v, int size) {
    for (int i = size - 1; i >= 0; --i) *p_++ = static_cast<uint8_t>(v >> (8 * i));
  }
  uint8_t* p_;
  uint8_t* start_;
};

// The reply's timing: the stages in the general path's order (bridge/timing.py), then
// server_us and batch_rows.
constexpr const char* kStageKeys[] = {"decode_us", "queue_us", "h2d_us", "kernel_us", "d2h_us", "encode_us"};
constexpr size_t kTimingEntries = std::size(kStageKeys) + 2;

// --- serving -------------------------------------------------------------------------------

// A handle's tensor as the caller found it, (data_ptr, shape) of a contiguous f32 CPU tensor;
// nullopt for None or a shape of more than 3 dims.
std::optional<F32Array> handle_array(const py::object& value) {
  if (value.is_none()) return std::nullopt;
  auto t = value.cast<py::tuple>();
  auto shape = t[1].cast<py::tuple>();
  F32Array a;
  a.ndim = static_cast<int>(shape.size());
  if (a.ndim < 1 || a.ndim > 3) return std::nullopt;
  a.data = reinterpret_cast<const void*>(t[0].cast<uintptr_t>());
  for (int d = 0; d < a.ndim; ++d) a.shape[d] = shape[d].cast<int64_t>();
  return a;
}

Strided f32(const void* data, int64_t s0, int64_t s1 = 0, int64_t s2 = 0, int64_t s3 = 0) {
  Strided s;
  s.data = const_cast<void*>(data);
  s.dtype = DType::f32;
  s.stride[0] = s0;
  s.stride[1] = s1;
  s.stride[2] = s2;
  s.stride[3] = s3;
  return s;
}

// Where a session's state lies, for a reply that returns it (`return_state`): its rows in a
// pool of `row_floats` f32 a row, each part at its column `offset`; the step names the rows (its
// slots). A model's state goes on the wire as a map of its parts by name, a plain session's as
// its one part. Made once per session and pool by bridge.native, from (pool address, row
// floats, named, ((name, row shape, column offset), ...)).
struct StateOut {
  struct Part {
    std::string name;
    std::vector<int64_t> shape;  // one row's
    int64_t offset = 0;
    int64_t floats = 1;
  };

  StateOut(uintptr_t pool_address, int64_t row_floats_, bool named_, const py::tuple& described)
      : pool(reinterpret_cast<const float*>(pool_address)), row_floats(row_floats_), named(named_) {
    for (auto item : described) {
      auto part = item.cast<py::tuple>();
      Part p;
      p.name = part[0].cast<std::string>();
      p.offset = part[2].cast<int64_t>();
      for (auto d : part[1].cast<py::tuple>()) {
        p.shape.push_back(d.cast<int64_t>());
        p.floats *= p.shape.back();
      }
      parts.push_back(std::move(p));
    }
    if (!named && parts.size() != 1) throw std::invalid_argument("native step: a plain state has one part");
  }

  const float* pool;
  int64_t row_floats;
  bool named;
  std::vector<Part> parts;
};

class Stepper {
 public:
  // The kernels' capsules: the Mamba-1 state update (always), the Mamba-2 one and a model's
  // step (None: those steps are not taken); the largest tensor and reply body a reply may carry
  // (msgpack's bin length, the frame's length prefix: SPEC 2).
  Stepper(py::capsule run_problem, std::optional<py::capsule> run_ssd_update,
          std::optional<py::capsule> run_model_step, uint64_t max_tensor_bytes, uint64_t max_reply_bytes)
      : max_tensor_bytes_(max_tensor_bytes),
        max_reply_bytes_(max_reply_bytes),
        run_problem_(capsule_function<scan_bridge::RunProblemFn>(run_problem, scan_bridge::kRunProblemCapsule)),
        run_ssd_update_(run_ssd_update ? capsule_function<scan_bridge::RunSsdUpdateFn>(
                                             *run_ssd_update, scan_bridge::kRunSsdUpdateCapsule)
                                       : nullptr),
        run_model_step_(run_model_step ? capsule_function<scan_bridge::RunModelStepFn>(
                                             *run_model_step, scan_bridge::kRunModelStepCapsule)
                                       : nullptr),
        keep_{run_problem, run_ssd_update.value_or(py::capsule()), run_model_step.value_or(py::capsule())} {}

  // One Mamba-1 step of the session whose state rows are `pool` rows `slots` (`batch` of them,
  // each [dim, state] f32, the pool contiguous), with A, D, dt_bias from handles where the
  // request named them (`handle_tensors`: name -> (data_ptr, shape) of a contiguous f32 CPU
  // tensor); `queued_ns` of the time since `received_ns` the request waited to be served
  // (queue_us); `state_out`, for a request that asked for return_state, where the session's
  // state lies, else None. Returns (reply body, timing) -- y written into the
  // reply by the kernel -- or None when the request does not fit the session or its handles,
  // or its reply a frame (nothing touched; the general path then answers it).
  py::object run(const StepRequest& req, int64_t received_ns, int64_t queued_ns, uintptr_t pool, int64_t batch,
                 int64_t dim, int64_t state, uintptr_t slots, py::dict handle_tensors, const StateOut* state_out) {
    F32Array op[kOperands];
    if (!resolve(req, handle_tensors, op)) return py::none();
    if (!op[kX].is(batch, dim) || !op[kDt].is(batch, dim) || (req.given(kZ) && !op[kZ].is(batch, dim)))
      return py::none();
    // B, C: [batch, state] or [batch, groups, state], the same groups, dividing dim.
    int64_t groups = 0;
    for (Operand o : {kB, kC}) {
      const F32Array& t = op[o];
      int64_t g;
      if (t.ndim == 2 && t.shape[0] == batch && t.shape[1] == state) {
        g = 1;
      } else if (t.ndim == 3 && t.shape[0] == batch && t.shape[2] == state) {
        g = t.shape[1];
      } else {
        return py::none();
      }
      if (groups != 0 && g != groups) return py::none();
      groups = g;
    }
    if (dim % groups != 0) return py::none();
    if (!op[kA].is(dim, state)) return py::none();
    for (Operand o : {kD, kDtBias})
      if (req.given(o) && !op[o].is(dim)) return py::none();
    if (req.dt_min && req.dt_max && *req.dt_min > *req.dt_max) return py::none();

    ScanProblem p;
    p.batch = batch;
    p.seq = 1;
    p.dim = dim;
    p.state = state;
    p.groups = groups;
    p.x = f32(op[kX].data, dim, 0, 1);
    p.dt = f32(op[kDt].data, dim, 0, 1);
    if (req.given(kZ)) p.z = f32(op[kZ].data, dim, 0, 1);
    p.B = f32(op[kB].data, groups * state, 0, state, 1);
    p.C = f32(op[kC].data, groups * state, 0, state, 1);
    p.A = f32(op[kA].data, state, 1);
    if (req.given(kD)) p.D = f32(op[kD].data, 1);
    if (req.given(kDtBias)) p.dt_bias = f32(op[kDtBias].data, 1);
    p.slots.data = reinterpret_cast<void*>(slots);
    p.slots.dtype = DType::i64;
    p.slots.stride[0] = 1;
    p.h0 = f32(reinterpret_cast<const void*>(pool), dim * state, state, 1);
    p.state_out = p.h0;
    p.dt_softplus = req.dt_softplus;
    p.has_dt_min = req.dt_min.has_value();
    p.has_dt_max = req.dt_max.has_value();
    p.dt_min = req.dt_min.value_or(0.0);
    p.dt_max = req.dt_max.value_or(0.0);
    // The kernel reads and writes through strides at any byte offset: y goes straight into the
    // reply.
    return reply(req, received_ns, queued_ns, "y", {batch, dim}, state_out, reinterpret_cast<const int64_t*>(slots),
                 [&](void* y, char* error, size_t error_size) {
                   p.y = f32(y, dim, 0, 1);
                   return run_problem_(&p, sizeof(ScanProblem), error, error_size);
                 });
  }

  // One Mamba-2 step, as `run` but for a session of [heads, headdim, state] rows: x and z
  // [batch, heads, headdim], dt [batch, heads], B and C [batch, groups, state], A and dt_bias
  // [heads], D [heads] or [heads, headdim]. None also when no Mamba-2 kernel was given.
  py::object run_ssd(const StepRequest& req, int64_t received_ns, int64_t queued_ns, uintptr_t pool, int64_t batch,
                     int64_t heads, int64_t headdim, int64_t state, uintptr_t slots, py::dict handle_tensors,
                     const StateOut* state_out) {
    if (run_ssd_update_ == nullptr) return py::none();
    F32Array op[kOperands];
    if (!resolve(req, handle_tensors, op)) return py::none();
    if (!op[kX].is(batch, heads, headdim) || !op[kDt].is(batch, heads) ||
        (req.given(kZ) && !op[kZ].is(batch, heads, headdim)))
      return py::none();
    int64_t groups = 0;
    for (Operand o : {kB, kC}) {
      const F32Array& t = op[o];
      if (t.ndim != 3 || t.shape[0] != batch || t.shape[2] != state || (groups != 0 && t.shape[1] != groups))
        return py::none();
      groups = t.shape[1];
    }
    if (heads % groups != 0 || !op[kA].is(heads)) return py::none();
    if (req.given(kD) && !op[kD].is(heads) && !op[kD].is(heads, headdim)) return py::none();
    if (req.given(kDtBias) && !op[kDtBias].is(heads)) return py::none();
    if (req.dt_min && req.dt_max && *req.dt_min > *req.dt_max) return py::none();

    // This kernel reads typed pointers: an operand not aligned to its floats (bytes in a frame
    // lie anywhere) is read from an aligned copy, and D per head is spread over headdim.
    std::vector<float> copies[kOperands];
    const float* data[kOperands] = {};
    for (int o = 0; o < kOperands; ++o) {
      const F32Array& t = op[o];
      if (t.data == nullptr) continue;
      if (reinterpret_cast<uintptr_t>(t.data) % alignof(float) == 0) {
        data[o] = static_cast<const float*>(t.data);
        continue;
      }
      copies[o].resize(static_cast<size_t>(t.elements()));
      std::memcpy(copies[o].data(), t.data, copies[o].size() * sizeof(float));
      data[o] = copies[o].data();
    }
    std::vector<float> D_per_channel;
    if (data[kD] != nullptr && op[kD].ndim == 1) {
      D_per_channel.resize(static_cast<size_t>(heads * headdim));
      for (int64_t h = 0; h < heads; ++h)
        std::fill_n(D_per_channel.begin() + h * headdim, headdim, data[kD][h]);
      data[kD] = D_per_channel.data();
    }

    scan_bridge::SsdUpdateProblem<float> p;
    p.batch = batch;
    p.heads = heads;
    p.headdim = headdim;
    p.state = state;
    p.groups = groups;
    p.pool = reinterpret_cast<float*>(pool);
    p.pool_row_stride = heads * headdim * state;
    p.rows = reinterpret_cast<const int64_t*>(slots);
    p.x = data[kX];
    p.dt = data[kDt];
    p.A = data[kA];
    p.B = data[kB];
    p.C = data[kC];
    p.options.dt_bias = data[kDtBias];
    p.options.dt_softplus = req.dt_softplus;
    p.options.has_dt_min = req.dt_min.has_value();
    p.options.has_dt_max = req.dt_max.has_value();
    p.options.dt_min = static_cast<float>(req.dt_min.value_or(0.0));
    p.options.dt_max = static_cast<float>(req.dt_max.value_or(0.0));
    p.options.D = data[kD];
    p.options.z = data[kZ];
    const size_t y_floats = static_cast<size_t>(batch * heads * headdim);
    return reply(req, received_ns, queued_ns, "y", {batch, heads, headdim}, state_out, reinterpret_cast<const int64_t*>(slots),
                 [&](void* y, char* error, size_t error_size) {
      // y straight into the reply where it lies aligned, else through an aligned buffer.
      const bool aligned = reinterpret_cast<uintptr_t>(y) % alignof(float) == 0;
      std::vector<float> staged(aligned ? 0 : y_floats);
      p.y = aligned ? static_cast<float*>(y) : staged.data();
      const int status = run_ssd_update_(&p, sizeof(p), error, error_size);
      if (!aligned) std::memcpy(y, staged.data(), y_floats * sizeof(float));
      return status;
    });
  }

  // One frame of a model session: the embeds [batch, d_model] or token ids [batch] (each below
  // `vocab`, the model's embedding rows: 0 where it has none) through `model` (a
  // "scan_bridge.fused_model" capsule) on the session's state rows, which lie in `pool_rows`
  // rows `row_stride` floats apart (each layer's conv and ssm part of row 0 at the addresses in
  // `conv`, `ssm`), `slots` (int64, `batch` of them) naming its rows; logits [batch, vocab] where
  // asked for or unnamed and the model `has_head`, else hidden states. Returns as `run`, the
  // reply's result {"hidden"} or {"logits"}. None also when no model step kernel was given.
  // `snapshot_into`, for a request that names one: the snapshot's rows ([batch, row floats],
  // contiguous), which take the session's rows as `state` describes them before the kernel.
  py::object run_model(const StepRequest& req, int64_t received_ns, int64_t queued_ns, py::capsule model,
                       int64_t batch, int64_t d_model, int64_t vocab, bool has_head, uintptr_t slots,
                       int64_t pool_rows, std::vector<uintptr_t> conv, std::vector<uintptr_t> ssm, int64_t row_stride,
                       const StateOut* state_out, uintptr_t snapshot_into, const StateOut* state) {
    if (run_model_step_ == nullptr || !req.model_step || conv.size() != ssm.size()) return py::none();
    if (req.tokens.data != nullptr) {
      if (req.tokens.n != batch) return py::none();
      for (int64_t r = 0; r < batch; ++r) {
        const int64_t id = req.tokens.at(r);
        if (id < 0 || id >= vocab) return py::none();
      }
    } else if (!req.embeds.is(batch, d_model)) {
      return py::none();
    }
    const bool logits = req.output == Output::logits || (req.output == Output::unnamed && has_head);
    if (logits && !has_head) return py::none();
    if (req.snapshot_into.has_value() != (snapshot_into != 0) || (snapshot_into != 0 && state == nullptr))
      return py::none();
    scan_bridge::ModelStepProblem p;
    p.model = capsule_function<void*>(model, scan_bridge::kFusedModelCapsule);
    p.rows = batch;
    p.hidden = req.tokens.data != nullptr ? req.tokens.data : req.embeds.data;
    p.token_type = req.tokens.data != nullptr ? req.tokens.type : scan_bridge::TokenType::none;
    p.logits = logits;
    p.slots = reinterpret_cast<const int64_t*>(slots);
    p.pool_rows = pool_rows;
    p.conv = conv.data();
    p.ssm = ssm.data();
    p.layers = static_cast<int64_t>(conv.size());
    p.row_stride = row_stride;
    return reply(req, received_ns, queued_ns, logits ? "logits" : "hidden", {batch, logits ? vocab : d_model},
                 state_out, reinterpret_cast<const int64_t*>(slots), [&](void* out, char* error, size_t error_size) {
                   if (snapshot_into != 0) {
                     // The state before the frame: whole rows, every part, as read_rows lays them out.
                     const size_t row_bytes = 4 * static_cast<size_t>(state->row_floats);
                     auto* to = reinterpret_cast<uint8_t*>(snapshot_into);
                     for (int64_t r = 0; r < batch; ++r)
                       std::memcpy(to + r * row_bytes, state->pool + p.slots[r] * state->row_floats, row_bytes);
                   }
                   p.out = out;
                   return run_model_step_(&p, sizeof(p), error, error_size);
                 });
  }

 private:
  template <typename Fn>
  static Fn capsule_function(const py::capsule& capsule, const char* name) {
    if (capsule.name() == nullptr || std::string(capsule.name()) != name)
      throw py::value_error(std::string("expected the cpu backend's ") + name + " capsule");
    return reinterpret_cast<Fn>(capsule.get_pointer());
  }

  // The operands, with A, D and dt_bias from their handles where the request named them; false
  // when a named handle is not usable here.
  static bool resolve(const StepRequest& req, const py::dict& handle_tensors, F32Array* op) {
    std::copy(std::begin(req.operands), std::end(req.operands), op);
    for (int o = kA; o <= kDtBias; ++o) {
      if (!req.handles[o]) continue;
      auto found = handle_array(handle_tensors.attr("get")(kOperandNames[o]));
      if (!found) return false;
      op[o] = *found;
    }
    return true;
  }

  // The reply {"v": 1, "id", "ok": true, "result": {result_key: f32 tensor of `shape`}, "timing"},
  // sized before it is written (the id, the shapes and the payloads are its only variable parts),
  // with `kernel(y, error, error_size)` (0 on success) writing y's bytes in place, the GIL
  // released; the rows of `shape`'s first axis are the reply's batch_rows. With `state`, the
  // result also holds "state": the session's rows (`slots`) after the kernel, copied into the
  // reply as the general path's session_state gives them (its d2h stage).
  template <typename Kernel>
  py::object reply(const StepRequest& req, int64_t received_ns, int64_t queued_ns, const char* result_key,
                   std::initializer_list<int64_t> shape, const StateOut* state, const int64_t* slots,
                   Kernel kernel) {
    const bool id_is_str = py::isinstance<py::str>(req.id);
    const std::string id_text = id_is_str ? req.id.cast<std::string>() : std::string();
    const uint64_t id_number = id_is_str ? 0 : req.id.cast<uint64_t>();
    uint64_t y_bytes = 4;
    for (int64_t d : shape) y_bytes *= static_cast<uint64_t>(d);
    const int64_t batch = *shape.begin();
    // Envelope and tensor map at most 96 bytes besides the id and the shape (9 bytes an axis at
    // most); each timing entry at most 21; each state part's tensor map at most 40 besides its
    // name (5 bytes of header at most), its shape and its bytes.
    size_t size = 96 + std::strlen(result_key) + id_text.size() + 9 * shape.size() + y_bytes + 8 +
                  21 * kTimingEntries;
    uint64_t largest_tensor = y_bytes;
    if (state) {
      size += 16;
      for (const auto& part : state->parts) {
        const uint64_t part_bytes = 4 * static_cast<uint64_t>(batch * part.floats);
        size += 45 + part.name.size() + 9 * (part.shape.size() + 1) + part_bytes;
        largest_tensor = std::max(largest_tensor, part_bytes);
      }
    }
    // A reply that cannot be framed goes the general way, which refuses it before it runs: run
    // here, the session's state would move on behind the refusal.
    if (largest_tensor > max_tensor_bytes_ || size > max_reply_bytes_) return py::none();
    PyObject* raw = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(size));
    if (raw == nullptr) throw py::error_already_set();
    py::object reply = py::reinterpret_steal<py::object>(raw);
    Writer w(PyBytes_AS_STRING(raw));
    w.raw("\x85\xa1v\x01\xa2id");
    if (id_is_str) {
      w.str(id_text);
    } else {
      w.uint(id_number);
    }
    w.raw("\xa2ok\xc3\xa6result");
    *w.position() = static_cast<uint8_t>(state ? 0x82 : 0x81);
    w.skip(1);
    w.fixstr(result_key);
    void* y = w.tensor_f32(static_cast<uint64_t>(batch), shape.begin() + 1, shape.end(), y_bytes);
    // Where each state part's rows go, written once the kernel has moved them.
    std::vector<uint8_t*> state_at;
    if (state) {
      w.fixstr("state");
      if (state->named) w.map_header(state->parts.size());
      for (const auto& part : state->parts) {
        if (state->named) w.str(part.name);
        state_at.push_back(static_cast<uint8_t*>(w.tensor_f32(static_cast<uint64_t>(batch), part.shape.data(),
                                                              part.shape.data() + part.shape.size(),
                                                              4 * static_cast<uint64_t>(batch * part.floats))));
      }
    }

    const int64_t kernel_start = now_ns();
    // From here the session's rows may have moved: any failure is raised as StateWritten.
    try {
      char error[256] = {0};
      int status;
      {
        const scan_bridge::ReleasedGil unlocked;
        status = kernel(y, error, sizeof(error));
      }
      if (status != 0) throw std::runtime_error(std::string("native step kernel: ") + error);
      const int64_t kernel_end = now_ns();
      if (state) {
        for (size_t k = 0; k < state->parts.size(); ++k) {
          const auto& part = state->parts[k];
          const size_t row_bytes = 4 * static_cast<size_t>(part.floats);
          for (int64_t r = 0; r < batch; ++r)
            std::memcpy(state_at[k] + r * row_bytes, state->pool + slots[r] * state->row_floats + part.offset,
                        row_bytes);
        }
      }
      const int64_t state_end = now_ns();

      // Everything before the kernel but the wait to be served -- parsing, the caller's session
      // and handle lookups, these checks -- is the request's decode; the kernel wrote y into the
      // reply, so there is no host copy of it; the state's copy into the reply is the d2h.
      double stages[std::size(kStageKeys)] = {(kernel_start - received_ns - queued_ns) / 1e3, queued_ns / 1e3, 0.0,
                                              (kernel_end - kernel_start) / 1e3,
                                              state ? (state_end - kernel_end) / 1e3 : 0.0, 0.0};
      w.raw("\xa6timing");
      *w.position() = static_cast<uint8_t>(0x80 | kTimingEntries);
      w.skip(1);
      stages[5] = (now_ns() - state_end) / 1e3;  // encode_us: the reply up to here
      for (size_t k = 0; k < std::size(kStageKeys); ++k) {
        w.fixstr(kStageKeys[k]);
        w.f64(stages[k]);
      }
      // server_us is read last, once the reply is whole, so it covers every stage above and the
      // writing of these last entries: never less than their sum.
      w.fixstr("server_us");
      uint8_t* server_us_at = w.position();
      w.f64(0.0);
      w.fixstr("batch_rows");
      w.uint(static_cast<uint64_t>(batch));
      const double server_us = (now_ns() - received_ns) / 1e3;
      Writer(reinterpret_cast<char*>(server_us_at)).f64(server_us);
      if (w.size() > size) throw std::logic_error("native step: reply larger than sized");
      raw = reply.release().ptr();
      if (_PyBytes_Resize(&raw, static_cast<Py_ssize_t>(w.size())) < 0) throw py::error_already_set();
      reply = py::reinterpret_steal<py::object>(raw);

      py::dict timing;
      for (size_t k = 0; k < std::size(kStageKeys); ++k) timing[kStageKeys[k]] = stages[k];
      timing["server_us"] = server_us;
      timing["batch_rows"] = batch;
      return py::make_tuple(reply, timing);
    } catch (...) {
      raise_state_written();
    }
  }

  uint64_t max_tensor_bytes_;
  uint64_t max_reply_bytes_;
  scan_bridge::RunProblemFn run_problem_;
  scan_bridge::RunSsdUpdateFn run_ssd_update_;
  scan_bridge::RunModelStepFn run_model_step_;
  py::capsule keep_[3];
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "scan-bridge native step path (bridge/native)";
  py::class_<StepRequest>(m, "StepRequest")
      .def_readonly("session", &StepRequest::session)
      .def_property_readonly("op", [](const StepRequest& r) { return r.model_step ? "model_step" : "step"; })
      .def_property_readonly("output", [](const StepRequest& r) -> py::object {
        return r.output == Output::unnamed ? py::object(py::none())
                                           : py::object(py::str(r.output == Output::hidden ? "hidden" : "logits"));
      })
      .def_property_readonly("id", [](const StepRequest& r) { return r.id; })
      .def_readonly("return_state", &StepRequest::return_state)
      .def_readonly("snapshot_into", &StepRequest::snapshot_into)
      .def_property_readonly("deadline_us", [](const StepRequest& r) -> py::object {
        return r.deadline_us ? py::object(py::int_(*r.deadline_us)) : py::object(py::none());
      })
      .def_property_readonly("handles", &handles_of);
  m.def("parse", &parse, py::arg("frame"));
  // The stage keys the replies' timing holds, for bridge.native to check against bridge/timing.py.
  py::tuple stage_keys(std::size(kStageKeys));
  for (size_t k = 0; k < std::size(kStageKeys); ++k) stage_keys[k] = kStageKeys[k];
  m.attr("STAGE_KEYS") = stage_keys;
  state_written_type = PyErr_NewExceptionWithDoc(
      PYBIND11_TOSTRING(TORCH_EXTENSION_NAME) ".StateWritten",
      "A step failed once its kernel began: the session's state may have moved. __cause__: the failure.",
      PyExc_Exception, nullptr);
  if (state_written_type == nullptr) throw py::error_already_set();
  m.attr("StateWritten") = py::handle(state_written_type);
  py::class_<StateOut>(m, "StateOut")
      .def(py::init<uintptr_t, int64_t, bool, const py::tuple&>(), py::arg("pool"), py::arg("row_floats"),
           py::arg("named"), py::arg("parts"));
  py::class_<Stepper>(m, "Stepper")
      .def(py::init<py::capsule, std::optional<py::capsule>, std::optional<py::capsule>, uint64_t, uint64_t>(),
           py::arg("run_problem"), py::arg("run_ssd_update") = py::none(), py::arg("run_model_step") = py::none(),
           py::arg("max_tensor_bytes") = 0xFFFFFFFFull, py::arg("max_reply_bytes") = 0xFFFFFFFFull)
      .def("run", &Stepper::run, py::arg("request"), py::arg("received_ns"), py::arg("queued_ns"),
           py::arg("pool"), py::arg("batch"), py::arg("dim"), py::arg("state"), py::arg("slots"),
           py::arg("handle_tensors"), py::arg("state_out") = py::none())
      .def("run_ssd", &Stepper::run_ssd, py::arg("request"), py::arg("received_ns"), py::arg("queued_ns"),
           py::arg("pool"), py::arg("batch"), py::arg("heads"), py::arg("headdim"), py::arg("state"),
           py::arg("slots"), py::arg("handle_tensors"), py::arg("state_out") = py::none())
      .def("run_model", &Stepper::run_model, py::arg("request"), py::arg("received_ns"), py::arg("queued_ns"),
           py::arg("model"), py::arg("batch"), py::arg("d_model"), py::arg("vocab"), py::arg("has_head"),
           py::arg("slots"), py::arg("pool_rows"),
           py::arg("conv"), py::arg("ssm"), py::arg("row_stride"), py::arg("state_out") = py::none(),
           py::arg("snapshot_into") = 0, py::arg("state") = py::none());
}
