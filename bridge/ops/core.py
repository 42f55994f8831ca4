"""ping, health, info, cancel, stats, shutdown."""

from __future__ import annotations

import logging
import os
import platform
import sys

import torch

import scan_kernels
import protocol

from .. import __version__
from ..dispatcher import Background
from ..server import LIMITS

log = logging.getLogger("bridge")


def ping(server, call) -> dict:
    return {"pong": True}


def health(server, call) -> dict:
    """Live (it answers); ready when its device answered a kernel launch lately (the server's
    work or a tiny probe) and it is not stopping (bridge.health)."""
    # Served at once, it runs beside the server's kernels: it must not launch the probe there.
    kernel = server.probe.check(launch=not call.immediate)
    accepting = not server.stop_requested.is_set()
    return {"live": True, "ready": kernel["ok"] and accepting, "device": str(server.device),
            "checks": {"kernel": kernel, "accepting": accepting}}


def info(server, call) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    devices = [{"type": "cpu", "threads": torch.get_num_threads(), "cores": os.cpu_count()}]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            devices.append({"type": "cuda", "index": i, "name": props.name,
                            "memory_bytes": props.total_memory})
    return {
        "server": "scan-bridge",
        "versions": {
            "bridge": __version__,
            "python": platform.python_version(),
            "torch": str(torch.__version__),
            "triton": triton_version,
            "cuda": torch.version.cuda,
        },
        "protocol": {"version": protocol.PROTOCOL_VERSION, "ops": sorted(protocol.OPS)},
        "device": server.device_choice.describe(),
        "backend": server.backend,
        "native_step": server.fast_path is not None,
        "cuda_graphs": None if server.step_graphs is None else {
            "captured": server.step_graphs.captured, "model_steps_captured": server.model_step_graphs.captured},
        "devices": devices,
        "kernels": {
            "available": scan_kernels.available_backends(),
            "unavailable": scan_kernels.unavailable_backends(),
            "details": scan_kernels.backend_details(),
            "compiled": list(server.compiled),
        },
        "transports": list(server.transports),
        "metrics": server.metrics_endpoint,
        "limits": {name: getattr(server.config, name) for name in LIMITS},
        "pid": os.getpid(),
        "platform": sys.platform,
    }


def cancel(server, call) -> dict:
    return {"cancelled": server.queued.cancel(call.conn.id, call.args["id"], call.request.reply_id)}


# Served as it arrives, on the thread that read it: queued, it would wait behind what it cancels.
cancel.immediate = True
# Served so while the device's answer is recent (no probe launch, which must not run beside the
# server's kernels): queued, a busy server would answer its health check late.
health.immediate = lambda server: server.probe.fresh()
# And otherwise queued for the probe, but never refused for --max-pending(-bytes): a server busy
# with long requests answers its health check once they are done (SPEC §6), not `overloaded`.
health.past_caps = True


def stats(server, call) -> dict:
    return server.stats.snapshot()


def shutdown(server, call) -> Background:
    # Any client may send it: the log says which connection did.
    log.info("%s asked the server to stop (shutdown)", call.conn.id)

    def stop() -> dict:
        # From here on requests are refused shutting_down (the dispatcher's admission reads it);
        # the main loop drains what is in flight, this reply among it, and exits.
        server.stop_requested.set()
        return {"stopping": True}

    # Finished by the loader thread after the model loads handed to it before: run beside one
    # still reading, the stop's drain would cut that load off unanswered.
    return Background(stop)


# It acts for the server, not for its connection: run even once that peer is gone (a client may
# send it and close without waiting for the answer), where other requests are dropped unrun.
shutdown.runs_for_a_gone_peer = True


HANDLERS = {"ping": ping, "health": health, "info": info, "cancel": cancel, "stats": stats,
            "shutdown": shutdown}
