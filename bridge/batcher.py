"""Dynamic batching: requests that can share a kernel launch run as one launch.

An op that can be batched (step, scan) is a `BatchedOp`: `prepare(server, call)` checks one
request and resolves its tensors and session into an `Item`, whose `key` says what must be equal
for two requests to share a launch (shapes past the batch axis, dtypes, options); `run(server,
items)` makes one launch for all of them and gives each its own rows back. The dispatcher's
worker gathers the batch (bridge.dispatcher): it takes the next request, then more queued
requests of the same op while `Batch.accepts` them, waiting for late ones only as long as
`BatchPolicy` says.

Rules a batch keeps:
  * equal keys, and the same A, D, dt_bias: the same tensor (one handle) or equal values;
  * at most `--max-batch` rows (one request bigger than that runs alone);
  * one request per session: two steps of one session are two timesteps, run one after the
    other, never side by side in one launch;
  * gathering stops at the first request that does not fit, which runs next: requests run in
    the order they arrived.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import numpy as np
import torch

import scan_kernels
from protocol import OutTensor, WireTensor

from .errors import OpError
from .sessions import Session, StateLost, state_lost, unknown_session
from .tensors import TORCH_DTYPES, host_view, to_wire
from .timing import now_ns

# How long a batch size is remembered as the company to wait for (see BatchPolicy). Longer than
# a 60 FPS frame, so that agents stepping once per frame are still expected on the next frame.
COMPANY_MEMORY_NS = 1_000_000_000
# A batch stops waiting for company this long before a member's deadline would pass, at least,
# so that the launch still starts within it: a quarter of the member's budget, since a loaded
# machine wakes the worker late by more than any fixed margin, and a missed deadline costs the
# caller its frame where a smaller batch costs a little throughput.
MIN_LAUNCH_MARGIN_NS = 1_000_000


def company_wait_end_ns(received_ns: int, budget_ns: int) -> int:
    """The latest a batch may wait for company with a member received at `received_ns` whose
    deadline gives it `budget_ns` to start."""
    return received_ns + budget_ns - max(MIN_LAUNCH_MARGIN_NS, budget_ns // 4)


@dataclass(eq=False)
class Item:
    """One prepared request."""

    call: object
    key: tuple | None  # None: shares a launch with nothing
    rows: int
    tensors: dict  # this request's per-row values by argument name: WireTensor, tensor or None
    # What every member must have equal (SHARED_ARGS): WireTensor as it came, a handle's tensor, or None
    shared: dict = field(default_factory=dict)
    session: Session | None = None
    options: dict = field(default_factory=dict)  # the kernel's dt options, part of the key
    prepare_ns: int = 0  # time spent preparing; not queueing time
    # the latest a batch may wait for company with it (company_wait_end_ns: its deadline_us,
    # SPEC §4, less a margin); None: it has no deadline
    wait_end_ns: int | None = None


class BatchedOp(abc.ABC):
    """An op whose requests can share a kernel launch. Calling it serves one request alone (the
    legacy ExPhil path does)."""

    @abc.abstractmethod
    def prepare(self, server, call) -> Item:
        """Check the request and resolve its tensors; raise OpError (or a kernels input error)
        for a request that cannot run."""

    @abc.abstractmethod
    def run(self, server, items: list[Item]) -> list[dict]:
        """One launch for `items` (equal keys, distinct sessions); the result of each, in order."""

    def __call__(self, server, call) -> dict:
        return self.run(server, [self.prepare(server, call)])[0]


def dt_options(args: dict) -> dict:
    """The kernel's dt options of a request, as the kernels API takes them (requests share a
    launch only when these are equal). mamba_ssm's `dt_limit` pair becomes dt_min, dt_max: its
    default (0, inf) clamps nothing, an infinite side is no bound."""
    dt_min, dt_max = args.get("dt_min"), args.get("dt_max")
    if "dt_limit" in args:
        if dt_min is not None or dt_max is not None:
            given = "dt_min" if dt_min is not None else "dt_max"
            raise OpError("invalid_argument",
                          f"args.dt_limit: expected either dt_limit or dt_min/dt_max, got both dt_limit and {given}",
                          {"field": "args.dt_limit", "expected": "either dt_limit or dt_min/dt_max",
                           "got": f"both dt_limit and {given}"})
        dt_min, dt_max = scan_kernels.dt_limit_bounds(args["dt_limit"])
    return {"dt_softplus": bool(args.get("dt_softplus", False)), "dt_min": dt_min, "dt_max": dt_max}


# Arguments every member of a launch must share (the same handle or equal values): the launch
# takes the lead member's.
SHARED_ARGS = ("A", "D", "dt_bias")


def shared_args(server, call) -> dict:
    """A call's SHARED_ARGS, as its batch key and same_values compare them."""
    return {name: server.tensor_arg(call, name) for name in SHARED_ARGS}


def same_values(a: WireTensor | torch.Tensor | None, b: WireTensor | torch.Tensor | None) -> bool:
    """True when `a` and `b` (wire bytes as they came, or a handle's tensor) are the same tensor
    or hold the same bits, dtype and shape too: a -0.0 of one member's is not another's 0.0,
    which would change the signs of zeros in its state (SPEC §6.3: bit for bit a launch of its
    own). Wire bytes are compared on the host, so that no member's copy goes to the device only
    to be compared."""
    if a is b:
        return True
    if a is None or b is None or signature(a) != signature(b):
        return False
    if isinstance(a, WireTensor) and isinstance(b, WireTensor):
        return bool(np.array_equal(np.frombuffer(a.data, np.uint8), np.frombuffer(b.data, np.uint8)))
    wire, tensor = (a, b) if isinstance(a, WireTensor) else (b, a)
    if isinstance(wire, WireTensor):
        return torch.equal(bits(host_view(wire)).to(tensor.device), bits(tensor))
    return a.device == b.device and torch.equal(bits(a), bits(b))


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, to compare as such (torch.equal takes -0.0 for 0.0, a NaN for no NaN)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def shared_tensors(server, lead: Item) -> dict:
    """The lead member's shared arguments as device tensors, for the whole launch: one copy each,
    which the op charges as the launch's h2d."""
    return {name: server.device_tensor(value) if isinstance(value, WireTensor) else value
            for name, value in lead.shared.items()}


class Batch:
    def __init__(self, first: Item):
        self.items = [first]
        self.rows = first.rows
        self.sessions = {first.session} if first.session is not None else set()
        self.first_enqueued_ns = first.call.enqueued_ns
        self.wait_end_ns = first.wait_end_ns  # the earliest member's, None if none has a deadline

    @property
    def key(self):
        return self.items[0].key

    def accepts(self, item: Item, max_batch: int) -> bool:
        lead = self.items[0]
        if item.key is None or item.key != lead.key or self.rows + item.rows > max_batch:
            return False
        if item.session is not None and item.session in self.sessions:
            return False
        return all(same_values(item.shared[name], tensor) for name, tensor in lead.shared.items())

    def add(self, item: Item) -> None:
        self.items.append(item)
        self.rows += item.rows
        if item.wait_end_ns is not None:
            self.wait_end_ns = item.wait_end_ns if self.wait_end_ns is None else min(self.wait_end_ns,
                                                                                        item.wait_end_ns)
        if item.session is not None:
            self.sessions.add(item.session)


class BatchPolicy:
    """How long a batch waits for more requests.

    A batch waits for late requests only while it has fewer requests than the largest batch of
    its key in the last second (its expected company), never longer than `max_delay_us` after
    its first request arrived, and never past a member's deadline. So a lone caller never waits,
    while callers that step together are gathered into one launch again each time.
    `max_delay_us` 0 never waits; what is already queued still joins.
    """

    def __init__(self, max_delay_us: int, max_batch: int):
        self.max_delay_ns = max_delay_us * 1000
        self.max_batch = max_batch
        self._company: dict[tuple, tuple[int, int]] = {}  # key -> (when, requests) of the largest recent batch

    def wait_s(self, batch: Batch, now: int) -> float | None:
        """Seconds to wait for one more request to join `batch`; None: take only queued ones."""
        if self.max_delay_ns == 0 or batch.key is None or len(batch.items) >= self._expected(batch.key, now):
            return None
        end = batch.first_enqueued_ns + self.max_delay_ns
        if batch.wait_end_ns is not None:
            end = min(end, batch.wait_end_ns)
        remaining = end - now
        return remaining / 1e9 if remaining > 0 else None

    def expects_company(self, key, now: int) -> bool:
        """Whether requests of `key` recently came together (in one batch of several)."""
        return key is not None and self._expected(key, now) > 1

    def _expected(self, key, now: int) -> int:
        when, requests = self._company.get(key, (0, 1))
        return requests if now - when <= COMPANY_MEMORY_NS else 1

    def observe(self, batch: Batch, now: int) -> None:
        """Remember the size of a gathered batch."""
        if batch.key is None:
            return
        if len(batch.items) >= self._expected(batch.key, now):
            self._company[batch.key] = (now, len(batch.items))
        if len(self._company) > 256:  # forget keys not seen for a while
            self._company = {k: v for k, v in self._company.items() if now - v[0] <= COMPANY_MEMORY_NS}


def stack_rows(server, values: list) -> torch.Tensor | None:
    """Members' values of one per-row argument (wire tensors as they came, or tensors) as one
    device tensor stacked on the batch axis. Wire bytes are joined before any tensor is made: one
    copy, one tensor and one host-to-device transfer per batch, none per request."""
    first = values[0]
    if first is None:
        return None
    if len(values) == 1:
        return server.device_tensor(first) if isinstance(first, WireTensor) else first
    if all(isinstance(v, WireTensor) for v in values):
        rows = sum(v.shape[0] for v in values)
        joined = bytearray().join(v.data for v in values)
        return server.device_tensor(WireTensor(first.dtype, (rows, *first.shape[1:]), memoryview(joined)))
    return torch.cat([server.device_tensor(v) if isinstance(v, WireTensor) else v for v in values])


def split_rows(t: torch.Tensor, items: list[Item]) -> tuple:
    """Each member's rows of a batched output (views)."""
    return t.split([item.rows for item in items])


def charge(items: list[Item], stage: str, ns: int) -> None:
    """Charge work done once for the whole batch to every member's timing."""
    for item in items:
        item.call.timing.add(stage, ns)


def run_batch(server, op: BatchedOp, items: list[Item]) -> list[tuple[Item, dict | BaseException]]:
    """Run one gathered batch. Members whose session was closed while they waited (their
    connection went away) are left out and get unknown_session, and those whose session an
    earlier launch that failed left lost get state_lost; the others share one launch."""
    outcomes, live = [], []
    for item in items:
        if item.session is not None and item.session.closed:
            outcomes.append((item, unknown_session(item.session.id, "args.session")))
        elif item.session is not None and item.session.lost:
            outcomes.append((item, state_lost(item.session.id, "args.session")))
        else:
            live.append(item)
    if not live:
        return outcomes
    try:
        outcomes.extend(zip(live, _launch(server, op, live)))
    except scan_kernels.KernelInputError as exc:
        if len(live) == 1:
            outcomes.append((live[0], exc))
            return outcomes
        # Members have equal keys, so they fail together; the kernels check every argument
        # before computing, so nothing ran. Alone, each gets an error naming its own shapes.
        for item in live:
            try:
                outcomes.append((item, _launch(server, op, [item])[0]))
            except Exception as alone_exc:
                outcomes.append((item, alone_exc))
    except StateLost as exc:  # each member is told of its own session's state
        outcomes.extend((item, exc.of(item.session)) for item in live)
    except Exception as exc:  # the launch failed for all of them
        outcomes.extend((item, exc) for item in live)
    return outcomes


def _launch(server, op: BatchedOp, items: list[Item]) -> list[dict]:
    rows = sum(item.rows for item in items)
    for item in items:
        item.call.timing.extra["batch_rows"] = rows
    results = op.run(server, items)
    # The launch is counted here, once, not with any member's reply, which may still fail to go
    # out (inference_count / execution_count = mean batch).
    server.stats.record_launch(items[0].call.stats_op, rows)
    return results


def prepare(op: BatchedOp, server, call) -> Item:
    """`op.prepare`, timed: preparing is work, not waiting."""
    start = now_ns()
    item = op.prepare(server, call)
    item.prepare_ns = now_ns() - start
    budget_us = call.request.deadline_us
    item.wait_end_ns = None if budget_us is None else company_wait_end_ns(call.timing.received_ns, budget_us * 1000)
    return item


def wire_rows(t: torch.Tensor, items: list[Item]) -> list[OutTensor]:
    """A batched output [rows, ...] as each member's reply tensor: one device-to-host copy for
    the batch (charged to every member), then each member's byte range of it."""
    start = now_ns()
    whole = to_wire(t)
    charge(items, "d2h", now_ns() - start)
    return member_rows(whole, items)


def member_rows(whole: OutTensor, items: list[Item]) -> list[OutTensor]:
    """A batched output already on the host as each member's byte range of it (views)."""
    if len(items) == 1:
        return [whole]
    row_bytes = whole.data.nbytes // whole.shape[0]
    out, offset = [], 0
    for item in items:
        size = item.rows * row_bytes
        out.append(OutTensor(whole.dtype, (item.rows, *whole.shape[1:]), whole.data[offset:offset + size]))
        offset += size
    return out


def dtype_of(value: WireTensor | torch.Tensor) -> torch.dtype:
    return TORCH_DTYPES[value.dtype] if isinstance(value, WireTensor) else value.dtype


def nbytes_of(value: WireTensor | torch.Tensor) -> int:
    return value.data.nbytes if isinstance(value, WireTensor) else value.numel() * value.element_size()


def row_signature(value: WireTensor | torch.Tensor | None):
    """What must be equal between members' values of one argument so they stack on the batch
    axis: dtype and every axis but the first."""
    return None if value is None else (dtype_of(value), tuple(value.shape[1:]))


def signature(value: WireTensor | torch.Tensor | None):
    return None if value is None else (dtype_of(value), tuple(value.shape))
