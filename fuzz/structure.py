"""Structure-aware inputs: requests built from the protocol's own tables, and mutations of a
request's msgpack tree, so that the fuzzer gets past the envelope and argument checks instead
of spending its executions on bodies that fail at the first byte.

Everything here is derived from `protocol` at import time -- the ops and their arguments
(`protocol.OPS`, each argument's kind), the aliases, the envelope keys, the dtypes and the
legacy form's keys -- so an op, argument or envelope key added to the protocol is generated
and mutated without a change here. A kind this module has no generator for (one added after
it) gets arbitrary scalars, and is listed by `unknown_kinds()` so that a test can ask for one.

A generated request is valid more often than not; a mutation then breaks one thing (a key, a
value, a length, an encoding) at a time, which is what reaches the checks deep in the decoder.
"""

from __future__ import annotations

import math
import random

from protocol import ALIASES, DTYPES, MAX_NDIM, OPS
from protocol import decode as _decode
from protocol import legacy as _legacy
from protocol import schema as _schema

from .mpack import Encoded, Pairs, StrBytes, pack, unpack

# The envelope keys the decoder accepts (v, id, op, args and whatever was added since).
ENVELOPE_KEYS = tuple(sorted(getattr(_decode, "_ENVELOPE_KEYS", ("v", "id", "op", "args"))))
ARG_NAMES = tuple(sorted({name for spec in OPS.values() for name in spec} | set(ALIASES)))
TENSOR_KEYS = ("dtype", "shape", "data", "buf", "handle")
LEGACY_OPS = tuple(getattr(_legacy, "LEGACY_OPS", ("scan", "ping", "info")))
LEGACY_TENSORS = tuple(getattr(_legacy, "_TENSORS", ("x", "dt", "A", "B", "C")))
LEGACY_DIMS = tuple(getattr(_legacy, "_DIMS", ("batch", "seq_len", "hidden", "state")))
LEGACY_SHAPE_KEYS = tuple(name + "_shape" for name in LEGACY_TENSORS)
ENUMS = {"layout": _schema.LAYOUTS, "kind": _schema.SESSION_KINDS, "output": _schema.OUTPUTS,
         "weights_dtype": _schema.WEIGHTS_DTYPES}
# Every name a map key or a str value might usefully be.
VOCABULARY = tuple(sorted(set(ENVELOPE_KEYS) | set(OPS) | set(ARG_NAMES) | set(TENSOR_KEYS) | set(DTYPES)
                          | set(LEGACY_OPS) | set(LEGACY_DIMS) | set(LEGACY_SHAPE_KEYS)
                          | {v for values in ENUMS.values() for v in values})) + ("", "f128", "bogus")

INTERESTING_INTS = (0, 1, 2, 3, 7, 8, 9, 15, 16, 31, 32, 127, 128, 255, 256, 65535, 65536, 2**30, 2**31 - 1,
                    2**31, 2**32 - 1, 2**32, 2**53, 2**61, 2**62, 2**63 - 1, 2**63, 2**64 - 1,
                    -1, -2, -32, -33, -128, -129, -2**31, -2**63)
INTERESTING_FLOATS = (0.0, -0.0, 0.5, 1.0, -1.0, 1e-3, 0.1, 1e308, -1e308, 5e-324, math.inf, -math.inf,
                      math.nan, 3.4028235e38, 2.0**64)

_KNOWN_KINDS = ("tensor", "tensor_data", "bool", "number", "str", "size", "layout", "limits", "kind", "output",
                "weights_dtype", "map", "tensors", "size_or_tensors", "request_id", "frames")


def unknown_kinds() -> list[str]:
    """Argument kinds in protocol's table that nothing here generates on purpose."""
    kinds = {arg.kind for spec in OPS.values() for arg in spec.values()}
    return sorted(kinds - set(_KNOWN_KINDS))


class Message:
    """A body and the raw buffers that follow it (ZeroMQ's multipart form, SPEC §5)."""

    def __init__(self, body: bytes, buffers: list[bytes] | None = None):
        self.body = body
        self.buffers = buffers if buffers is not None else []


# -- values -------------------------------------------------------------------------------

def scalar(rng: random.Random):
    """Any msgpack scalar, biased to boundaries."""
    pick = rng.randrange(8)
    if pick == 0:
        return None
    if pick == 1:
        return rng.random() < 0.5
    if pick == 2:
        return rng.choice(INTERESTING_INTS)
    if pick == 3:
        return rng.choice(INTERESTING_FLOATS)
    if pick == 4:
        return rng.choice(VOCABULARY)
    if pick == 5:
        return rng.randbytes(rng.choice((0, 1, 4, 8, 16)))
    if pick == 6:
        return StrBytes(rng.randbytes(rng.choice((0, 1, 3, 40))))
    return rng.randint(-300, 300)


def any_value(rng: random.Random, depth: int = 0):
    """A scalar, or now and then an array or map of them."""
    if depth < 3 and rng.random() < 0.2:
        if rng.random() < 0.5:
            return [any_value(rng, depth + 1) for _ in range(rng.randrange(4))]
        return Pairs((rng.choice(VOCABULARY), any_value(rng, depth + 1)) for _ in range(rng.randrange(4)))
    return scalar(rng)


def small_shape(rng: random.Random, ndim: int | None = None) -> list[int]:
    if ndim is None:
        ndim = rng.choice((0, 1, 1, 2, 2, 3, 4)) if rng.random() < 0.97 else MAX_NDIM + rng.randrange(2)
    return [rng.choice((0, 1, 1, 2, 2, 3, 4)) for _ in range(ndim)]


def tensor_bytes(rng: random.Random, dtype: str, shape, *, exact: bool = True) -> bytes:
    """`shape`'s elements of `dtype` (random bytes: the decoder never reads the values), or,
    unless `exact`, now and then a byte more or less."""
    n = math.prod(shape) * DTYPES.get(dtype, (4,))[0]
    if n > 4096:  # a shape the fuzzer blew up: its data will not fit an input anyway
        n = rng.randrange(64)
    if not exact and rng.random() < 0.1:
        n = max(0, n + rng.choice((-1, 1)))
    return rng.randbytes(n)


def tensor(rng: random.Random, message: Message | None, *, allow_handle: bool = True, dtype: str | None = None,
           shape=None, exact: bool = False):
    """A tensor map with its data inline (bin, or str as Msgpax sends it) or in a raw buffer of
    `message`, or a handle map; now and then with one thing wrong unless `exact`."""
    if allow_handle and rng.random() < 0.15:
        return Pairs([("handle", rng.choice(("h1", "A", "x" * rng.randrange(1, 40))))])
    dtype = dtype or rng.choice(tuple(DTYPES))
    shape = list(small_shape(rng) if shape is None else shape)
    data = tensor_bytes(rng, dtype, shape, exact=exact)
    if message is not None and rng.random() < 0.4 and len(message.buffers) < 4:
        message.buffers.append(data)
        where = ("buf", len(message.buffers) - 1)
    else:
        where = ("data", StrBytes(data) if rng.random() < 0.3 else data)
    entries = [("dtype", dtype), ("shape", shape), where]
    rng.shuffle(entries)
    return Pairs(entries)


def value_of_kind(kind: str, rng: random.Random, message: Message | None):
    """A valid value of an argument kind of protocol's schema (arbitrary for an unknown kind)."""
    if kind == "tensor":
        return tensor(rng, message)
    if kind == "tensor_data":
        return tensor(rng, message, allow_handle=False)
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "number":
        return rng.choice((0, 1, -3, 0.001, 0.1, 2.5, -1e30))
    if kind == "str":
        return rng.choice(("s", "session-1", "h1", "m", "x" * rng.randrange(1, 64)))
    if kind == "size":
        return rng.choice((1, 2, 3, 4, 16, 2**31, 2**63 - 1))
    if kind in ENUMS:
        return rng.choice(ENUMS[kind])
    if kind == "limits":
        return [rng.choice((0, 0.001, -math.inf)), rng.choice((0.1, 1, math.inf))]
    if kind == "map":
        return Pairs((rng.choice(VOCABULARY), any_value(rng)) for _ in range(rng.randrange(4)))
    if kind == "tensors":
        return Pairs((rng.choice(("w", "layers.0.A", "embedding")), tensor(rng, message))
                     for _ in range(rng.randrange(3)))
    if kind == "size_or_tensors":
        return value_of_kind("size" if rng.random() < 0.6 else "tensors", rng, message)
    if kind == "request_id":
        return rng.choice((0, 7, 2**64 - 1, "r1", "x" * rng.randrange(1, 40)))
    if kind == "frames":
        return [Pairs([("op", op), ("args", op_args(op, rng, message, exclude=("session",)))])
                for op in (rng.choice(_schema.FRAME_OPS) for _ in range(rng.randrange(3)))]
    return any_value(rng)


def request_id(rng: random.Random):
    return rng.choice((0, 1, 77, 2**32, 2**64 - 1, "r", "req-" + str(rng.randrange(1000))))


def envelope_value(key: str, rng: random.Random):
    """A valid value for an envelope key other than op and args."""
    if key == "v":
        return 1
    if key == "id":
        return request_id(rng)
    # An envelope key added to the protocol since (deadline_us): a uint fits it, nil often too.
    return rng.choice((0, 1, 1000, 2**32, 2**64 - 1, None))


def op_args(op: str, rng: random.Random, message: Message | None, exclude: tuple[str, ...] = ()) -> Pairs:
    """`op`'s required arguments and some of its optional ones, under their names or aliases, in
    any order; none of `exclude` (a frame's session is the one being opened)."""
    args = Pairs()
    aliases = {name: alias for alias, name in ALIASES.items()}
    for name, arg in OPS.get(op, {}).items():
        if name not in exclude and (arg.required or rng.random() < 0.4):
            key = aliases[name] if name in aliases and rng.random() < 0.2 else name
            value = None if not arg.required and rng.random() < 0.05 else value_of_kind(arg.kind, rng, message)
            args.append((key, value))
    rng.shuffle(args)
    return args


def request(rng: random.Random, op: str | None = None, *, multipart: bool = False) -> Message:
    """A v1 request of `op` (a random one by default): its required arguments and some of its
    optional ones, under their names or aliases, and every envelope key now and then."""
    message = Message(b"")
    op = op or rng.choice(tuple(OPS))
    args = op_args(op, rng, message if multipart else None)
    top = Pairs()
    for key in ENVELOPE_KEYS:
        if key == "op":
            top.append((key, op))
        elif key == "args":
            if args or rng.random() < 0.7:
                top.append((key, args))
        elif key == "id" or rng.random() < 0.5:
            top.append((key, envelope_value(key, rng)))
    rng.shuffle(top)
    message.body = pack(top, rng)
    return message


def step_request(rng: random.Random) -> bytes:
    """A plain step request (the native path's form, bridge/native) of a Mamba-1 or a Mamba-2
    session: f32 operands of one consistent set of shapes, A, D and dt_bias sometimes as
    handles, the dt options; or, one in five, a model step of f32 embeddings or token ids."""
    batch, state = rng.choice((1, 1, 2, 3)), rng.choice((1, 2, 3, 4))
    if rng.random() < 0.2:
        if rng.random() < 0.5:
            model_input = ("embeds", tensor(rng, None, allow_handle=False, dtype="f32",
                                            shape=[batch, rng.choice((1, 4, 12))], exact=True))
        else:
            model_input = ("tokens", tensor(rng, None, allow_handle=False, dtype=rng.choice(("i32", "i64", "u8")),
                                            shape=[batch], exact=True))
        args = Pairs([("session", "s" * rng.randrange(1, 30)), model_input])
        if rng.random() < 0.5:
            args.append(("output", rng.choice(("hidden", "hidden", "logits", None))))
        rng.shuffle(args)
        return _envelope(rng, "model_step", args)
    if rng.random() < 0.5:
        dim = rng.choice((1, 2, 4, 6))
        groups = rng.choice([g for g in (1, 2, 3) if dim % g == 0])
        shapes = {"x": [batch, dim], "dt": [batch, dim], "z": [batch, dim], "A": [dim, state], "D": [dim],
                  "dt_bias": [dim],
                  "B": [batch, state] if groups == 1 and rng.random() < 0.5 else [batch, groups, state]}
    else:  # Mamba-2: heads x headdim, one decay per head
        heads, headdim = rng.choice((1, 2, 4, 6)), rng.choice((1, 2, 3))
        groups = rng.choice([g for g in (1, 2, 3) if heads % g == 0])
        shapes = {"x": [batch, heads, headdim], "dt": [batch, heads], "z": [batch, heads, headdim], "A": [heads],
                  "D": rng.choice(([heads], [heads, headdim])), "dt_bias": [heads], "B": [batch, groups, state]}
    shapes["C"] = list(shapes["B"])
    args = Pairs([("session", "s" * rng.randrange(1, 30))])
    for name in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias"):
        if name in ("D", "z", "dt_bias") and rng.random() < 0.5:
            continue
        if name in ("A", "D", "dt_bias") and rng.random() < 0.3:
            args.append((name, Pairs([("handle", "h-" + name)])))
        else:
            args.append((name, tensor(rng, None, allow_handle=False, dtype="f32", shape=shapes[name], exact=True)))
    for name in ("dt_softplus", "dt_min", "dt_max"):
        if rng.random() < 0.3:
            args.append((name, True if name == "dt_softplus" else rng.choice((0.001, 0.1, 1, None))))
    rng.shuffle(args)
    return _envelope(rng, "step", args)


def _envelope(rng: random.Random, op: str, args: Pairs) -> bytes:
    """A v1 request of `op` and `args`, envelope keys now and then, in any order."""
    top = Pairs([("v", 1), ("id", request_id(rng)), ("op", op), ("args", args)])
    for key in ENVELOPE_KEYS:
        if key not in ("v", "id", "op", "args") and rng.random() < 0.3:
            top.append((key, envelope_value(key, rng)))
    if rng.random() < 0.1:
        top = Pairs(p for p in top if p[0] != "v")
    rng.shuffle(top)
    return pack(top, rng)


def legacy_request(rng: random.Random) -> bytes:
    """An ExPhil request (SPEC §9): ping, info, or a scan in either of its two forms, its
    binaries as str (Msgpax's way) or bin."""
    op = rng.choice(LEGACY_OPS)
    top = Pairs([("op", op)])
    if op == "scan":
        b, l, h, s = (rng.choice((1, 1, 2, 3)) for _ in range(4))
        shapes = {"x": [b, l, h], "dt": [b, l, h], "A": [h, s], "B": [b, l, s], "C": [b, l, s]}
        declared = rng.random() < 0.4
        if not declared:
            top.extend(zip(LEGACY_DIMS, (b, l, h, s)))
        for name in LEGACY_TENSORS:
            data = tensor_bytes(rng, "f32", shapes.get(name, [1]), exact=rng.random() < 0.9)
            top.append((name, StrBytes(data) if rng.random() < 0.7 else data))
            if declared:
                top.append((name + "_shape", shapes.get(name, [1])))
    rng.shuffle(top)
    return pack(top, rng)


# -- mutations of a decoded tree ----------------------------------------------------------

def _nodes(tree, path=()):
    """Every (path, value) in the tree; a path step is ("item", i) or ("key"/"value", i)."""
    yield path, tree
    if isinstance(tree, Pairs):
        for i, (k, v) in enumerate(tree):
            yield path + (("key", i),), k
            yield from _nodes(v, path + (("value", i),))
    elif type(tree) is list:
        for i, item in enumerate(tree):
            yield from _nodes(item, path + (("item", i),))


def _replace(tree, path, new):
    if not path:
        return new
    (where, i), rest = path[0], path[1:]
    if isinstance(tree, Pairs):
        k, v = tree[i]
        tree[i] = (_replace(k, rest, new), v) if where == "key" else (k, _replace(v, rest, new))
    else:
        tree[i] = _replace(tree[i], rest, new)
    return tree


def _looks_like_tensor(node) -> bool:
    return isinstance(node, Pairs) and "shape" in node.keys() and "dtype" in node.keys()


def _refit_tensor(node: Pairs, rng: random.Random, message: Message) -> None:
    """Make a tensor map's data (or its raw buffer) hold exactly what its dtype and shape say,
    after a mutation changed one of them: so the fuzzer gets past the size check."""
    shape, dtype = node.get("shape"), node.get("dtype")
    if not isinstance(shape, list) or not all(type(d) is int and 0 <= d < 2**16 for d in shape):
        return
    dtype = dtype if isinstance(dtype, str) and dtype in DTYPES else "f32"
    data = tensor_bytes(rng, dtype, shape)
    buf = node.get("buf")
    if type(buf) is int and 0 <= buf < len(message.buffers):
        message.buffers[buf] = data
    elif "data" in node.keys():
        node.set("data", StrBytes(data) if isinstance(node.get("data"), StrBytes) else data)


def mutate_tree(tree, rng: random.Random, message: Message, mutate_bytes):
    """One structural change somewhere in `tree` (returned, possibly a new root).
    `mutate_bytes(data) -> bytes` mutates a str or bin payload (libFuzzer's own mutator)."""
    nodes = list(_nodes(tree))
    path, node = rng.choice(nodes)
    pick = rng.randrange(12)
    if pick == 0:
        return _replace(tree, path, any_value(rng))
    if pick == 1:
        return _replace(tree, path, rng.choice(VOCABULARY))
    if pick == 2 and isinstance(node, Pairs):
        node.insert(rng.randrange(len(node) + 1), (rng.choice(VOCABULARY), any_value(rng)))
        return tree
    if pick == 3 and isinstance(node, (Pairs, list)) and node:
        i = rng.randrange(len(node))
        if rng.random() < 0.5:
            del node[i]
        else:  # a key given twice, or an array item repeated
            node.insert(rng.randrange(len(node) + 1), node[i])
        return tree
    if pick == 4 and isinstance(node, Pairs) and node:
        i = rng.randrange(len(node))
        node[i] = (rng.choice((rng.choice(VOCABULARY), scalar(rng), [1], Pairs())), node[i][1])
        return tree
    if pick == 5 and type(node) is int:
        new = rng.choice((node + 1, node - 1, -node, node * 2, node ^ (1 << rng.randrange(64)),
                          rng.choice(INTERESTING_INTS)))
        return _replace(tree, path, max(-2**63, min(new, 2**64 - 1)))
    if pick == 6 and isinstance(node, (bytes, str)):
        raw = node if isinstance(node, bytes) else node.encode("utf-8", "surrogateescape")
        mutated = mutate_bytes(raw)
        if isinstance(node, StrBytes) or isinstance(node, str) and rng.random() < 0.5:
            return _replace(tree, path, StrBytes(mutated))
        return _replace(tree, path, mutated if isinstance(node, bytes) else mutated.decode("utf-8", "surrogateescape"))
    if pick == 7 and type(node) is list and len(node) <= MAX_NDIM + 1:
        # A shape: one dim changed, added or dropped, then the data refitted where it is a tensor's.
        if node and rng.random() < 0.6:
            node[rng.randrange(len(node))] = rng.choice((0, 1, 2, 3, 2**31, 2**62, 2**63 - 1, -1))
        elif rng.random() < 0.5:
            node.append(rng.choice((1, 2)))
        elif node:
            node.pop()
        return tree
    if pick == 8:
        tensors = [n for _, n in nodes if _looks_like_tensor(n)]
        if tensors:
            t = rng.choice(tensors)
            if rng.random() < 0.5:
                t.set("dtype", rng.choice(tuple(DTYPES)))
            _refit_tensor(t, rng, message)
            return tree
    if pick == 9 and isinstance(tree, Pairs) and "op" in tree.keys():
        # Another op, with a fresh set of its arguments.
        fresh = unpack(request(rng, rng.choice(tuple(OPS)), multipart=False).body)
        tree.set("op", fresh.get("op"))
        tree.set("args", fresh.get("args", Pairs()))
        return tree
    if pick == 10:
        # A tensor's data moved to a raw buffer of its own, or a buffer's index changed.
        tensors = [n for _, n in nodes if _looks_like_tensor(n)]
        if tensors and len(message.buffers) < 4:
            t = rng.choice(tensors)
            data = t.get("data")
            if isinstance(data, bytes):
                message.buffers.append(bytes(data))
                rest = Pairs(p for p in t if p[0] != "data")
                t[:] = rest + [("buf", len(message.buffers) - 1)]
            elif type(t.get("buf")) is int:
                t.set("buf", rng.choice((0, 1, len(message.buffers), -1)))
            return tree
    if pick == 11 and path:
        # The value wrapped in one more level, or (for a map) swapped for a map of maps.
        return _replace(tree, path, rng.choice(([node], Pairs([("v", node)]))))
    return _replace(tree, path, scalar(rng))


def mutate_body(body: bytes, rng: random.Random, message: Message, mutate_bytes, generate) -> bytes:
    """The body with one to three structural mutations, re-encoded with random encodings; a
    freshly generated one (`generate(rng)`) when the body does not decode."""
    try:
        tree = unpack(body)
    except ValueError:
        return generate(rng)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        tree = mutate_tree(tree, rng, message, mutate_bytes)
    out = pack(tree, rng)
    if rng.random() < 0.03:
        # Broken framing of the msgpack itself: a value cut short or bytes after it.
        out = out[:rng.randrange(len(out) + 1)] if rng.random() < 0.5 else out + Encoded(rng.randbytes(2))
    return out


# -- the decoder harness's input: a body and its raw buffers, each length-prefixed -----------

def split_parts(data: bytes) -> list[bytes]:
    """The parts of an input: each a 4-byte big-endian length then that many bytes (the format
    of protocol/vectors/*.frame and multipart/*.frame). Any bytes split somehow: a length past
    the end takes what is left, and an input shorter than a prefix is one body of those bytes."""
    parts, pos, n = [], 0, len(data)
    while pos < n:
        if n - pos < 4:
            parts.append(data[pos:])
            break
        length = int.from_bytes(data[pos:pos + 4], "big")
        parts.append(data[pos + 4:pos + 4 + length])
        pos += 4 + length
    return parts or [b""]


def join_parts(parts: list[bytes]) -> bytes:
    return b"".join(len(p).to_bytes(4, "big") + p for p in parts)
