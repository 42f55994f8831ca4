# Two commands on a fresh machine: `make test` and `make bench`. Both create .venv/ on first use
# and install everything the project needs; nothing is installed by hand.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# Every Python package `make setup` installs (pip, and the editable install's build backend,
# too), at the version CI last passed with: a clean clone resolves what upstream released since,
# which has broken the suites before. `make lock` renews it.
LOCK   := constraints.txt
TORCH  := torch==2.13.0
PYTEST_ARGS ?=
# Test files run on this many pytest-xdist workers, a file to a worker (tests/conftest.py says
# in which order); 0 runs them in this process, one after another. More workers than cores: much
# of the suite waits on servers, peer nodes and child suites rather than computing.
TEST_WORKERS ?= 4

.PHONY: all test bench bench-record setup kernels system-deps lock clean

all: test

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade -c $(LOCK) pip

# torch comes first, pinned, so that the project's unpinned requirement is already met and pip
# never picks a torch itself: on these CPU machines $(TORCH) is the local CPU build, where
# an unpinned one would pull gigabytes of CUDA wheels (from PyPI the same pin is a CUDA build).
#
# pip works on one core. The kernels need torch and ninja alone, so they compile on the other
# while pip installs the rest, and the native step path (which imports the rest) while the
# installed files are byte-compiled; their output goes to .venv/*-build.log, and `kernels` below
# finds them built, or builds them again and says why not. pip byte-compiles one file after
# another: compileall -j 0 does the same on every core. Its exit status is ignored, as pip ignores
# the same errors: torch ships a file of Python 3.12 syntax, compiled only if ever imported.
$(STAMP): pyproject.toml $(LOCK) | $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet --no-compile -c $(LOCK) $(TORCH) numpy
	$(PY) -m pip install --quiet --no-compile -c $(LOCK) ninja
	@$(PY) -m scan_kernels.cpu.build > $(VENV)/kernels-build.log 2>&1 & \
	$(PY) -m pip install --quiet --no-compile -c $(LOCK) --build-constraint $(LOCK) -e '.[dev,triton]' || { wait; exit 1; }; \
	$(PY) -m bridge.native > $(VENV)/native-step-build.log 2>&1 & \
	$(PY) -m compileall -qq -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"; \
	wait
	touch $(STAMP)

# system-deps first: it installs the compilers that `kernels` builds with.
setup: system-deps $(STAMP) kernels

# Debian packages for the non-Python suites (C client, Elixir client): .ci/system-deps.sh.
system-deps:
	@bash .ci/system-deps.sh

# Builds the C++ CPU kernels and the native step path (bridge/native) ahead of time. Where the
# kernels cannot be built the torch backend serves, where the step path cannot every step takes
# the general path; either way the reason is printed (and logged again by the server). The two
# build at once: each spends most of its time in one long compile, on one core.
kernels: $(STAMP)
	@{ $(PY) -c "import scan_kernels.cpu" 2>/dev/null && $(PY) -m scan_kernels.cpu.build || echo "make: CPU kernels not built (see above); the torch backend will serve CPU tensors"; } & \
	{ $(PY) -m bridge.native || echo "make: native step path not built (see above); steps take the general path"; }; \
	wait

# The suites start hundreds of Python processes (servers, benches, child suites). Where the
# environment sets PYTHONDONTWRITEBYTECODE, each would compile the checkout's modules again and
# each pytest process rewrite and compile every test module: the run writes those caches
# (__pycache__/, git-ignored) whatever the environment says.
test: setup
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The main job: where the time goes, per transport and payload size, against each lane's echo floor.
# Writes into the git-ignored bench/out/, so a run leaves the tracked tree as it was; compare
# bench/out/bridge-bench-quick.json with the recorded bench/results/bridge-bench-quick.json.
BENCH_ARGS := --quick
bench: setup
	$(PY) -m bridge.bench $(BENCH_ARGS) --json bench/out/bridge-bench-quick.json --plot bench/out/bridge-bench.png

# Records a new reference: the same run, written over the tracked
# bench/results/bridge-bench-quick.json and docs/bridge-bench.png (the figure README shows).
# Run it on purpose, then commit both files.
bench-record: setup
	$(PY) -m bridge.bench $(BENCH_ARGS) --json bench/results/bridge-bench-quick.json --plot docs/bridge-bench.png

# Renews $(LOCK) from what pip resolves today in a fresh virtualenv (the project's requirements,
# torch pinned as above); run the suites on it before committing the new file.
LOCK_VENV := build/lock-venv
lock:
	rm -rf $(LOCK_VENV)
	$(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(LOCK_VENV)/bin/python -m pip install --quiet --no-compile $(TORCH) numpy
	$(LOCK_VENV)/bin/python -m pip install --quiet --no-compile ninja -e '.[dev,triton]'
	{ echo "# Written by \`make lock\`: every package \`make setup\` installs, pinned (see the Makefile)."; \
	  $(LOCK_VENV)/bin/python -m pip freeze --all --exclude-editable | sed -e 's/+cpu$$//'; } > $(LOCK).new
	mv $(LOCK).new $(LOCK)
	rm -rf $(LOCK_VENV)

clean:
	rm -rf $(VENV) build bench/out .pytest_cache
