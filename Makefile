# Two commands on a fresh machine: `make test` and `make bench`. Both create .venv/ on first use
# and install everything the project needs; nothing is installed by hand.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: all test bench setup kernels system-deps clean

all: test

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# torch comes first, pinned, so that the project's unpinned requirement is already met and pip
# never picks a torch itself: on these CPU machines torch==2.13.0 is the local CPU build, where
# an unpinned one would pull gigabytes of CUDA wheels (from PyPI the same pin is a CUDA build).
$(STAMP): pyproject.toml | $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,triton]'
	touch $(STAMP)

# system-deps first: it installs the compilers that `kernels` builds with.
setup: system-deps $(STAMP) kernels

# Debian packages for the non-Python suites (C client, Elixir client): .ci/system-deps.sh.
system-deps:
	@bash .ci/system-deps.sh

# Builds the C++ CPU kernels and the native step path (bridge/native) ahead of time. Where the
# kernels cannot be built the torch backend serves, where the step path cannot every step takes
# the general path; either way the reason is printed (and logged again by the server).
kernels: $(STAMP)
	@$(PY) -c "import kernels.cpu" 2>/dev/null && $(PY) -m kernels.cpu.build || echo "make: CPU kernels not built (see above); the torch backend will serve CPU tensors"
	@$(PY) -m bridge.native || echo "make: native step path not built (see above); steps take the general path"

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

# The main job: where the time goes, per transport and payload size, against each lane's echo floor.
bench: setup
	$(PY) -m bridge.bench --quick --json bench/results/bridge-bench-quick.json --plot docs/bridge-bench.png

clean:
	rm -rf $(VENV) build .pytest_cache
