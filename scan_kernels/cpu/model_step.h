// A whole model's step for native callers in this process (the bridge's native step path):
// the weights are prepared once (a "scan_bridge.fused_model" capsule, made by the backend's
// `prepare_model`), and each step is a ModelStepProblem run through the capsule
// "scan_bridge.run_model_step" (scan_kernels/cpu/binding.cpp, `model_step`, is the math).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace scan_bridge {

// A step's token ids, when its input is tokens (each below the model's embedding rows).
enum class TokenType : int32_t { none = 0, i32 = 1, i64 = 2, u8 = 3 };

// Token id i of `ids` (of `type`, at any byte offset).
inline int64_t token_at(const void* ids, TokenType type, int64_t i) {
  const auto* bytes = static_cast<const uint8_t*>(ids);
  if (type == TokenType::u8) return bytes[i];
  if (type == TokenType::i32) {
    int32_t v;
    std::memcpy(&v, bytes + 4 * i, 4);
    return v;
  }
  int64_t v;
  std::memcpy(&v, bytes + 8 * i, 8);
  return v;
}

struct ModelStepProblem {
  const void* model = nullptr;  // the pointer in a "scan_bridge.fused_model" capsule
  int64_t rows = 0;
  // The input: [rows, d_model] f32 embeddings (token_type none), or [rows] token ids looked up
  // in the model's embedding; at any byte offset, read, not written.
  const void* hidden = nullptr;
  TokenType token_type = TokenType::none;
  // [rows, d_model] f32, the final norm's output, or with `logits` the head's [rows, vocab] f32;
  // at any byte offset.
  void* out = nullptr;
  bool logits = false;
  const int64_t* slots = nullptr;  // [rows] state rows, each below pool_rows
  int64_t pool_rows = 0;
  // Per layer, the address of state row 0's conv windows ([conv channels, d_conv] f32) and of
  // its ssm state ([d_inner, state] or [heads, headdim, state] f32), each contiguous within a
  // row; rows lie `row_stride` floats apart in both.
  const uintptr_t* conv = nullptr;
  const uintptr_t* ssm = nullptr;
  int64_t layers = 0;  // the length of conv and ssm: the model's layer count
  int64_t row_stride = 0;
};

// `problem_size` is sizeof(ModelStepProblem) as the caller was compiled; 0 on success, else the
// error's message is in `error` (nothing is written to the state before the checks pass).
using RunModelStepFn = int (*)(const ModelStepProblem* problem, size_t problem_size, char* error,
                               size_t error_size);
inline constexpr char kRunModelStepCapsule[] = "scan_bridge.run_model_step";
inline constexpr char kFusedModelCapsule[] = "scan_bridge.fused_model";

}  // namespace scan_bridge
