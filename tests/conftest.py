import os
import sys

# Tests import the project from the checkout (also when it is not installed in the venv).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
TESTS = os.path.dirname(os.path.abspath(__file__))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

# Without a GPU the Triton kernels run on Triton's CPU interpreter. Triton reads this when its
# kernels are defined, so it must be set before triton is first imported in this process.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The in-process server fixture (`inproc`) of the session and batcher tests.
pytest_plugins = ["bridge_fakes"]
