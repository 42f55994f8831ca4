"""Byte-level msgpack helpers for the decoder: what kind of value an encoded value is, how to
describe it in an error without decoding it, and where a bin/str payload starts.

The decoder walks a request one level at a time: msgspec decodes a map into
`{key: msgspec.Raw}`, where each Raw is a zero-copy view of one encoded value inside the body.
Tensor payloads are never decoded: their bin/str header is read here and the rest of the Raw is
the payload, still a view into the body. This works for msgpack str as well as bin, which
matters because Msgpax (Elixir) packs binaries as str with arbitrary, non-UTF-8 bytes.
"""

from __future__ import annotations

from typing import Any

import msgpack
import msgspec

# One level of a map: keys decoded, values left encoded (views into the input). Keys are str
# (SPEC §3): one of another kind is refused at its header (msgspec.ValidationError), not decoded
# first, which for an array key of a million 1-byte items cost an object each.
MAP_DECODER = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])


def _no_ext(code: int, data: memoryview):
    raise msgspec.DecodeError(f"an ext type ({code}): the protocol has none (SPEC §3)")


# Ext types decoded were handed on as msgspec.msgpack.Ext (in a config, a reply's result), where
# the other codecs refuse them.
ANY_DECODER = msgspec.msgpack.Decoder(ext_hook=_no_ext)
# What msgspec raises on malformed input: UnicodeDecodeError for a str (or key) that is not
# UTF-8, RecursionError for absurdly deep nesting.
DECODE_FAILURES = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)

_KINDS = ["int"] * 256
for _b in range(0x80, 0x90):
    _KINDS[_b] = "map"
for _b in range(0x90, 0xA0):
    _KINDS[_b] = "array"
for _b in range(0xA0, 0xC0):
    _KINDS[_b] = "str"
for _b, _k in {0xC0: "nil", 0xC1: "invalid", 0xC2: "bool", 0xC3: "bool", 0xC4: "bin", 0xC5: "bin",
               0xC6: "bin", 0xC7: "ext", 0xC8: "ext", 0xC9: "ext", 0xCA: "float", 0xCB: "float",
               0xD4: "ext", 0xD5: "ext", 0xD6: "ext", 0xD7: "ext", 0xD8: "ext", 0xD9: "str",
               0xDA: "str", 0xDB: "str", 0xDC: "array", 0xDD: "array", 0xDE: "map",
               0xDF: "map"}.items():
    _KINDS[_b] = _k
del _b, _k

# First byte -> (header size, size of the big-endian length field) of bin/str values.
_PAYLOAD_HEADERS = {0xC4: (2, 1), 0xC5: (3, 2), 0xC6: (5, 4), 0xD9: (2, 1), 0xDA: (3, 2), 0xDB: (5, 4)}
_CONTAINER_HEADERS = {0xDC: 2, 0xDD: 4, 0xDE: 2, 0xDF: 4}

_SHOWN_STR = 40
_VALUE_ENCODER = msgspec.msgpack.Encoder()


def kind(encoded: memoryview) -> str:
    """The msgpack type of an encoded value: int, float, bool, nil, str, bin, array, map, ext."""
    return _KINDS[encoded[0]] if encoded.nbytes else "nothing"


def payload(encoded: memoryview) -> memoryview | None:
    """The bytes of an encoded bin or str value, as a view into `encoded`; None for other types."""
    first = encoded[0]
    if 0xA0 <= first <= 0xBF:
        return encoded[1:]
    header = _PAYLOAD_HEADERS.get(first)
    if header is None:
        return None
    return encoded[header[0]:]


def count(encoded: memoryview) -> int:
    """Number of items of an encoded array or entries of an encoded map."""
    first = encoded[0]
    if first < 0xA0:
        return first & 0x0F
    size = _CONTAINER_HEADERS[first]
    return int.from_bytes(encoded[1:1 + size], "big")


def items(encoded: memoryview):
    """The items of an encoded array, one view at a time, for an array the body's decode found
    well formed. Unlike a decode into a list, it holds nothing per item: an array of a million
    1-byte items would otherwise cost an object each, many times the frame's size, before its
    first item is looked at. msgpack's C unpacker steps over each item without building it;
    nesting past its stack raises one of STEPPED_TOO_DEEP."""
    return _values(encoded, count(encoded))


# What stepping over nesting too deep raises: StackError from msgpack's C unpacker, RecursionError
# from its pure-Python fallback (installed where no wheel fits, on PyPy, or MSGPACK_PUREPYTHON).
STEPPED_TOO_DEEP = (msgpack.StackError, RecursionError)


def entries(encoded: memoryview):
    """The entries of an encoded map as (key, value) views, one at a time, as `items` steps
    over an array's items."""
    values = _values(encoded, 2 * count(encoded))
    for key in values:
        yield key, next(values)


def _values(encoded: memoryview, n: int):
    # The n values after the container's header.
    start = 1 if encoded[0] < 0xA0 else 1 + _CONTAINER_HEADERS[encoded[0]]
    unpacker = msgpack.Unpacker(max_buffer_size=len(encoded))
    unpacker.feed(encoded[start:])
    pos = start
    for _ in range(n):
        unpacker.skip()
        end = start + unpacker.tell()
        yield encoded[pos:end]
        pos = end


def shown_key(key: str) -> str:
    """A client-chosen key (or name) for an error: its repr when short, else only its size. A
    key may be nearly as long as the frame, and an error may name it more than once."""
    return repr(key) if len(key) <= _SHOWN_STR else _long_key(key)


def key_path(parent: str, key: str) -> str:
    """The field of the value at `key` in the map at `parent` ("" for the top level), a long
    key told by its size as `shown_key` tells it."""
    step = key if len(key) <= _SHOWN_STR else _long_key(key)
    return f"{parent}.{step}" if parent else step


def _long_key(key: str) -> str:
    # surrogatepass: a JSON config's key may hold a lone surrogate (a \udc80 escape).
    return f"<key of {len(key.encode(errors='surrogatepass'))} bytes>"


def describe_value(value: Any) -> str:
    """`describe` of a value already decoded (a msgpack or JSON value), from its encoding again."""
    return describe(memoryview(_VALUE_ENCODER.encode(value)))


def shown_value(value: Any) -> str:
    """A value a client chose (a checkpoint's config entry, a path) for an error: its repr when
    short, else an account of it (`describe_value`'s, an int's size), never the whole of it."""
    sized = isinstance(value, (str, bytes, list, tuple, dict))
    if not (sized and len(value) > _SHOWN_STR):
        text = repr(value)
        if len(text) <= 2 * _SHOWN_STR:
            return text
    if isinstance(value, int):
        return f"int of {value.bit_length()} bits"
    try:
        return describe_value(value)
    except (OverflowError, TypeError, ValueError):  # beyond msgpack: an int past 64 bits inside
        return f"{type(value).__name__} too long to show"


def describe(encoded: memoryview) -> str:
    """A short account of an encoded value for error messages ("int -3", "bin of 12 bytes")."""
    what = kind(encoded)
    if what in ("int", "float", "bool", "nil"):
        value = ANY_DECODER.decode(encoded)
        return "nil" if value is None else f"{what} {value!r}"
    if what == "str":
        data = payload(encoded)
        try:
            text = str(data, "utf-8")
        except UnicodeDecodeError:
            return f"str of {data.nbytes} bytes (not UTF-8)"
        return f"str {text!r}" if len(text) <= _SHOWN_STR else f"str of {data.nbytes} bytes"
    if what == "bin":
        return f"bin of {payload(encoded).nbytes} bytes"
    if what == "array":
        return f"array of {count(encoded)} items"
    if what == "map":
        return f"map of {count(encoded)} entries"
    return what
