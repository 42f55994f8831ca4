"""A model's step with fp32 weights against the same model in bf16, both served by one server.

The ExPhil-sized models of bench.models (4 layers, d_model 256), loaded twice into one server
over the Port, once in f32 and once in bf16 (`model_load {config, weights, dtype}`), each with a
session prefilled from the same window. Every frame steps both sessions with the same embeddings,
half a frame apart, the order swapped each frame, paced 1/60 s (`paced`) and then back to back
(`back_to_back`). A paced step's time is mostly its weights coming back from memory
(docs/performance.md, "model step"); bf16 halves those bytes.

In this process too, without IPC (`in_process`, a frame's sleep before each step, alternated in
rounds as bench.model_step_ab alternates two builds): both models' fused steps, and the bf16
model's step composed of torch ops and `scan_kernels` calls (`fused=False`), the path every bf16
model took before the fused step read bf16 weights.

Outputs are compared as well: each bf16 step's hidden state against the f32 one's (the error
bf16 weights cost).

    python -m bench.model_dtype_ab [--frames 300] [--batches 1,32] [--archs mamba,mamba2]
                                   [--json bench/results/model_dtype_ab.json]
"""

from __future__ import annotations

import time

import torch

from bridge.bench.floors import BridgeProcess, encode_request, exchange
from bridge.bench.machine import summarize_us
from bridge.models import load_weights
from bridge.tensors import host_view

from .model_step_ab import time_pair
from .models import D_MODEL, WARMUP, WINDOW, case_main, exphil_model, wait_for_frame

DTYPES = ("f32", "bf16")


def over_the_port(config: dict, weights: dict, frames: list[torch.Tensor], batch: int) -> dict:
    bridge = BridgeProcess([])
    lane = bridge.lane
    try:
        sessions = {}
        for dtype in DTYPES:
            model = bridge.call("model_load", config=config, weights=weights, dtype=dtype)["model"]
            sessions[dtype] = bridge.call("session_open", model=model, batch=batch)["session"]
            bridge.call("model_forward", session=sessions[dtype], embeds=torch.stack(frames[:WINDOW], dim=1),
                        output="hidden")
        steps = {dtype: [lane.frame(encode_request(i, "model_step", {"session": s, "embeds": f, "output": "hidden"}))
                         for i, f in enumerate(frames[WINDOW:])] for dtype, s in sessions.items()}
        result, worst = {}, 0.0
        for pacing in ("paced", "back_to_back"):
            times = {dtype: [] for dtype in DTYPES}
            start = time.perf_counter()
            for i in range(len(frames) - WINDOW):
                order = DTYPES if i % 2 == 0 else DTYPES[::-1]
                hidden = {}
                for k, dtype in enumerate(order):
                    if pacing == "paced":
                        wait_for_frame(start, i + k / 2)
                    us, reply = exchange(lane, steps[dtype][i])
                    times[dtype].append(us)
                    hidden[dtype] = host_view(reply.result["hidden"]).clone()  # the reply's bytes are the lane's buffer
                if pacing == "paced":
                    f32, bf16 = hidden["f32"], hidden["bf16"]
                    worst = max(worst, float((bf16 - f32).abs().max() / f32.abs().max()))
            result[pacing] = {dtype: summarize_us(t[WARMUP:]) for dtype, t in times.items()}
            result[pacing]["ratio_p50"] = result[pacing]["f32"]["p50_us"] / result[pacing]["bf16"]["p50_us"]
        result["bf16_max_relative_difference"] = worst
        return result
    finally:
        bridge.close()


# In this process: (model dtype, fused).
IN_PROCESS = {"f32_fused": (torch.float32, True), "bf16_fused": (torch.bfloat16, True),
              "bf16_composed": (torch.bfloat16, False)}


def in_process(config: dict, weights: dict, frames: list[torch.Tensor], batch: int) -> dict:
    """The fp32 and bf16 models' fused steps and the bf16 model's composed one, each over a state
    of its own, paced and alternated as bench.model_step_ab alternates two builds."""
    models = {dtype: load_weights(config, weights, dtype, torch.device("cpu"), lambda n: None)
              for dtype in (torch.float32, torch.bfloat16)}
    slots = torch.arange(batch)

    def step_call(dtype, fused):
        parts = {name: torch.zeros((batch, *shape)) for name, shape in models[dtype].config.state_parts()}

        def call(frame):
            with torch.no_grad():
                return models[dtype].step(parts, slots, frame, output="hidden", backend="cpu", fused=fused)

        return call

    calls = [step_call(*how) for how in IN_PROCESS.values()]
    for call in calls:
        for frame in frames[:WARMUP]:
            call(frame)
    times = time_pair(calls, frames[WARMUP:], paced=True)
    result = {how: summarize_us(t) for how, t in zip(IN_PROCESS, times)}
    fused = result["bf16_fused"]["p50_us"]
    result["ratios_p50"] = {"f32_fused_over_bf16_fused": result["f32_fused"]["p50_us"] / fused,
                            "bf16_composed_over_bf16_fused": result["bf16_composed"]["p50_us"] / fused}
    return result


def run_case(arch: str, batch: int, frames_n: int) -> dict:
    _, config, weights = exphil_model(arch, seed=batch)
    g = torch.Generator().manual_seed(7)
    frames = [torch.randn(batch, D_MODEL, generator=g) for _ in range(frames_n + WINDOW)]
    fp32_bytes = sum(t.nbytes for t in weights.values())
    return {"arch": arch, "batch": batch, "frames": frames_n, "fp32_weight_bytes": fp32_bytes,
            "over_the_port": over_the_port(config, weights, frames, batch),
            "in_process": in_process(config, weights, frames[WINDOW:], batch)}


def report(case: dict) -> None:
    port, local = case["over_the_port"], case["in_process"]
    print(f"{case['arch']} batch {case['batch']} ({case['fp32_weight_bytes'] / 1e6:.1f} MB of fp32 weights)")
    for pacing in ("paced", "back_to_back"):
        p = port[pacing]
        print(f"  {pacing:13s} f32 p50 {p['f32']['p50_us']:8.0f} us  bf16 p50 {p['bf16']['p50_us']:8.0f} us  "
              f"f32/bf16 {p['ratio_p50']:.2f}x   p99 {p['f32']['p99_us']:.0f} / {p['bf16']['p99_us']:.0f} us")
    print(f"  in process, paced: f32 fused {local['f32_fused']['p50_us']:.0f} us, bf16 fused "
          f"{local['bf16_fused']['p50_us']:.0f} us, bf16 composed {local['bf16_composed']['p50_us']:.0f} us "
          f"(f32/bf16 {local['ratios_p50']['f32_fused_over_bf16_fused']:.2f}x, composed/fused "
          f"{local['ratios_p50']['bf16_composed_over_bf16_fused']:.2f}x)")
    print(f"  bf16 against f32 hidden: max relative difference {port['bf16_max_relative_difference']:.2e}")


def main(argv=None) -> int:
    return case_main("python -m bench.model_dtype_ab", __doc__, "model_dtype_ab", run_case, report, argv)


if __name__ == "__main__":
    from bridge.bench import exit_on_stop_signals

    exit_on_stop_signals()
    raise SystemExit(main())
