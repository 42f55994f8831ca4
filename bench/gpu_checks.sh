#!/usr/bin/env bash
# What a lent GPU is wanted for, as one run that fits a short lease (docs/performance.md, "Record:
# on a GPU"): the CUDA cases of the GPU-facing test files, the Triton kernels against torch and
# their memory floors (Mamba-1 and Mamba-2 scans and steps), and the Triton backward against
# torch autograd. Everything it writes goes under OUT: the machine's description, each part's
# log, and the benches' JSON (each with machine and commit info), to be committed under
# bench/results/ and cited where their figures are read.
#
#   bash bench/gpu_checks.sh OUT [kernel-tests|graphs|tune|tests|kernels|backward ...]
#                                       (default: tests kernels backward, in that order)
#
# The parts' limits add up to 13 minutes: where one command may run at most 10, run `tests` in
# one and `kernels backward` in the next.
#
# Run from the repository root; PYTHON (default python3) is the Python that holds torch with
# CUDA. Packages the machine lacks (pyzmq, msgspec) are installed first from the wheels in .whl/
# where that folder exists (`pip download --only-binary=:all:` for that machine's Python).
# BASELINE, where set, is another checkout (its scan_kernels/ is enough, kernels/ before the
# package's rename: `git archive REV scan_kernels` unpacked into an ignored folder that travels
# with the tree) whose Triton calls the kernels part times beside this tree's. A part that
# fails is reported and the next one runs; the exit status is the number of parts that failed.
set -uo pipefail
out=${1:?usage: bash bench/gpu_checks.sh OUT [kernel-tests|graphs|tune|tests|kernels|backward ...]}
shift
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests kernels backward)
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
    > "$out/machine.txt" 2>&1

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
            run kernel-tests 170 "$py" -m pytest -q -p no:cacheprovider -n 16 --durations=10 \
                tests/test_kernels_triton.py tests/test_kernels_triton_ssd.py tests/test_kernels_triton_backward.py \
                tests/test_model_graphs.py ;;
        graphs)  # captured model steps (issue 34): the server's steps against composed ones
            run model-graphs 150 "$py" -m bench.model_graphs --json "$out/model-graphs-cuda.json" ;;
        tune)  # the SSD scan's tile table: each candidate timed and checked against float64
            run tune 150 "$py" -m bench.ssd_tune --seconds 0.2 --json "$out/ssd-tune-cuda.json" ;;
        tests)  # the CUDA cases: every case of these files runs on the GPU, the interpreter's skip
            run tests 250 "$py" -m pytest -q -p no:cacheprovider -n 16 --durations=10 \
                tests/test_kernels_triton.py tests/test_kernels_triton_ssd.py tests/test_kernels_triton_backward.py \
                tests/test_kernels_ssd.py tests/test_step_graphs.py tests/test_model_graphs.py tests/test_sessions.py \
                tests/test_batcher.py ;;
        kernels)  # issue 33's GPU goal: the Triton SSD scan >= 10x torch's chunked form; then each
                  # Triton call's pace with its launches (against BASELINE's kernels where given)
            run kernels 180 "$py" -m bench.kernels --device cuda \
                --cases ssd-130m,ssd-exphil,ssd-step-130m,ssd-step-exphil,exphil,step-32x512x16 \
                --json "$out/kernels-cuda-ssd.json"
            run triton_host 120 "$py" -m bench.triton_host --device cuda --rounds 6 --calls 300 \
                ${BASELINE:+--baseline "$BASELINE"} --json "$out/triton-host-cuda.json" ;;
        backward)  # issue 35's GPU goal: the Triton backward >= 20x torch autograd
            run backward 150 "$py" -m bench.backward --device cuda --reps 20 \
                --cases exphil,1x768x1024x16,ssd-1x1024x8x64x64 --json "$out/backward-cuda.json" ;;
        *)
            echo "gpu_checks: unknown part $part (kernel-tests, graphs, tune, tests, kernels, backward)" >&2
            failed=$((failed + 1)) ;;
    esac
done
exit $failed
