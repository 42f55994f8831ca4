"""`python -m bridge`: serve the scan over stdio (BEAM Port mode) until stdin closes,
SIGTERM, or a `shutdown` request."""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
import time

# Drain budget after EOF/SIGTERM: in-flight requests get this long to be answered so that the
# process is gone within 1 s.
DRAIN_SECONDS = 0.8


def build_parser() -> argparse.ArgumentParser:
    import protocol

    p = argparse.ArgumentParser(prog="python -m bridge", description=__doc__)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where tensors live and kernels run (auto: CUDA when available)")
    p.add_argument("--backend", default=None,
                   help="kernels backend by name (reference, torch, cpu, triton); default: the best for the device")
    p.add_argument("--max-frame-size", type=int, default=protocol.DEFAULT_MAX_FRAME_SIZE,
                   help="largest request frame in bytes; bigger frames are drained and answered with frame_too_large")
    p.add_argument("--max-pending", type=int, default=4096,
                   help="requests in flight before new ones are answered with overloaded")
    p.add_argument("--log-level", default=os.environ.get("SCAN_BRIDGE_LOG", "INFO"))
    return p


def tune_malloc() -> None:
    """Keep large freed blocks in the heap instead of returning them to the OS, so the next
    request's multi-MB buffers reuse mapped pages instead of page-faulting (~2.5 µs per 4 KiB
    page, DESIGN §3). glibc only; a no-op elsewhere."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    libc.mallopt(M_MMAP_THRESHOLD, 32 * 1024 * 1024)  # glibc's maximum on 64-bit
    libc.mallopt(M_TRIM_THRESHOLD, 1024 * 1024 * 1024)


def main(argv=None, protocol_fd: int | None = None) -> int:
    if protocol_fd is None:
        from .stdio_guard import claim_protocol_stdout

        protocol_fd = claim_protocol_stdout()
    args = build_parser().parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=args.log_level.upper(),
                        format="%(asctime)s scan-bridge[%(process)d] %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("bridge")
    tune_malloc()

    from .device import DeviceUnavailable, choose_device
    from .dispatcher import Dispatcher
    from .ops import HANDLERS, LEGACY_HANDLERS
    from .server import Server, ServerConfig
    from .stdio_guard import enlarge_pipe
    from .transports.stdio import StdioTransport

    try:
        device = choose_device(args.device)
    except DeviceUnavailable as exc:
        log.error("%s", exc)
        return 2
    config = ServerConfig(device=args.device, backend=args.backend,
                          max_frame_size=args.max_frame_size, max_pending=args.max_pending)
    try:
        server = Server(config, device)
    except Exception as exc:  # e.g. --backend naming an unavailable backend
        log.error("cannot start: %s", exc)
        return 2
    dispatcher = Dispatcher(server, HANDLERS, LEGACY_HANDLERS, max_pending=config.max_pending)

    sizes = [enlarge_pipe(0), enlarge_pipe(protocol_fd)]
    transport = StdioTransport(dispatcher, 0, protocol_fd, config.max_frame_size)
    server.transports.append("stdio")

    def request_stop(signum, frame):
        server.stop_requested.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)

    dispatcher.start()
    transport.start()
    log.info("serving stdio on %s (%s), backend %s, pipe sizes %s", device.device, device.reason,
             server.backend, sizes)
    while not (server.stop_requested.is_set() or transport.eof.is_set()):
        server.stop_requested.wait(0.05)
    why = "stdin closed" if transport.eof.is_set() else "stop requested"
    started = time.monotonic()
    drained = dispatcher.drain(DRAIN_SECONDS)
    log.info("%s; %s in %.0f ms; exiting", why,
             "all requests answered" if drained else "gave up waiting for requests in flight",
             (time.monotonic() - started) * 1000)
    logging.shutdown()
    sys.stderr.flush()
    # os._exit: interpreter teardown (torch, thread joins) can take longer than the 1 s budget,
    # and every reply has been written synchronously by now.
    os._exit(0)
