#!/usr/bin/env bash
# What a lent GPU is wanted for, as one run that fits a short lease (docs/performance.md, "Record:
# on a GPU"): the Triton kernels against torch and their memory floors (Mamba-1 and Mamba-2 scans
# and steps: issue 33's open goal, first, so that a lease cut short still has it), the Triton
# backward against torch autograd, and the CUDA cases of the GPU-facing test files. Everything it
# writes goes under OUT, at most eight files for any three parts (what the device tool returns):
# summary.txt (the machine, then each part's status), each part's log, and the benches' JSON
# (each with machine and commit info), to be committed under bench/results/ and cited where
# their figures are read.
#
#   bash bench/gpu_checks.sh OUT [kernels|backward|tests|kernel-tests|graphs|tune|host ...]
#                                       (default: kernels backward tests, in that order)
#
# The default parts' limits add up to under 8 minutes: one call (timeout_s 600) runs them all,
# where a second call would likely start, and pay for, a fresh machine.
#
# Run from the repository root; PYTHON (default python3) is the Python that holds torch with
# CUDA. Packages the machine lacks (pyzmq, msgspec: the test parts need them, the benches do
# not) are installed first from the wheels in .whl/ where that folder travelled with the tree
# (`carry`; `pip download --only-binary=:all:` for that machine's Python). BASELINE, where set,
# is another checkout (its scan_kernels/ is enough: `git archive REV scan_kernels` unpacked into
# an ignored folder that travels with the tree; 4b37d53 or later, which has the Triton backward
# the host part times) whose Triton calls the host part times beside this tree's. A part that
# fails is reported and the next one runs; the exit status is the number of parts that failed.
set -uo pipefail
out=${1:?usage: bash bench/gpu_checks.sh OUT [kernels|backward|tests|kernel-tests|graphs|tune|host ...]}
shift
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(kernels backward tests)
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
if [ -d .whl ]; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_checks: $py has no torch that sees a CUDA device here" >&2
    exit 2
fi
{ nvidia-smi; "$py" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
    > "$out/summary.txt" 2>&1
if ! "$py" -c "import msgspec, zmq" 2>/dev/null; then
    echo "gpu_checks: no msgspec or pyzmq here (carry .whl/): the test parts cannot load their fixtures" \
        | tee -a "$out/summary.txt" >&2
fi
# A hanging test ends alone, named, rather than ending its part with no test named at all.
per_test=()
"$py" -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout 120)

failed=0
run() {  # run NAME SECONDS COMMAND...: the command's output to OUT/NAME.log, its status reported
    local name=$1 seconds=$2
    shift 2
    local start=$SECONDS
    timeout "$seconds" "$@" > "$out/$name.log" 2>&1
    local status=$?
    echo "gpu_checks: $name exited $status after $((SECONDS - start)) s" | tee -a "$out/summary.txt"
    [ $status -eq 0 ] || failed=$((failed + 1))
}

for part in "${parts[@]}"; do
    case $part in
        kernel-tests)  # the Triton kernels' CUDA cases alone: a shorter first look than `tests`
            run kernel-tests 170 "$py" -m pytest -q -p no:cacheprovider -n 16 --durations=10 "${per_test[@]}" \
                tests/test_kernels_triton.py tests/test_kernels_triton_ssd.py tests/test_kernels_triton_backward.py \
                tests/test_model_graphs.py ;;
        graphs)  # captured model steps (issue 34): the server's steps against composed ones
            run model-graphs 150 "$py" -m bench.model_graphs --json "$out/model-graphs-cuda.json" ;;
        tune)  # the SSD scan's tile table: each candidate timed and checked against float64
            run tune 150 "$py" -m bench.ssd_tune --seconds 0.2 --json "$out/ssd-tune-cuda.json" ;;
        tests)  # the CUDA cases: every case of these files runs on the GPU, the interpreter's skip
            run tests 200 "$py" -m pytest -q -p no:cacheprovider -n 16 --durations=10 "${per_test[@]}" \
                tests/test_kernels_triton.py tests/test_kernels_triton_ssd.py tests/test_kernels_triton_backward.py \
                tests/test_kernels_ssd.py tests/test_step_graphs.py tests/test_model_graphs.py tests/test_sessions.py \
                tests/test_batcher.py ;;
        kernels)  # issue 33's GPU goal: the Triton SSD scan >= 10x torch's chunked form (each case
                  # printed as it is measured: a part cut short keeps the rows it printed)
            run kernels 150 "$py" -m bench.kernels --device cuda \
                --cases ssd-130m,ssd-exphil,ssd-step-130m,ssd-step-exphil,exphil,step-32x512x16 \
                --json "$out/kernels-cuda-ssd.json" ;;
        host)  # each Triton call's pace with its launches (against BASELINE's kernels where given);
               # its figures written after every round
            run triton_host 120 "$py" -m bench.triton_host --device cuda --rounds 6 --calls 300 \
                ${BASELINE:+--baseline "$BASELINE"} --json "$out/triton-host-cuda.json" ;;
        backward)  # issue 35's GPU goal: the Triton backward >= 20x torch autograd
            run backward 120 "$py" -m bench.backward --device cuda --reps 20 \
                --cases exphil,1x768x1024x16,ssd-1x1024x8x64x64 --json "$out/backward-cuda.json" ;;
        *)
            echo "gpu_checks: unknown part $part (kernels, backward, tests, kernel-tests, graphs, tune, host)" >&2
            failed=$((failed + 1)) ;;
    esac
done
exit $failed
