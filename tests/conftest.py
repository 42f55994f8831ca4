import os
import sys

import pytest

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


def pytest_collection_finish(session):
    """Child suites that run long (the sanitizer pass) start as soon as the tests are collected,
    beside the rest of the session rather than after it, when the test that judges them is
    selected: a test module offers `start_background_runs(selected test names)`."""
    if session.config.option.collectonly:
        return
    selected: dict = {}
    for item in session.items:
        module = getattr(item, "module", None)
        if module is not None:
            selected.setdefault(module, set()).add(item.originalname)
    for module, names in selected.items():
        start = getattr(module, "start_background_runs", None)
        if start is not None:
            start(names)


def pytest_sessionfinish(session, exitstatus):
    """In CI (CI=true) a suite that cannot run fails the run instead of skipping: a skip there
    passes only with a reason the machine's kind expects (kernel_cases.expected_skip). Without this,
    a C++ kernel build that broke would turn its suites into skips (and drop its cases from the
    parametrized kernel tests) under a green run. Elsewhere every skip prints its reason (-ra)."""
    if os.environ.get("CI") != "true" or exitstatus != 0:
        return
    from kernel_cases import expected_skip

    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    unexpected = []
    for report in reporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        if not expected_skip(reason):
            unexpected.append(f"{report.nodeid}: {reason}")
    if unexpected:
        reporter.write("\n")
        reporter.write_sep("=", "CI: skips this machine's kind does not expect (each fails the run)", red=True)
        for line in unexpected:
            reporter.write_line(line)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
