/* LLVMFuzzerCustomMutator for a process whose libFuzzer was preloaded (atheris's
 * asan_with_fuzzer.so, fuzz/native_build.py).
 *
 * Why: libFuzzer looks for a custom mutator once, when its library is loaded, through a weak
 * symbol; a preloaded libFuzzer starts before Python, so the custom mutator atheris registers
 * later is never found and libFuzzer mutates bytes blindly. This library is preloaded before it
 * and defines the symbol; the harness process hands it the Python mutator
 * (fuzz_set_custom_mutator) before fuzzing starts. Until then it is libFuzzer's own mutator. */

#include <stddef.h>
#include <stdint.h>

typedef size_t (*fuzz_mutator)(uint8_t *data, size_t size, size_t max_size, unsigned int seed);

size_t LLVMFuzzerMutate(uint8_t *data, size_t size, size_t max_size);

static fuzz_mutator python_mutator;

__attribute__((visibility("default"))) void fuzz_set_custom_mutator(fuzz_mutator mutator) {
  python_mutator = mutator;
}

__attribute__((visibility("default"))) size_t LLVMFuzzerCustomMutator(uint8_t *data, size_t size,
                                                                        size_t max_size, unsigned int seed) {
  return python_mutator ? python_mutator(data, size, max_size, seed) : LLVMFuzzerMutate(data, size, max_size);
}
