"""`python -m bridge.native`: build the native step module ahead of time (the Makefile's
`kernels` target), so that a server's first start does not compile it."""

import sys
import time

from scan_kernels.errors import BackendUnavailable

from . import _module

start = time.perf_counter()
try:
    module = _module()
except BackendUnavailable as exc:
    print(f"bridge.native: not built (steps take the general path): {exc}", file=sys.stderr)
    sys.exit(1)
print(f"bridge.native: {module.__file__} ready in {time.perf_counter() - start:.1f} s")
