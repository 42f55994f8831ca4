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

# `make test` runs more workers than the machine has cores (the Makefile's TEST_WORKERS), and
# their servers inherit this: OpenMP threads that spin between torch's parallel regions would
# burn the cores the other workers are waiting for. Read when torch loads, so it comes first.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Without a GPU the Triton kernels run on Triton's CPU interpreter. Triton reads this when its
# kernels are defined, so it must be set before triton is first imported in this process.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The in-process server fixture (`inproc`) of the session and batcher tests.
pytest_plugins = ["bridge_fakes"]


# `make test` runs the suite on pytest-xdist's workers, a test file to a worker ("--dist
# loadfile"), files here run first: these run longest, and a long file started last would hold
# the whole run up. A worker runs its file's tests in order, and its module-scoped servers once.
LONGEST_FIRST = ("tests/test_sanitizers.py", "tests/test_elixir_client.py", "tests/test_bench.py",
                 "tests/test_kernels_cpu.py", "tests/test_kernels_triton.py", "tests/test_fuzz.py")
# Files that must share a worker: the Elixir suites compile into one project's _build, and
# test_elixir_dependency asserts that nothing writes into the project while it runs.
SHARED_WORKER = {"tests/test_elixir_dialyzer.py": "tests/test_elixir_client.py",
                 "tests/test_elixir_dependency.py": "tests/test_elixir_client.py"}


def _test_file(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return SHARED_WORKER.get(path, path)


def pytest_collection_modifyitems(session, config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(_test_file(item.nodeid), len(rank)))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, with the SHARED_WORKER files in one unit of work, in collection order."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _test_file(nodeid)

    config.option.loadscopereorder = False  # LONGEST_FIRST's order, not the most tests first
    return FileScheduling(config, log)


def _start_background_runs(module, items) -> None:
    """Starts `module`'s child suites whose judging tests are among `items`: a test module
    offers `start_background_runs(selected test names)`."""
    start = getattr(module, "start_background_runs", None)
    if start is not None:
        start({item.originalname for item in items if getattr(item, "module", None) is module})


def pytest_collection_finish(session):
    """Child suites that run long (the sanitizer pass, the ExUnit suite) start as soon as the
    tests are collected, beside the rest of the session rather than after it. xdist's workers
    each collect every test: there a child starts when its module's first test runs on one."""
    if not session.config.option.collectonly and not os.environ.get("PYTEST_XDIST_WORKER"):
        for module in {getattr(item, "module", None) for item in session.items} - {None}:
            _start_background_runs(module, session.items)


@pytest.fixture(autouse=True, scope="module")
def _background_runs_on_a_worker(request):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        _start_background_runs(request.module, request.session.items)
    yield


def pytest_sessionfinish(session, exitstatus):
    """In CI (CI=true) a suite that cannot run fails the run instead of skipping: a skip there
    passes only with a reason the machine's kind expects (kernel_cases.expected_skip). Without this,
    a C++ kernel build that broke would turn its suites into skips (and drop its cases from the
    parametrized kernel tests) under a green run. Elsewhere every skip prints its reason (-ra)."""
    if os.environ.get("CI") != "true" or exitstatus != 0 or os.environ.get("PYTEST_XDIST_WORKER"):
        return  # (xdist's workers report their skips to the process that judges them here)
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
