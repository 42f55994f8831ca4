"""Coverage-guided fuzzing (atheris, libFuzzer) of the code that reads untrusted bytes: the v1
request decoder, the legacy ExPhil decoder, the native step path's parser and the stream framer.
docs/fuzzing.md says what each harness checks and how to run them; `python -m fuzz --help`.

Nothing here imports `protocol` or `bridge` at package level: a harness's child process
instruments `protocol` for coverage as it is first imported (fuzz.child), which an earlier
import would defeat.
"""

# name -> the packages whose Python code is instrumented for coverage in that harness's process.
# The native step harness takes its coverage from the C++ parser's own instrumentation.
HARNESSES = {
    "decoder": ("protocol",),
    "legacy": ("protocol",),
    "native_step": (),
    "framing": ("protocol",),
}


class HarnessUnavailable(RuntimeError):
    """A harness cannot run here (what it fuzzes cannot be built or loaded): the reason."""
