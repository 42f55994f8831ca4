"""A model's step over the Port through the native step path against the general path.

The ExPhil-sized models of bench.models (4 layers, d_model 256), sent by the client, served by
two servers at once: one as it starts by default (a `model_step` of embeddings to hidden states
is served from its frame to its reply in C++, bridge/native) and one with `--no-native-step`
(decoded, batched and encoded in Python around the same fused kernel). Each session is prefilled
from the same window; every frame then steps both with the same embeddings, a third of a frame
apart, the order swapped each frame, and a C pipe echo answers the same bytes with a reply of the
same size in the last third (what moving the bytes alone costs), paced 1/60 s (`paced`), then
all three back to back (`back_to_back`). The archs "mamba-lm" and "mamba2-lm" are the same
backbones as causal LMs (bench.models.LM_VOCAB tokens, the head tied to the embeddings), stepped
from token ids (int64 [batch]) to logits. Both servers' outputs must agree to fp32's
error: their steps are the same kernel (tests/test_native_step.py holds them to bit equality in
one process), but each process's prefill runs torch's matrix products, whose last bits may
differ between two processes on a loaded machine.

    python -m bench.model_native_ab [--frames 300] [--batches 1,32]
                                    [--archs mamba,mamba2 | mamba-lm,mamba2-lm]
                                    [--json bench/results/model_native_ab.json]
"""

from __future__ import annotations

import time

import torch

from bridge.bench.floors import BridgeProcess, EchoUnavailable, encode_request, exchange, open_floor
from bridge.bench.machine import summarize_us
from bridge.tensors import host_view

from .models import ARCHS, D_MODEL, LM_VOCAB, WARMUP, WINDOW, case_main, exphil_model, wait_for_frame

MODES = {"native": [], "general": ["--no-native-step"]}
MAX_RELATIVE_DIFFERENCE = 1e-4


LM_SUFFIX = "-lm"


def run_case(arch: str, batch: int, frames_n: int) -> dict:
    lm = arch.endswith(LM_SUFFIX)
    _, config, weights = exphil_model(arch.removesuffix(LM_SUFFIX), seed=batch, lm=lm)
    g = torch.Generator().manual_seed(7)
    if lm:
        given, output = "tokens", "logits"
        frames = [torch.randint(LM_VOCAB, (batch,), generator=g) for _ in range(frames_n + WINDOW)]
    else:
        given, output = "embeds", "hidden"
        frames = [torch.randn(batch, D_MODEL, generator=g) for _ in range(frames_n + WINDOW)]
    bridges = {mode: BridgeProcess(args) for mode, args in MODES.items()}
    echo = None
    try:
        steps = {}
        for mode, bridge in bridges.items():
            model = bridge.call("model_load", config=config, weights=weights)["model"]
            session = bridge.call("session_open", model=model, batch=batch)["session"]
            bridge.call("model_forward", session=session, output=output, **{given: torch.stack(frames[:WINDOW], dim=1)})
            steps[mode] = [bridge.lane.frame(encode_request(i, "model_step",
                                                            {"session": session, given: f, "output": output}))
                           for i, f in enumerate(frames[WINDOW:])]
        result = {"arch": arch, "batch": batch, "frames": frames_n, "input": given, "output": output}
        for mode, bridge in bridges.items():  # both states advance alike; the reply sizes the echo's
            exchange(bridge.lane, steps[mode][0])
        try:
            echo = open_floor("stdio", bridges["native"].lane.reply_sizes())
        except EchoUnavailable as exc:
            result["echo_skipped"] = str(exc)
        served_natively, worst = True, 0.0
        for pacing in ("paced", "back_to_back"):
            times = {mode: {"round_trip": [], "server": [], "kernel": []} for mode in MODES}
            echo_us = []
            start = time.perf_counter()
            for i in range(frames_n):
                order = list(MODES) if i % 2 == 0 else list(MODES)[::-1]
                outputs = {}
                for k, mode in enumerate(order):
                    if pacing == "paced":
                        wait_for_frame(start, i + k / 3)
                    us, reply = exchange(bridges[mode].lane, steps[mode][i])
                    if not reply.ok:
                        raise RuntimeError(f"{mode} model_step failed: {reply.error}")
                    t = times[mode]
                    t["round_trip"].append(us)
                    t["server"].append(reply.timing["server_us"])
                    t["kernel"].append(reply.timing["kernel_us"])
                    if mode == "native":
                        served_natively &= reply.timing["h2d_us"] == reply.timing["d2h_us"] == 0
                    outputs[mode] = host_view(reply.result[output]).clone()  # the reply's bytes are the lane's buffer
                scale = float(outputs["general"].abs().max())
                worst = max(worst, float((outputs["native"] - outputs["general"]).abs().max()) / scale)
                if worst > MAX_RELATIVE_DIFFERENCE:
                    raise RuntimeError(f"frame {i}: the two servers' {output} differ by {worst:.2e} of the "
                                       f"largest, more than {MAX_RELATIVE_DIFFERENCE}")
                if echo is not None:
                    if pacing == "paced":
                        wait_for_frame(start, i + 2 / 3)
                    echo_us.append(echo.round_trip_us(steps["native"][i]))
            out = {mode: {part: summarize_us(v[WARMUP:]) for part, v in t.items()} for mode, t in times.items()}
            native, general = (out[m]["round_trip"]["p50_us"] for m in ("native", "general"))
            out["general_over_native_p50"] = general / native
            out["general_over_native_p99"] = out["general"]["round_trip"]["p99_us"] / out["native"]["round_trip"]["p99_us"]
            if echo_us:
                out["echo"] = summarize_us(echo_us[WARMUP:])
                out["native_over_echo_p50"] = native / out["echo"]["p50_us"]
            result[pacing] = out
        if not served_natively:
            raise RuntimeError("the default server did not serve every model step natively")
        result["max_relative_difference"] = worst
        return result
    finally:
        if echo is not None:
            echo.close()
        for bridge in bridges.values():
            bridge.close()


def report(case: dict) -> None:
    print(f"{case['arch']} batch {case['batch']} ({case['input']} -> {case['output']}):")
    for pacing in ("paced", "back_to_back"):
        r = case[pacing]
        line = f"  {pacing:13s}"
        for mode in MODES:
            t = r[mode]
            line += (f"  {mode} p50 {t['round_trip']['p50_us']:7.0f} us (server {t['server']['p50_us']:.0f}, "
                     f"kernel {t['kernel']['p50_us']:.0f}, p99 {t['round_trip']['p99_us']:.0f})")
        line += f"  general/native {r['general_over_native_p50']:.2f}x"
        if "echo" in r:
            line += f"  echo p50 {r['echo']['p50_us']:.0f} us (native/echo {r['native_over_echo_p50']:.1f}x)"
        print(line)


def main(argv=None) -> int:
    return case_main("python -m bench.model_native_ab", __doc__, "model_native_ab", run_case, report, argv,
                     archs=(*ARCHS, *(arch + LM_SUFFIX for arch in ARCHS)))


if __name__ == "__main__":
    from bridge.bench import exit_on_stop_signals

    exit_on_stop_signals()
    raise SystemExit(main())
