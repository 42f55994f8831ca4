"""The host time of the Triton backend's calls: what each kernels API call costs the CPU before
its kernels run (argument checks, planning, buffers, the launches' arguments), and how many
launches it makes. On a GPU a small call is bound by this host work (docs/performance.md,
"triton launch host time"), so it can be measured, and cut, on a machine without one.

The forwards and the state updates are timed; the backwards only on CUDA: their host part does
part of their math in torch ops, which here would run on the CPU instead of being launched.
Each case runs in a child process of its own tree with Triton's interpreter selected and every
launch replaced by a counter: nothing runs on a device, Triton's own launch call included (on a
GPU that comes on top, per launch). `--device cuda` (a lent GPU) launches for real, each case's
calls back to back with the device synchronized once at the end: what a small call costs there,
its launches included. With `--baseline TREE` (another checkout, e.g. a
`git worktree` of the commit before a change) the two trees' children take turns, A B then B A,
and each case reports both medians, baseline over this tree, and the median of the rounds'
ratios.

    python -m bench.triton_host [--baseline ../base-checkout] [--rounds 6] [--calls 2000] [--device cpu|cuda]
                                [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from bridge.bench.machine import commit_info, output_path, positive_count, write_results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Run by each child with its tree first on sys.path: the kernels API only (both trees have it),
# under the package name the tree has (argv[3]). Inputs are built once per case, outside the
# timed calls; a call's median over `calls` is its host time.
CHILD = r"""
import json, os, sys, time
calls, device, package = int(sys.argv[1]), sys.argv[2], sys.argv[3]
if device == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
import importlib
import torch
scan_kernels = importlib.import_module(package)
# An editable install finds its own checkout's package where the tree has none by that name.
if not os.path.realpath(scan_kernels.__file__).startswith(os.path.join(os.path.realpath(os.getcwd()), "")):
    sys.exit(f"{package} came from {scan_kernels.__file__}, not from the tree {os.getcwd()}")
common = importlib.import_module(package + ".triton_kernels.common")

launches = []
launch = common.Launch.run
if device == "cpu":
    common.Launch.run = lambda self: launches.append(self.kernel)
else:
    def counted(self):
        launches.append(self.kernel)
        launch(self)
    common.Launch.run = counted
g = torch.Generator().manual_seed(0)

def rand(*shape):
    return torch.rand(*shape, generator=g).to(device)

def mamba1(b, l, d, n):
    return dict(x=rand(b, l, d), dt=rand(b, l, d), A=-rand(d, n), B=rand(b, l, 1, n), C=rand(b, l, 1, n))

def ssd(b, l, h, p, n):
    return dict(x=rand(b, l, h, p), dt=rand(b, l, h), A=-rand(h), B=rand(b, l, 1, n), C=rand(b, l, 1, n))

def cases():
    m = mamba1(32, 60, 512, 16)
    D = rand(512)
    yield "scan exphil", lambda: scan_kernels.selective_scan(**m, D=D, dt_softplus=True, backend="triton")
    state, slots = rand(64, 512, 16), torch.arange(32, device=device)
    step = dict(x=rand(32, 512), dt=rand(32, 512), A=-rand(512, 16), B=rand(32, 1, 16), C=rand(32, 1, 16))
    yield "state_update 32x512x16", lambda: scan_kernels.selective_state_update(
        state, **step, D=D, dt_softplus=True, slots=slots, backend="triton")
    s, D_heads = ssd(32, 60, 8, 64, 16), rand(8)
    yield "ssd_scan exphil", lambda: scan_kernels.ssd_scan(**s, D=D_heads, dt_softplus=True, backend="triton")
    h0 = rand(32, 8, 64, 16)
    yield "ssd_scan exphil, h0 and state", lambda: scan_kernels.ssd_scan(
        **s, D=D_heads, dt_softplus=True, h0=h0, return_state=True, backend="triton")
    big, D_big = ssd(1, 1024, 24, 64, 128), rand(24)
    yield "ssd_scan 130m", lambda: scan_kernels.ssd_scan(**big, D=D_big, dt_softplus=True, backend="triton")
    ssd_state = rand(64, 8, 64, 16)
    ssd_step = dict(x=rand(32, 8, 64), dt=rand(32, 8), A=-rand(8), B=rand(32, 1, 16), C=rand(32, 1, 16))
    yield "ssd_state_update 32x8x64x16", lambda: scan_kernels.ssd_state_update(
        ssd_state, **ssd_step, D=D_heads, dt_softplus=True, slots=slots, backend="triton")
    if device != "cpu":  # their torch ops would run here, on the CPU: timed where they are launched
        dy, dy_ssd = rand(32, 60, 512), rand(32, 60, 8, 64)
        yield "scan_backward exphil", lambda: scan_kernels.selective_scan_backward(
            dy, **m, D=D, dt_softplus=True, backend="triton")
        yield "ssd_scan_backward exphil", lambda: scan_kernels.ssd_scan_backward(
            dy_ssd, **s, D=D_heads, dt_softplus=True, backend="triton")

out = {}
for name, call in cases():
    call()
    launches.clear()
    call()
    count = len(launches)
    if device == "cpu":
        times = []
        for _ in range(calls):
            start = time.perf_counter_ns()
            call()
            times.append((time.perf_counter_ns() - start) / 1e3)
        us = sorted(times)[len(times) // 2]
    else:  # back to back, the device's queue drained once at the end: a small call's host-bound pace
        torch.cuda.synchronize()
        start = time.perf_counter_ns()
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
        us = (time.perf_counter_ns() - start) / 1e3 / calls
    out[name] = {"call_us": us, "launches": count}
print(json.dumps(out))
"""


def kernels_package(tree: str) -> str:
    """The name of the kernels package in `tree`: `kernels` in a tree from before the rename."""
    return "scan_kernels" if os.path.isdir(os.path.join(tree, "scan_kernels")) else "kernels"


def child_run(tree: str, calls: int, device: str) -> dict:
    """One child's figures, per case: µs a call (on the CPU the host work's median, on CUDA the
    mean of calls back to back) and launches a call."""
    env = {**os.environ, "PYTHONPATH": tree}
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", CHILD, str(calls), device, kernels_package(tree)],
                          capture_output=True, text=True, env=env, cwd=tree, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"the child of {tree} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.triton_host", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", help="another checkout of this project to compare with")
    parser.add_argument("--rounds", type=positive_count, default=6, help="children per tree, the trees taking turns")
    parser.add_argument("--calls", type=positive_count, default=2000, help="timed calls per case and child")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: real launches on the GPU, each case's calls back to back")
    parser.add_argument("--json", type=output_path, default=os.path.join(ROOT, "bench", "out", "triton_host.json"))
    args = parser.parse_args(argv)
    if args.device == "cuda":
        import torch  # the children's, not this process's, otherwise

        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device here")

    trees = {"this": ROOT, **({"baseline": os.path.abspath(args.baseline)} if args.baseline else {})}
    runs: dict[str, list[dict]] = {side: [] for side in trees}
    cases = []
    for r in range(args.rounds):
        order = list(trees) if r % 2 == 0 else list(reversed(trees))
        for side in order:
            runs[side].append(child_run(trees[side], args.calls, args.device))
            print(f"round {r + 1}/{args.rounds}: {side} done", file=sys.stderr, flush=True)
        # Written after every round: a run cut short (a GPU lease's part limit) keeps its rounds.
        cases = summarize(runs)
        write(args, trees, cases, rounds_done=r + 1)

    for case in cases:
        line = f"{case['case']:32s} {case['this']['host_us']:7.1f} µs, {case['this']['launches']} launches"
        if "baseline" in case:
            line += (f"; baseline {case['baseline']['host_us']:7.1f} µs, {case['baseline']['launches']} launches"
                     f" ({case['baseline_over_this']:.2f}x, paired {case['paired_ratio_median']:.2f}x)")
        print(line)
    return 0


def summarize(runs: dict[str, list[dict]]) -> list[dict]:
    """Each case's figures over the rounds run so far, each tree's and their ratios."""
    cases = []
    for name in runs["this"][0]:
        case = {"case": name}
        for side, side_runs in runs.items():
            medians = [run[name]["call_us"] for run in side_runs]
            case[side] = {"host_us": statistics.median(medians), "rounds_us": medians,
                          "launches": side_runs[0][name]["launches"]}
        if "baseline" in case:
            case["baseline_over_this"] = case["baseline"]["host_us"] / case["this"]["host_us"]
            # Each round's two children ran one after the other: their ratio cancels the box's
            # drift between rounds.
            case["paired_ratio_median"] = statistics.median(
                b / t for b, t in zip(case["baseline"]["rounds_us"], case["this"]["rounds_us"]))
        cases.append(case)
    return cases


def write(args, trees: dict[str, str], cases: list[dict], rounds_done: int) -> None:
    write_results(args.json, "triton_host", {
        "rounds": args.rounds, "rounds_done": rounds_done, "calls": args.calls, "device": args.device,
        "baseline_tree": trees.get("baseline"),
        "baseline_commit": commit_info(trees["baseline"]) if trees.get("baseline") else None,
        "method": ("host µs a call (median of each child's calls, then median over the rounds), Triton's "
                   "interpreter selected and every launch replaced by a counter: Triton's own launch call excluded"
                   if args.device == "cpu" else
                   "µs a call on the GPU: each case's calls back to back, the device synchronized once before and "
                   "once after (a small call's pace is its host work, Triton's launches included), the median "
                   "over the rounds"),
        "cases": cases})


if __name__ == "__main__":
    from bridge.bench import exit_on_stop_signals

    exit_on_stop_signals()
    sys.exit(main())
