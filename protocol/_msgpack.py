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

import msgspec

# One level of a map: keys decoded, values left encoded (views into the input).
MAP_DECODER = msgspec.msgpack.Decoder(dict[Any, msgspec.Raw])
ANY_DECODER = msgspec.msgpack.Decoder()
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

# First byte -> how to step over a value: (width of its big-endian length or count field, fixed
# bytes after that, the count of a fix type, bytes per counted unit, values per counted unit).
_SKIPS = [(0, 0, 0, 0, 0)] * 256
for _b in range(0x80, 0x90):
    _SKIPS[_b] = (0, 0, _b & 0x0F, 0, 2)
for _b in range(0x90, 0xA0):
    _SKIPS[_b] = (0, 0, _b & 0x0F, 0, 1)
for _b in range(0xA0, 0xC0):
    _SKIPS[_b] = (0, 0, _b & 0x1F, 1, 0)
for _i in range(3):
    _SKIPS[0xC4 + _i] = _SKIPS[0xD9 + _i] = (1 << _i, 0, 0, 1, 0)  # bin, str
    _SKIPS[0xC7 + _i] = (1 << _i, 1, 0, 1, 0)  # ext: its type byte, then the payload
for _i in range(4):
    _SKIPS[0xCC + _i] = _SKIPS[0xD0 + _i] = (0, 1 << _i, 0, 0, 0)  # uint, int
for _i in range(5):
    _SKIPS[0xD4 + _i] = (0, 1 + (1 << _i), 0, 0, 0)  # fixext
_SKIPS[0xCA], _SKIPS[0xCB] = (0, 4, 0, 0, 0), (0, 8, 0, 0, 0)
_SKIPS[0xDC], _SKIPS[0xDD], _SKIPS[0xDE], _SKIPS[0xDF] = (2, 0, 0, 0, 1), (4, 0, 0, 0, 1), (2, 0, 0, 0, 2), (4, 0, 0, 0, 2)
del _b, _i


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
    first item is looked at."""
    first = encoded[0]
    pos = 1 if first < 0xA0 else 1 + _CONTAINER_HEADERS[first]
    for _ in range(count(encoded)):
        end, pending = pos, 1
        while pending:  # no recursion: the values still to step over are counted
            width, fixed, n, unit_bytes, unit_values = _SKIPS[encoded[end]]
            end += 1
            if width:
                n = int.from_bytes(encoded[end:end + width], "big")
                end += width
            end += fixed + n * unit_bytes
            pending += n * unit_values - 1
        yield encoded[pos:end]
        pos = end


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
