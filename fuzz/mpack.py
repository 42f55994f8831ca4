"""A msgpack writer that chooses among the encodings a value may take, and a tolerant reader
that keeps what a mutator needs to see.

The writer is this package's own, not `msgpack`'s or `protocol`'s: SPEC §3 makes decoders accept
non-minimal encodings (a small int as uint64, a short payload behind a bin 32 header) and §5
lets tensor data come as str, and a fuzzer that only ever sent minimal encodings would never
reach the code that reads the others. With `rng` given, each header is minimal or, now and
then, one of the wider forms; without it every encoding is minimal.

The reader keeps maps as `Pairs` (a list of (key, value) pairs), so a map with a key given
twice, or a non-str key, survives a round trip through the mutator, and str that is not UTF-8
as str with surrogate escapes.
"""

from __future__ import annotations

import random
import struct

import msgpack


class Pairs(list):
    """A msgpack map as its (key, value) pairs, in order: duplicate and unhashable keys kept."""

    def get(self, key, default=None):
        for k, v in self:
            if k == key and type(k) is type(key):
                return v
        return default

    def keys(self):
        return [k for k, _ in self]

    def set(self, key, value) -> None:
        """Replace the first pair with `key`, else append one."""
        for i, (k, _) in enumerate(self):
            if k == key and type(k) is type(key):
                self[i] = (key, value)
                return
        self.append((key, value))


class StrBytes(bytes):
    """Bytes written as msgpack str rather than bin (Msgpax packs binaries this way)."""


class Encoded(bytes):
    """Bytes written as they are: an already encoded value (or deliberately broken bytes)."""


def unpack(body) -> object:
    """The one msgpack value in `body`, maps as Pairs; raises ValueError on anything else
    (malformed, truncated, trailing bytes, nesting deeper than the mutator cares for)."""
    try:
        return msgpack.unpackb(bytes(body), raw=False, strict_map_key=False, use_list=True,
                               object_pairs_hook=Pairs, unicode_errors="surrogateescape")
    except (ValueError, TypeError, RecursionError, msgpack.UnpackException) as exc:
        raise ValueError(f"not one msgpack value: {exc}") from None


def _widen(rng: random.Random | None) -> bool:
    """Whether this header takes a wider form than it needs (one in five, with an rng)."""
    return rng is not None and rng.random() < 0.2


_UINTS = ((0xCC, ">B", 0xFF), (0xCD, ">H", 0xFFFF), (0xCE, ">I", 0xFFFFFFFF), (0xCF, ">Q", 2**64 - 1))
_SINTS = ((0xD0, ">b", 2**7), (0xD1, ">h", 2**15), (0xD2, ">i", 2**31), (0xD3, ">q", 2**63))


def _int(value: int, rng) -> bytes:
    if not -2**63 <= value <= 2**64 - 1:
        raise ValueError(f"int {value} does not fit msgpack")
    forms = [(code, fmt) for code, fmt, hi in _UINTS if 0 <= value <= hi]
    forms += [(code, fmt) for code, fmt, bound in _SINTS if -bound <= value < bound]
    if _widen(rng):
        code, fmt = rng.choice(forms)
        return bytes((code,)) + struct.pack(fmt, value)
    if -32 <= value <= 0x7F:
        return struct.pack("b", value) if value < 0 else bytes((value,))
    # Minimal: the smallest unsigned form for a non-negative value, the smallest signed one else.
    code, fmt = forms[0]
    return bytes((code,)) + struct.pack(fmt, value)


def _length_header(n: int, fix: int | None, fix_max: int, codes: tuple, rng) -> bytes:
    fits = [(code, size) for code, size in codes if n < 1 << (8 * size)]
    if fix is not None and n <= fix_max and not (_widen(rng) and fits):
        return bytes((fix | n,))
    code, size = rng.choice(fits) if _widen(rng) else fits[0]
    return bytes((code,)) + n.to_bytes(size, "big")


_STR = ((0xD9, 1), (0xDA, 2), (0xDB, 4))
_BIN = ((0xC4, 1), (0xC5, 2), (0xC6, 4))
_ARRAY = ((0xDC, 2), (0xDD, 4))
_MAP = ((0xDE, 2), (0xDF, 4))
_EXT = ((0xC7, 1), (0xC8, 2), (0xC9, 4))
_FIXEXT = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}


def pack(value, rng: random.Random | None = None) -> bytes:
    out = bytearray()
    _pack(value, rng, out)
    return bytes(out)


def _pack(value, rng, out: bytearray) -> None:
    if isinstance(value, Encoded):
        out += value
    elif value is None:
        out.append(0xC0)
    elif value is True:
        out.append(0xC3)
    elif value is False:
        out.append(0xC2)
    elif isinstance(value, int):
        out += _int(max(-2**63, min(value, 2**64 - 1)), rng)
    elif isinstance(value, float):
        try:
            single = struct.pack(">f", value)
        except OverflowError:  # beyond float32's range: only float64 holds it
            single = None
        exact = single is not None and (struct.unpack(">f", single)[0] == value or value != value)
        if exact and rng is not None and rng.random() < 0.5:
            out += b"\xca" + single
        else:
            out += b"\xcb" + struct.pack(">d", value)
    elif isinstance(value, StrBytes):
        out += _length_header(len(value), 0xA0, 31, _STR, rng) + value
    elif isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        out += _length_header(len(data), None, 0, _BIN, rng) + data
    elif isinstance(value, str):
        data = value.encode("utf-8", "surrogateescape")
        out += _length_header(len(data), 0xA0, 31, _STR, rng) + data
    elif isinstance(value, Pairs):
        out += _length_header(len(value), 0x80, 15, _MAP, rng)
        for k, v in value:
            _pack(k, rng, out)
            _pack(v, rng, out)
    elif isinstance(value, dict):
        _pack(Pairs(value.items()), rng, out)
    elif isinstance(value, msgpack.Timestamp):  # ext -1, which the reader decodes
        out += msgpack.packb(value)
    elif isinstance(value, msgpack.ExtType):
        n = len(value.data)
        if n in _FIXEXT:
            out.append(_FIXEXT[n])
        else:
            out += _length_header(n, None, 0, _EXT, None)
        out += struct.pack("b", value.code) + value.data
    elif isinstance(value, (list, tuple)):
        out += _length_header(len(value), 0x90, 15, _ARRAY, rng)
        for item in value:
            _pack(item, rng, out)
    else:
        raise TypeError(f"cannot pack {type(value).__name__}")
