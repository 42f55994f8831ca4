"""`python -m bridge`: serve the scan over stdio (BEAM Port mode) until stdin closes, a stop
signal (SIGTERM, SIGINT, SIGHUP) or a `shutdown` request; or over unix sockets and ZeroMQ
(--unix, --zmq; with --stdio as well) until a stop signal or `shutdown`."""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import logging
import os
import signal
import sys
import time

from . import exit_guard
from .stop_signals import record_stop_signals

# Drain budget after EOF/SIGTERM: in-flight requests get this long to be answered; replies
# still on their way then get transports.base.FLUSH_SECONDS more, one deadline for every lane.
DRAIN_SECONDS = 0.8
# How often the main thread looks for a stop condition (signal, EOF, shutdown op).
STOP_POLL_SECONDS = 0.02


def build_parser() -> argparse.ArgumentParser:
    # The defaults live in ServerConfig; importing it loads torch, which main() loads right
    # after parsing anyway.
    import scan_kernels
    from protocol.schema import LAYOUTS

    from .server import ServerConfig

    defaults = ServerConfig()
    p = argparse.ArgumentParser(prog="python -m bridge", description=__doc__)
    p.add_argument("--device", default=defaults.device, type=device_request, metavar="{auto,cpu,cuda,cuda:N}",
                   help="where tensors live and kernels run (auto: CUDA when available; cuda:N: GPU N as torch "
                        "numbers them, for one server per GPU on a host)")
    p.add_argument("--backend", default=defaults.backend,
                   help="kernels backend by name (reference, torch, cpu, triton); default: the best for the device")
    p.add_argument("--max-frame-size", type=_positive, default=defaults.max_frame_size,
                   help="largest request in bytes; a bigger stream frame, or ZeroMQ message in several frames, is "
                        "drained and answered with frame_too_large; ZeroMQ drops a peer that sends a single "
                        "frame bigger than this (default: %(default)s)")
    p.add_argument("--log-level", type=_log_level, default=os.environ.get("SCAN_BRIDGE_LOG", "INFO"),
                   help="the log's threshold: " + ", ".join(LOG_LEVELS) + " (default: $SCAN_BRIDGE_LOG, else INFO)")
    p.add_argument("--warmup", action="append", default=[], type=warmup_shape, metavar="BxLxDxN[:OPTS]",
                   help="compile the Triton kernels for this shape bucket before serving (repeatable; the "
                        "other backends have nothing to compile); five dims, BxLxHxPxN, name a Mamba-2 "
                        "bucket of H heads of P channels; OPTS "
                        "is a comma list of the options requests will use: " + ",".join(scan_kernels.WARMUP_OPTIONS) +
                        ", and groups=G, layout=" + "|".join(LAYOUTS) + ", dtype=" + "|".join(warmup_dtypes()) +
                        " (default 1, bld, f32: each is a kernel of its own); `info` lists what was compiled")
    p.add_argument("--max-pending", type=_positive, default=defaults.max_pending,
                   help="requests in flight before new ones are answered with overloaded (default: %(default)s)")
    p.add_argument("--max-pending-bytes", type=_positive, default=defaults.max_pending_bytes,
                   help="bytes of requests in flight (their frames) over all connections before new ones are "
                        "answered with overloaded; a request with nothing else in flight is taken whatever its "
                        "size (default: %(default)s)")
    p.add_argument("--max-delay-us", type=_delay_us, default=defaults.max_delay_us,
                   help="how long a batch of step/scan requests may wait for more after its first "
                        "arrived, in microseconds; it waits only for as many as recently came together "
                        "(0: never wait; what is already queued is still batched; default %(default)s)")
    p.add_argument("--max-batch", type=_positive, default=defaults.max_batch,
                   help="most rows one batched kernel launch takes (1: no batching; default %(default)s)")
    p.add_argument("--max-sessions", type=_count, default=defaults.max_sessions,
                   help="sessions open at once, over all connections (default: %(default)s)")
    p.add_argument("--max-pool-bytes", type=_count, default=defaults.max_pool_bytes,
                   help="device bytes of session state pools, snapshots and loaded models' weights "
                        "(default: %(default)s)")
    p.add_argument("--max-snapshots", type=_count, default=defaults.max_snapshots,
                   help="session snapshots held at once, over all connections (default: %(default)s)")
    p.add_argument("--max-models", type=_count, default=defaults.max_models,
                   help="models loaded at once, over all connections (default: %(default)s)")
    p.add_argument("--model-dir", dest="model_dirs", action="append", type=_directory, default=[],
                   help="a directory model_load may read checkpoints under (repeatable; relative paths in "
                        "requests are taken under the first); without one, model_load reads no files and "
                        "takes only a config and weights sent in the request")
    p.add_argument("--metrics-port", type=_port, default=defaults.metrics_port,
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (0: a free port, which info and the "
                        "log name); off by default")
    p.add_argument("--metrics-host", default=defaults.metrics_host,
                   help="the address the metrics endpoint binds (default 127.0.0.1: this machine only)")
    p.add_argument("--max-handles", type=_count, default=defaults.max_handles,
                   help="tensor handles held at once, over all connections (default: %(default)s)")
    p.add_argument("--max-handle-bytes", type=_count, default=defaults.max_handle_bytes,
                   help="device bytes of tensors held as handles (default: %(default)s)")
    p.add_argument("--threads", type=_threads, default=defaults.threads,
                   help="CPU threads one kernel call may use (default: torch's, the machine's cores); fewer "
                        "leaves cores to clients on the same machine, which can cut their tail latency")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="on CUDA, launch every step and model step through the kernels API and torch instead "
                        "of replaying a captured state update or model step (a CUDA graph) for steps shaped "
                        "like ones seen before")
    p.add_argument("--no-exit-guard", dest="exit_guard", action="store_false",
                   help="run without the exit guard (bridge.exit_guard), a process sharing the server's memory "
                        "so that a killed server's pipes and sockets close before its memory is freed")
    p.add_argument("--no-native-step", dest="native_step", action="store_false",
                   help="serve every step through the general (Python) path, never the native C++ one "
                        "(bridge.native), which by default serves each plain step that finds nothing but native steps in flight, "
                        "unbatched; with this flag concurrent steps are batched")

    # Transports, any combination, one dispatcher. Without --zmq/--unix the server speaks stdio;
    # with them it does not read stdin (unless --stdio) and runs until SIGTERM or `shutdown`.
    p.add_argument("--stdio", action="store_true",
                   help="serve stdio (the BEAM Port lane) beside --zmq/--unix, and stop when stdin closes, "
                        "as a Port server does; the default when neither is given")
    p.add_argument("--zmq", action="append", default=[], metavar="ENDPOINT",
                   help="serve a ZeroMQ ROUTER socket on ENDPOINT: ipc://PATH or tcp://HOST:PORT "
                        "(HOST may be left out: 127.0.0.1; name * or an address to listen beyond loopback, "
                        "an IPv6 one in brackets; PORT * picks a free one); repeatable")
    p.add_argument("--unix", action="append", default=[], metavar="PATH", type=_socket_path,
                   help="serve the stdio framing on a unix socket at PATH, many connections; repeatable")
    p.add_argument("--curve-secret-key", metavar="FILE",
                   help="encrypt the tcp ZeroMQ endpoints with CURVE, using this server certificate "
                        "(a .key_secret file as written by zmq.auth.create_certificates)")
    p.add_argument("--curve-clients", metavar="DIR",
                   help="with --curve-secret-key: only clients whose public certificate is in DIR may connect "
                        "(without it, any client that knows the server's public key may)")
    p.add_argument("--max-in-flight-per-peer", type=_positive, default=defaults.max_in_flight_per_peer,
                   help="requests one unix connection or ZeroMQ peer may have in flight; its later requests "
                        "wait (in its socket buffer, or in its queue on ZeroMQ; default %(default)s)")
    p.add_argument("--zmq-hwm", type=_hwm, default=1000,
                   help="ZeroMQ high-water mark: messages queued per peer each way, and requests a peer may "
                        "have waiting beyond its in-flight cap before it is answered overloaded (default 1000)")
    p.add_argument("--idle-timeout-s", type=positive_seconds, default=defaults.idle_timeout_s, metavar="SECONDS",
                   help="free what a ZeroMQ peer owns (sessions, handles, models, snapshots) once, with nothing "
                        "in flight, it has neither sent a request nor been answered one for SECONDS: a peer whose "
                        "end is never seen counts as gone (default: never)")
    p.add_argument("--stall-timeout-s", type=_seconds_or_never, default=defaults.stall_timeout_s,
                   metavar="SECONDS|never",
                   help="end the input of a unix connection that sent part of a frame and then nothing for "
                        "SECONDS: that frame is dropped, the requests before it are answered, and the "
                        "connection closes (default: %(default)s)")
    p.add_argument("--max-connections", type=_positive, default=defaults.max_connections,
                   help="unix connections served at once; another is answered overloaded and closed "
                        "(default: %(default)s)")
    p.add_argument("--max-zmq-peers", type=_positive, default=defaults.max_zmq_peers,
                   help="ZeroMQ peers (routes) held at once, with requests in flight, waiting or unsent, or "
                        "owning something; a request from another is answered overloaded (default: %(default)s)")
    return p


def device_request(text: str) -> str:
    """A --device value as given, once bridge.device can tell which device it names."""
    from .device import parse_device

    try:
        parse_device(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _socket_path(text: str) -> str:
    # An empty one (an unset variable in a unit file) would bind an unnamed abstract socket
    # nobody can connect to.
    if not text:
        raise argparse.ArgumentTypeError("expected a socket path, got an empty one")
    return text


def _directory(text: str) -> str:
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"expected an existing directory, got {text!r}")
    return text


# The largest count: `info` and `stats` report every limit as a msgpack uint, and one past it
# would make both fail for the server's whole life.
MAX_COUNT = 2**64 - 1


def _whole(text: str, least: int = 0) -> int:
    """`text` as an int of at least `least`; refused naming that bound (a flag's own, so that
    the message never suggests a value the flag refuses too)."""
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise argparse.ArgumentTypeError(f"expected an int >= {least}, got {text!r}")
    return value


def _count(text: str, least: int = 0) -> int:
    value = _whole(text, least)
    if value > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"expected an int <= 2**64-1 (what info and stats report a limit as), "
                                         f"got {text!r}")
    return value


def _port(text: str) -> int:
    value = _whole(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535, got {text!r}")
    return value


def _positive(text: str) -> int:
    return _count(text, least=1)


# libzmq takes its high-water marks as a C int.
MAX_ZMQ_HWM = 2**31 - 1


def _hwm(text: str) -> int:
    if _whole(text, least=1) > MAX_ZMQ_HWM:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_ZMQ_HWM} messages (libzmq's int), got {text!r}")
    return _positive(text)


# A minute: a batch held longer outlasts any caller's patience, and a wait past the timeout
# threading takes raised in the gatherer, leaving that batch unanswered.
MAX_DELAY_US = 60_000_000


def _delay_us(text: str) -> int:
    value = _count(text)
    if value > MAX_DELAY_US:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_DELAY_US} µs (a minute), got {text!r}")
    return value


# More than any machine this serves on has cores; torch takes a C int.
MAX_THREADS = 4096


def _threads(text: str) -> int:
    if _whole(text, least=1) > MAX_THREADS:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_THREADS} threads, got {text!r}")
    return _positive(text)


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _log_level(text: str) -> str:
    """A logging level's name, any case (from --log-level or $SCAN_BRIDGE_LOG)."""
    if text.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(LOG_LEVELS)} (--log-level or "
                                         f"$SCAN_BRIDGE_LOG), got {text!r}")
    return text.upper()


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (0 < value < float("inf")):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def _seconds_or_never(text: str) -> float | None:
    if text == "never":
        return None
    try:
        return positive_seconds(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0 or never, got {text!r}") from None


def open_lanes(args, dispatcher) -> list:
    """The unix and ZeroMQ transports the arguments name, bound and ready to start."""
    from .transports.base import SocketPathTaken
    from .transports.unix import UnixTransport

    if args.curve_clients and not args.curve_secret_key:
        raise ValueError("--curve-clients: expected --curve-secret-key too (the server's own keys)")
    if args.curve_secret_key and not any(e.startswith("tcp://") for e in args.zmq):
        raise ValueError("--curve-secret-key: CURVE secures tcp endpoints, and no --zmq tcp:// is given")
    lanes = []
    try:
        for path in args.unix:
            try:
                lanes.append(UnixTransport(dispatcher, path, max_frame_size=args.max_frame_size,
                                           max_in_flight=args.max_in_flight_per_peer,
                                           max_connections=args.max_connections,
                                           stall_timeout_s=args.stall_timeout_s))
            except SocketPathTaken:
                raise  # named already
            except OSError as exc:  # a path too long, in no directory, not ours to bind
                raise OSError(f"--unix {path}: {exc.strerror or exc}") from exc
        if args.zmq:
            from .transports.zmq import CurveKeys, ZmqTransport

            curve = CurveKeys.load(args.curve_secret_key, args.curve_clients) if args.curve_secret_key else None
            lanes.append(ZmqTransport(dispatcher, args.zmq, max_frame_size=args.max_frame_size,
                                      max_in_flight=args.max_in_flight_per_peer, hwm=args.zmq_hwm,
                                      curve=curve, idle_timeout_s=args.idle_timeout_s,
                                      max_peers=args.max_zmq_peers))
    except Exception:
        for lane in lanes:
            lane.close()
        raise
    return lanes


def warmup_dtypes() -> dict:
    """The dtypes a warmup bucket may name, by wire code: the floating ones (SPEC §5), which the
    kernels take."""
    from scan_kernels import FLOAT_DTYPES

    from .tensors import WIRE_DTYPES

    return {WIRE_DTYPES[dtype]: dtype for dtype in FLOAT_DTYPES}


def warmup_shape(text: str) -> dict:
    """`32x60x512x16:D,z,dtype=bf16` → the shape dict `scan_kernels.warmup` takes; five dims,
    `32x60x8x64x16`, name a Mamba-2 bucket (heads 8, headdim 64)."""
    from scan_kernels import WARMUP_OPTIONS
    from protocol.schema import LAYOUTS

    dtypes = warmup_dtypes()

    dims, _, opts = text.partition(":")
    try:
        values = [int(v) for v in dims.lower().split("x")]
        if len(values) not in (4, 5) or min(values) < 1:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError("expected BATCHxSEQxDIMxSTATE or, for Mamba-2, "
                                         f"BATCHxSEQxHEADSxHEADDIMxSTATE[:OPTIONS], each a positive int, "
                                         f"got {text!r}") from None
    if len(values) == 5:
        batch, seq, heads, headdim, state = values
        shape = {"batch": batch, "seq": seq, "dim": heads, "headdim": headdim, "state": state}
    else:
        batch, seq, dim, state = values
        shape = {"batch": batch, "seq": seq, "dim": dim, "state": state}
    for opt in filter(None, opts.split(",")):
        name, is_setting, value = opt.partition("=")
        if not is_setting and name in WARMUP_OPTIONS:
            shape[name] = True
        elif name == "groups" and value.isdigit() and int(value) > 0:
            shape["groups"] = int(value)
        elif name == "layout" and value in LAYOUTS:
            shape["layout"] = value
        elif name == "dtype" and value in dtypes:
            shape["dtype"] = dtypes[value]
        else:
            raise argparse.ArgumentTypeError(
                f"warmup option: expected one of {', '.join(WARMUP_OPTIONS)}, groups=<a positive int>, "
                f"layout={'|'.join(LAYOUTS)} or dtype={'|'.join(dtypes)}, got {opt!r}")
    return shape


def tune_malloc() -> None:
    """Keep large freed blocks in the heap instead of returning them to the OS, so the next
    request's multi-MB buffers reuse mapped pages instead of page-faulting on every one of
    their pages again. glibc only; a no-op elsewhere."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    libc.mallopt(M_MMAP_THRESHOLD, 32 * 1024 * 1024)  # glibc's maximum on 64-bit
    libc.mallopt(M_TRIM_THRESHOLD, 1024 * 1024 * 1024)


# Descriptors the server holds beside its connections: its lanes, pipes, the exit guard's, the
# checkpoint files a load opens, the metrics endpoint's.
OWN_DESCRIPTORS = 64


def raise_descriptor_limit(args) -> int:
    """The soft limit on open descriptors raised to the hard one (returned): each unix
    connection and ZeroMQ peer holds one, and where none is left libzmq aborts the process on
    an ipc:// listener and spins accepting on a tcp:// one. Where even the hard limit is below
    what the connection caps allow, a warning says so."""
    import resource

    log = logging.getLogger("bridge")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    highest = hard
    if hard == resource.RLIM_INFINITY:  # the kernel's own bound, fs.nr_open, still applies
        try:
            with open("/proc/sys/fs/nr_open") as nr_open:
                highest = int(nr_open.read())
        except (OSError, ValueError):
            highest = max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < highest:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (highest, hard))
            soft = highest
        except (ValueError, OSError) as exc:
            log.info("open-files limit left at %d: %s", soft, exc)
    allowed = args.max_connections * len(args.unix) + (args.max_zmq_peers if args.zmq else 0)  # a cap each lane
    if allowed and soft != resource.RLIM_INFINITY and allowed + OWN_DESCRIPTORS > soft:
        log.warning("the open-files limit (%d) is below what --max-connections (each --unix) and "
                    "--max-zmq-peers allow (%d connections, and about %d descriptors of the server's own): "
                    "past it a unix lane pauses accepting, and libzmq aborts the server on an ipc:// lane and "
                    "spins on a tcp:// one; raise `ulimit -n` or lower the caps", soft, allowed, OWN_DESCRIPTORS)
    return soft


LOG_FORMAT = "%(asctime)s scan-bridge[%(process)d] %(levelname)s %(name)s: %(message)s"


def _serve_log() -> None:
    """From serving on, log through StderrLog: a stderr nobody reads must hold up no lane."""
    from .logs import StderrLog

    root = logging.getLogger()
    serving = StderrLog(sys.stderr)
    serving.setFormatter(logging.Formatter(LOG_FORMAT))
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.flush()
    root.addHandler(serving)


def main(argv=None, protocol_fd: int | None = None, signalled: list[int] | None = None) -> int:
    """Serves until a stop signal, a shutdown request or (Port mode) stdin's end, then exits the
    process; returns only when the server did not start (or was stopped while starting), with
    the process's exit status. `signalled`: the stop signals recorded before (bridge/__main__.py
    records them from its first line), and those to come."""
    if protocol_fd is None:
        from .stdio_guard import claim_protocol_stdout

        protocol_fd = claim_protocol_stdout()
    # Installed before anything slow (importing torch, building or loading the kernels,
    # warming up): a stop asked for during start-up ends it quietly.
    signalled = [] if signalled is None else signalled
    previous = record_stop_signals(signalled)
    try:
        return _start_and_serve(argv, protocol_fd, signalled)
    finally:  # a caller in this process (a test) gets its own handlers back
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _start_and_serve(argv, protocol_fd: int, signalled: list[int]) -> int:
    parser = build_parser()

    def print_help(_file=None):  # argparse's signature; always the real stdout
        # `--help` is read by a person, piped into less or grep: argparse prints it on
        # sys.stdout, which the guard points at stderr, so it goes to the real stdout (only it:
        # another thread's print meanwhile must not reach the protocol's descriptor).
        with open(os.dup(protocol_fd), "w", encoding="utf-8") as out:
            argparse.ArgumentParser.print_help(parser, out)

    parser.print_help = print_help
    args = parser.parse_args(argv)
    if "SCAN_BRIDGE_LOG" in os.environ:  # refused even where --log-level overrides it
        try:
            _log_level(os.environ["SCAN_BRIDGE_LOG"])
        except argparse.ArgumentTypeError as exc:
            parser.error(f"$SCAN_BRIDGE_LOG: {exc}")
    if os.environ.get("SCAN_BRIDGE_SIMD", "").strip():
        # A variant asked for that cannot be had (a typo, or one this CPU lacks) left the C++
        # backend unavailable, and the default one then served from torch, many times slower.
        from scan_kernels.cpu.build import selected_variant
        from scan_kernels.errors import BackendUnavailable

        try:
            selected_variant()
        except BackendUnavailable as exc:
            parser.error(f"${exc}")
    # Start-up's few lines are written as they are logged, each marking how far it got (a stop
    # signal's handling depends on it); the lanes' logging goes through StderrLog (_serve_log).
    logging.basicConfig(stream=sys.stderr, level=args.log_level, format=LOG_FORMAT)
    log = logging.getLogger("bridge")
    log.debug("starting")

    def stop_requested_while_starting() -> bool:
        if signalled:
            log.info("stop requested during start-up (%s); exiting", signal.Signals(signalled[0]).name)
        return bool(signalled)

    tune_malloc()
    raise_descriptor_limit(args)
    if args.exit_guard:
        exit_guard.start()

    from .device import DeviceUnavailable, choose_device
    from .dispatcher import Dispatcher
    from .server import Server, ServerConfig
    from .stdio_guard import enlarge_pipe
    from .transports.base import FLUSH_SECONDS
    from .transports.stdio import StdioTransport

    if stop_requested_while_starting():
        return 0
    try:
        device = choose_device(args.device)
    except DeviceUnavailable as exc:
        log.error("%s", exc)
        return 2
    # Every ServerConfig field is an option of the same name.
    args.model_dirs = tuple(args.model_dirs)
    config = ServerConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerConfig)})
    if config.threads is not None:  # before any thread calls into torch: each keeps what it read
        import torch

        torch.set_num_threads(config.threads)
    try:
        server = Server(config, device)
    except Exception as exc:  # e.g. --backend naming an unavailable backend
        log.error("cannot start: %s", exc)
        return 2
    if stop_requested_while_starting():
        return 0
    if args.warmup:
        import scan_kernels

        try:
            server.compiled = scan_kernels.warmup(args.warmup, device=server.device, backend=server.backend)
        except (scan_kernels.KernelInputError, scan_kernels.BackendUnavailable) as exc:
            # a bucket the backend refuses: say so before serving anything
            log.error("cannot start: --warmup: %s", exc)
            return 2
        except Exception:  # compiling failed: where is for the traceback to say
            log.exception("cannot start: --warmup: compiling failed")
            return 2
        log.info("warmed up %d kernels for %d shape buckets (backend %s)", len(server.compiled),
                 len(args.warmup), server.backend)
        if stop_requested_while_starting():
            return 0
    if config.metrics_port is not None:
        from .metrics import endpoint_url, serve_metrics

        try:
            port = serve_metrics(server, config.metrics_host, config.metrics_port)
        except OSError as exc:  # a port in use, a host not this machine's or one the resolver refuses
            log.error("cannot start: --metrics-host %s --metrics-port %s: %s", config.metrics_host,
                      config.metrics_port, exc)
            return 2
        except UnicodeError as exc:  # a name the resolver's IDNA encoding refuses (an empty or long label)
            log.error("cannot start: --metrics-host %r: %s", config.metrics_host, exc)
            return 2
        server.metrics_endpoint = endpoint_url(config.metrics_host, port)
        log.info("metrics at %s", server.metrics_endpoint)
    dispatcher = Dispatcher(server)

    try:
        lanes = open_lanes(args, dispatcher)
    except Exception as exc:  # a bad endpoint, an address in use, unreadable keys
        log.error("cannot start: %s", exc)
        return 2
    stdio = None
    if args.stdio or not lanes:
        sizes = [enlarge_pipe(0), enlarge_pipe(protocol_fd)]
        stdio = StdioTransport(dispatcher, 0, protocol_fd, config.max_frame_size)
        server.transports.append("stdio")
    server.transports.extend(name for lane in lanes for name in lane.names)

    # stdio closes last (below): unix removes its socket file before stdio's writer may wait
    # out the flush deadline, so that no new client connects meanwhile.
    every_lane = lanes + ([stdio] if stdio else [])
    _serve_log()
    dispatcher.start()
    for lane in every_lane:
        lane.start()
    log.info("serving %s on %s (%s), backend %s%s", ", ".join(server.transports), device.device,
             device.reason, server.backend, f", pipe sizes {sizes}" if stdio else "")
    while not (signalled or server.stop_requested.is_set() or (stdio and stdio.input_ended())):
        time.sleep(STOP_POLL_SECONDS)
    why = "stdin closed" if stdio and stdio.input_ended() else "stop requested"
    started = time.monotonic()
    drained = dispatcher.drain(DRAIN_SECONDS)
    flush_deadline = time.monotonic() + FLUSH_SECONDS
    # ZeroMQ sends the replies it was handed, the stream lanes' writer threads write theirs to
    # slow readers.
    for lane in every_lane:
        lane.close(flush_deadline)
    log.info("%s; %s in %.0f ms; exiting", why,
             "all requests answered" if drained else "gave up waiting for requests in flight",
             (time.monotonic() - started) * 1000)
    exit_guard.stop()  # os._exit below runs no atexit handler
    logging.shutdown()
    sys.stderr.flush()
    # os._exit: interpreter teardown (torch, thread joins) can take longer than the shutdown
    # budget, and every reply has been written by now (synchronously, or by the lanes' close,
    # by the flush deadline).
    os._exit(0)
