"""Checks one encoded value at a time and raises the matching ValidationError.

A `Reader` remembers what is known about the request being decoded (its id once parsed,
whether it is a legacy ExPhil request) so every error it raises carries it, and the raw buffers
of a multipart message (SPEC §5, "Multipart messages") that tensors may refer to by index.
"""

from __future__ import annotations

import math
from typing import Iterator, NoReturn, Union

import msgspec

from ._msgpack import (ANY_DECODER, DECODE_FAILURES, MAP_DECODER, STEPPED_TOO_DEEP, count, describe, describe_value,
                       entries, items, key_path, kind, payload, shown_key)
from .errors import (DecodeError, InvalidArgument, InvalidRequest, TensorSizeMismatch, UnknownDtype,
                     ValidationError)
from .schema import (KIND_EXPECTED, LAYOUTS, MAX_MAP_BYTES, MAX_NAMED_TENSORS, OUTPUTS, SESSION_KINDS,
                     WEIGHTS_DTYPES, valid_request_id)
from .tensors import DTYPES, MAX_DIM, MAX_EXTENT_BYTES, MAX_NDIM, HandleRef, WireTensor, extent_bytes

_TENSOR_KEYS = ("dtype", "shape", "data")
# A tensor of a multipart message: "buf" (an index into the message's raw buffers) stands
# where "data" would.
_BUFFER_TENSOR_KEYS = ("dtype", "shape", "buf")
# Every key a tensor or handle map may hold.
_TENSOR_NAMES = frozenset(("dtype", "shape", "data", "buf", "handle"))
_ABSENT = msgspec.Raw(b"")
# About what decoding a map costs an entry (its key, a Raw, a dict slot). A map of more than a
# few entries with fewer bytes an entry than that would cost more than its size decoded at once;
# one of a few entries costs little, and is decoded to name what is wrong with it.
_DECODED_ENTRY_BYTES = 128
_FEW_ENTRIES = 64
# Only a map16 or map32 header announces more than a fixmap's 15 entries.
_LONG_MAPS = (0xDE, 0xDF)
DEADLINE_EXPECTED = "a uint of microseconds, or nil"


class _TensorFields(msgspec.Struct, forbid_unknown_fields=True):
    """A tensor map or a handle map, typed loosely enough to decode either in one call."""

    dtype: Union[str, None] = None
    shape: Union[list[int], None] = None
    data: msgspec.Raw = _ABSENT
    buf: Union[int, None] = None
    handle: Union[str, None] = None


_TENSOR_FIELDS = msgspec.msgpack.Decoder(_TensorFields)
_RAW_DECODER = msgspec.msgpack.Decoder(msgspec.Raw)
_ARRAY_DECODER = msgspec.msgpack.Decoder(list[msgspec.Raw])


def decode_top_map(body) -> dict[str, msgspec.Raw]:
    """The body's top-level map, values left encoded. Raises DecodeError / InvalidRequest."""
    encoded = memoryview(body).cast("B")
    if more_entries(encoded, 0) and _one_map(body):
        # No request or reply has that many keys. Which are wrong cannot be told without
        # decoding an object a key: nor can the id, or whether it is a legacy request.
        raise InvalidRequest("body", f"a map of at most {_FEW_ENTRIES} keys", describe(encoded))
    try:
        top = MAP_DECODER.decode(body)
    except msgspec.ValidationError as e:
        got = kind(encoded)
        if got != "map":
            raise DecodeError(f"body: expected one msgpack map, got {got}",
                              detail={"expected": "one msgpack map", "got": got}) from None
        if not _one_map(body):  # malformed past a key that is no str
            raise DecodeError(f"body: not one msgpack value: {e}",
                              detail={"expected": "one msgpack map", "got": "a malformed map"}) from None
        # One more non-str key (SPEC §3), refused in the form its str keys say, as any other.
        Reader(legacy=not _names_v1(encoded)).not_str_key(encoded, "body", InvalidRequest)
    except DECODE_FAILURES as e:
        # Malformed bodies: since msgspec 0.23 an invalid UTF-8 key is one.
        raise DecodeError(f"body: not one msgpack value: {e}",
                          detail={"expected": "one msgpack map", "got": str(e)}) from None
    # Which format the map is in decides the shape of the error reply.
    legacy = "id" not in top and "v" not in top
    Reader(legacy=legacy).check_keys(top, encoded, "body", InvalidRequest)
    return top


def more_entries(encoded: memoryview, most: int) -> bool:
    """Whether `encoded` is a map of more entries than `most`, the keys it may hold, and than
    a few: some key of it is unknown or given twice, and decoding them would cost an object
    each. Callers refuse it from this header."""
    return encoded.nbytes > 0 and encoded[0] in _LONG_MAPS and count(encoded) > max(most, _FEW_ENTRIES)


def _names_v1(encoded: memoryview) -> bool:
    """Whether the well-formed map `encoded` has an "id" or "v" key (a v1 request), its keys
    stepped over, none decoded."""
    try:
        return any(kind(key) == "str" and payload(key) in (b"id", b"v") for key, _ in entries(encoded))
    except STEPPED_TOO_DEEP:  # not_str_key then refuses it as too deep
        return True


def _one_map(body) -> bool:
    """Whether `body` is one well-formed msgpack map, without decoding its keys or values."""
    try:
        _RAW_DECODER.decode(body)
    except DECODE_FAILURES:
        return False
    return kind(memoryview(body).cast("B")) == "map"


def buffer_views(buffers) -> tuple[memoryview, ...]:
    """The raw buffers of a multipart message as flat byte views (no copies)."""
    views = []
    for buffer in buffers:
        view = memoryview(buffer)
        views.append(view if view.format == "B" and view.ndim == 1 else view.cast("B"))
    return tuple(views)


class Reader:
    __slots__ = ("request_id", "legacy", "buffers", "used")

    def __init__(self, *, legacy: bool = False, buffers: tuple[memoryview, ...] = ()):
        self.request_id = None
        self.legacy = legacy
        # Raw buffers of a multipart message, and the indices tensors have referred to so far.
        self.buffers = buffers
        self.used: set[int] = set()

    def fail(self, cls: type[ValidationError], field: str, expected: str, got: str,
             **extra) -> NoReturn:
        raise cls(field, expected, got, request_id=self.request_id, legacy=self.legacy, **extra)

    # -- containers ---------------------------------------------------------------------

    def check_keys(self, entries: dict[str, msgspec.Raw], encoded: memoryview, field: str, cls) -> None:
        """The str keys MAP_DECODER gave of the map `encoded` are distinct."""
        if len(entries) != count(encoded):
            self._repeated_key(field, cls)

    def not_str_key(self, encoded: memoryview, field: str, cls) -> NoReturn:
        """Refuses the map `encoded`, whose decode found a key that is no str, naming the first
        such key from its encoding: stepped over, never decoded."""
        try:
            for key, _ in entries(encoded):
                if kind(key) != "str":
                    self._not_str(key, field, cls)
        except STEPPED_TOO_DEEP:
            self._too_deep(encoded, field, "a map with str keys", "msgpack's unpacker stack")
        raise AssertionError(f"{field}: no key of the map is anything but a str")

    def _not_str(self, key: memoryview, field: str, cls) -> NoReturn:
        self.fail(cls, field, "a map with str keys", f"a non-str key ({describe(key)})")

    def _repeated_key(self, field: str, cls) -> NoReturn:
        self.fail(cls, field, "a map with distinct keys", "a key given more than once")

    def at_most(self, raw: msgspec.Raw, most: int, field: str, expected: str) -> None:
        """Refuses a map of `more_entries` than `most` from its header."""
        encoded = memoryview(raw)
        if more_entries(encoded, most):
            self.fail(InvalidArgument, field, expected, describe(encoded))

    def map(self, raw: msgspec.Raw, field: str, expected: str, cls) -> dict[str, msgspec.Raw]:
        encoded = memoryview(raw)
        if kind(encoded) != "map":
            self.fail(cls, field, expected, describe(encoded))
        entries = self._decode(MAP_DECODER, raw, field, expected, cls)
        self.check_keys(entries, encoded, field, cls)
        return entries

    def array(self, raw: msgspec.Raw, field: str, expected: str, cls=InvalidArgument) -> Iterator[memoryview]:
        """The array's items as views, one at a time (`_msgpack.items`), so that a refusal of an
        item costs no object for each of the others."""
        encoded = memoryview(raw)
        if kind(encoded) != "array":
            self.fail(cls, field, expected, describe(encoded))
        return self._items(encoded, field, expected)

    def _items(self, encoded: memoryview, field: str, expected: str) -> Iterator[memoryview]:
        try:
            yield from items(encoded)
        except STEPPED_TOO_DEEP:
            self._too_deep(encoded, field, expected, "msgpack's unpacker stack")

    def _decode(self, decoder, raw: msgspec.Raw, field: str, expected: str, cls=InvalidArgument):
        # The enclosing decode only skipped over this value: keys and strings inside it were
        # not checked for UTF-8 or hashability yet.
        try:
            return decoder.decode(raw)
        except RecursionError as e:
            self._too_deep(memoryview(raw), field, expected, str(e))
        except msgspec.ValidationError:  # MAP_DECODER's alone (callers check kinds): a key that is no str
            self.not_str_key(memoryview(raw), field, cls)
        except DECODE_FAILURES as e:
            self.fail(cls, field, expected, f"an undecodable {kind(memoryview(raw))} ({e})")

    def _too_deep(self, encoded: memoryview, field: str, expected: str, why: str) -> NoReturn:
        # SPEC §3: nesting that exhausts the decoder is decode_error. Reading a value a level or
        # more down the stack runs out sooner than the body's decode, which skipped it.
        got = f"{kind(encoded)} nested too deep to decode ({why})"
        raise DecodeError(f"{field}: expected {expected}, got {got}",
                          detail={"field": field, "expected": expected, "got": got},
                          request_id=self.request_id, legacy=self.legacy) from None

    # -- scalars ------------------------------------------------------------------------

    def string(self, raw: msgspec.Raw, field: str, cls=InvalidArgument,
               expected: str = KIND_EXPECTED["str"], *, allow_empty: bool = False) -> str:
        """A str; the empty one only where `allow_empty`: a name looked up in a table (an op,
        a dtype), where "" is one more unknown name."""
        encoded = memoryview(raw)
        if kind(encoded) != "str":
            self.fail(cls, field, expected, describe(encoded))
        value = self._decode(ANY_DECODER, raw, field, expected, cls)
        if not value and not allow_empty:
            self.fail(cls, field, expected, "an empty str")
        return value

    def request_ref(self, raw: msgspec.Raw, field: str, cls=InvalidArgument) -> int | str:
        """A request id: the envelope's own, or the one a cancel names."""
        expected = KIND_EXPECTED["request_id"]
        encoded = memoryview(raw)
        if kind(encoded) == "int":
            value = ANY_DECODER.decode(raw)
            if valid_request_id(value):
                return value
        elif kind(encoded) == "str":
            return self.string(raw, field, cls, expected)
        self.fail(cls, field, expected, describe(encoded))

    def deadline(self, raw: msgspec.Raw) -> int | None:
        """The envelope's deadline_us: a uint of microseconds, or nil (none)."""
        encoded = memoryview(raw)
        what = kind(encoded)
        if what == "nil":
            return None
        if what == "int":
            value = ANY_DECODER.decode(raw)
            if value >= 0:  # msgpack ints stop at 2^64 - 1
                return value
        self.fail(InvalidRequest, "deadline_us", DEADLINE_EXPECTED, describe(encoded))

    def boolean(self, raw: msgspec.Raw, field: str) -> bool:
        encoded = memoryview(raw)
        if kind(encoded) != "bool":
            self.fail(InvalidArgument, field, KIND_EXPECTED["bool"], describe(encoded))
        return ANY_DECODER.decode(raw)

    def number(self, raw: msgspec.Raw, field: str) -> float:
        encoded = memoryview(raw)
        if kind(encoded) in ("int", "float"):
            value = float(ANY_DECODER.decode(raw))
            if math.isfinite(value):
                return value
        self.fail(InvalidArgument, field, KIND_EXPECTED["number"], describe(encoded))

    def size(self, raw: msgspec.Raw, field: str, arg_kind: str = "size") -> int:
        """A size; `arg_kind` names what an error says was expected."""
        encoded = memoryview(raw)
        if kind(encoded) == "int":
            value = ANY_DECODER.decode(raw)
            if 0 < value <= MAX_DIM:
                return value
        self.fail(InvalidArgument, field, KIND_EXPECTED[arg_kind], describe(encoded))

    def limits(self, raw: msgspec.Raw, field: str) -> tuple[float, float]:
        encoded = memoryview(raw)
        # The count first, then each item's kind: an array of many items, or an item that is one,
        # is refused without decoding them; a pair's bad item is named, as `args.dt_limit[1]`.
        if kind(encoded) != "array" or count(encoded) != 2:
            self.fail(InvalidArgument, field, KIND_EXPECTED["limits"], describe(encoded))
        bounds = []
        for index, item in enumerate(self._items(encoded, field, KIND_EXPECTED["limits"])):
            value = math.nan
            if kind(item) in ("int", "float"):
                try:
                    value = float(ANY_DECODER.decode(item))
                except OverflowError:  # an int beyond the float range
                    pass
            if math.isnan(value):
                self.fail(InvalidArgument, f"{field}[{index}]", "a number (finite or infinite, not NaN)",
                          describe(item))
            bounds.append(value)
        return bounds[0], bounds[1]

    def session_kind(self, raw: msgspec.Raw, field: str) -> str:
        expected = KIND_EXPECTED["kind"]
        value = self.string(raw, field, expected=expected)
        if value not in SESSION_KINDS:
            self.fail(InvalidArgument, field, expected, describe(memoryview(raw)))
        return value

    def output(self, raw: msgspec.Raw, field: str) -> str:
        return self._one_of(raw, field, "output", OUTPUTS)

    def weights_dtype(self, raw: msgspec.Raw, field: str) -> str:
        return self._one_of(raw, field, "weights_dtype", WEIGHTS_DTYPES)

    def _one_of(self, raw: msgspec.Raw, field: str, arg_kind: str, allowed: tuple[str, ...]) -> str:
        expected = KIND_EXPECTED[arg_kind]
        value = self.string(raw, field, expected=expected)
        if value not in allowed:
            self.fail(InvalidArgument, field, expected, describe(memoryview(raw)))
        return value

    def any_map(self, raw: msgspec.Raw, field: str) -> dict:
        """A map with str keys, its values decoded as they are; every map inside it, in arrays
        too, is held to the same keys (SPEC §3)."""
        encoded = memoryview(raw)
        if kind(encoded) != "map":
            self.fail(InvalidArgument, field, KIND_EXPECTED["map"], describe(encoded))
        if encoded.nbytes > MAX_MAP_BYTES:  # refused from its size, before an object is made of it
            self.fail(InvalidArgument, field, f"a map of at most {MAX_MAP_BYTES} bytes",
                      f"a map of {encoded.nbytes} bytes")
        return self._any_value(raw, field)

    def _any_value(self, raw: msgspec.Raw, field: str):
        # Loops, not comprehensions (each one more Python frame on 3.11): one frame a level, so
        # that nesting the body's decode accepted does not exhaust Python's stack here.
        what = kind(memoryview(raw))
        if what == "map":
            decoded = {}
            for key, value in self.map(raw, field, KIND_EXPECTED["map"], InvalidArgument).items():
                decoded[key] = self._any_value(value, key_path(field, key))
            return decoded
        if what == "array":
            values = []
            # Decoded, not stepped over as array() does: stepping feeds the unpacker a copy of
            # the array, and a copy at every level of nested arrays would multiply the body.
            for i, item in enumerate(self._decode(_ARRAY_DECODER, raw, field, "a msgpack array")):
                values.append(self._any_value(item, f"{field}[{i}]"))
            return values
        return self._decode(ANY_DECODER, raw, field, "a msgpack value")

    def tensors(self, raw: msgspec.Raw, field: str) -> dict:
        """A map of names to tensors (or handles), each checked as a tensor argument is."""
        encoded = memoryview(raw)
        if kind(encoded) == "map":
            n = count(encoded)
            if n > MAX_NAMED_TENSORS:  # refused from its header, before an entry is read
                self.fail(InvalidArgument, field, f"a map of at most {MAX_NAMED_TENSORS} tensors", describe(encoded))
            if n > _FEW_ENTRIES and n * _DECODED_ENTRY_BYTES > encoded.nbytes:
                self._check_tensors_one_at_a_time(encoded, field)
        entries = self.map(raw, field, KIND_EXPECTED["tensors"], InvalidArgument)
        return {key: self.tensor(value, key_path(field, key)) for key, value in entries.items()}

    def _check_tensors_one_at_a_time(self, encoded: memoryview, field: str) -> None:
        # A map of many small entries would cost many times its size decoded at once, before
        # its first value is looked at: its values are checked as they are stepped over
        # (`_msgpack.entries`), the first that is no tensor refused before the rest are read.
        # What they decode to is not kept: a view of each would cost more than the decode.
        expected = KIND_EXPECTED["tensors"]
        try:
            for key, value in entries(encoded):
                if kind(key) != "str":
                    self._not_str(key, field, InvalidArgument)
                key = self._decode(ANY_DECODER, key, field, expected)
                if self.valid_tensor(value, True, self.buffers) is None:
                    self.tensor(value, key_path(field, key))
        except STEPPED_TOO_DEEP:
            self._too_deep(encoded, field, expected, "msgpack's unpacker stack")

    def size_or_tensors(self, raw: msgspec.Raw, field: str) -> int | dict:
        if kind(memoryview(raw)) == "map":
            return self.tensors(raw, field)
        return self.size(raw, field, "size_or_tensors")

    def layout(self, raw: msgspec.Raw, field: str) -> str:
        expected = KIND_EXPECTED["layout"]
        value = self.string(raw, field, expected=expected)
        if value not in LAYOUTS:
            self.fail(InvalidArgument, field, expected, describe(memoryview(raw)))
        return value

    # -- tensors ------------------------------------------------------------------------

    def tensor(self, raw: msgspec.Raw, field: str) -> WireTensor | HandleRef:
        return self._tensor(raw, field, allow_handle=True)

    def tensor_data(self, raw: msgspec.Raw, field: str) -> WireTensor:
        return self._tensor(raw, field, allow_handle=False)

    def _tensor(self, raw, field, allow_handle):
        tensor = self.valid_tensor(raw, allow_handle, self.buffers, self.used)
        if tensor is not None:
            return tensor
        return self.checked_tensor(raw, field, allow_handle)

    def checked_tensor(self, raw: msgspec.Raw, field: str, allow_handle: bool) -> WireTensor | HandleRef:
        """The tensor checked one value at a time, failing with the first thing wrong: what
        runs when `valid_tensor` declines, and what tests compare `valid_tensor` with."""
        expected = KIND_EXPECTED["tensor" if allow_handle else "tensor_data"]
        self.at_most(raw, len(_TENSOR_NAMES), field, expected)
        entries = self.map(raw, field, expected, InvalidArgument)
        if "handle" in entries:
            if not allow_handle:
                self.fail(InvalidArgument, field, expected, "a handle map {handle}")
            if len(entries) != 1:
                self.fail(InvalidArgument, field, "a handle map with the single key 'handle'",
                          f"keys [{', '.join(map(shown_key, sorted(entries)))}]")
            return HandleRef(self.string(entries["handle"], field + ".handle"))
        if "buf" in entries and "data" in entries:
            self.fail(InvalidArgument, field, "either data or buf, not both", "both")
        keys = _BUFFER_TENSOR_KEYS if "buf" in entries else _TENSOR_KEYS
        for key in entries:
            if key not in keys:
                self.fail(InvalidArgument, key_path(field, key), "only the keys " + ", ".join(keys),
                          f"unknown key {shown_key(key)}")
        for key in keys:
            if key not in entries:
                self.fail(InvalidArgument, f"{field}.{key}", f"a tensor {key}", "nothing")
        dtype = self.dtype(entries["dtype"], field + ".dtype")
        shape = self.shape(entries["shape"], field + ".shape", dtype)
        if "buf" in entries:
            index = self.buffer_index(entries["buf"], field + ".buf")
            data = self.buffers[index]
            self.check_size(field + ".buf", dtype, shape, data)
            self.used.add(index)
        else:
            data = self.data(entries["data"], field + ".data")
            self.check_size(field + ".data", dtype, shape, data)
        return WireTensor(dtype, shape, data)

    @staticmethod
    def valid_tensor(raw: msgspec.Raw, allow_handle: bool, buffers: tuple[memoryview, ...] = (),
                     used: set[int] | None = None) -> WireTensor | HandleRef | None:
        """The tensor (or handle) when `raw` is a valid one, else None. One typed decode
        instead of a decode per key, to keep small steps cheap. It accepts
        only what `checked_tensor` accepts (tests hold the two paths to that). A tensor
        referring to raw buffer i of `buffers` adds i to `used`."""
        try:
            fields = _TENSOR_FIELDS.decode(raw)
        except DECODE_FAILURES:
            return None
        encoded = memoryview(raw)
        if fields.handle is not None:
            if (allow_handle and fields.handle and fields.dtype is None and fields.shape is None
                    and fields.data is _ABSENT and fields.buf is None and count(encoded) == 1):
                return HandleRef(fields.handle)
            return None
        dtype, shape = fields.dtype, fields.shape
        if (dtype not in DTYPES or shape is None or len(shape) > MAX_NDIM
                or (fields.data is _ABSENT) == (fields.buf is None) or count(encoded) != 3):
            return None
        for d in shape:
            if not 0 <= d <= MAX_DIM:
                return None
        if fields.buf is None:
            data = payload(memoryview(fields.data))
        elif 0 <= fields.buf < len(buffers):
            data = buffers[fields.buf]
        else:
            return None
        itemsize = DTYPES[dtype][0]
        nbytes = math.prod(shape) * itemsize
        if data is None or data.nbytes != nbytes:
            return None
        # Data that fills its shape is no bigger than the message: only a 0 dim can hide a
        # shape too big (so a step's tensors pay one test for it).
        if not nbytes and extent_bytes(shape, itemsize) > MAX_EXTENT_BYTES:
            return None
        if fields.buf is not None and used is not None:
            used.add(fields.buf)
        return WireTensor(dtype, tuple(shape), data)

    def dtype(self, raw: msgspec.Raw, field: str) -> str:
        name = self.string(raw, field, expected="a dtype code (" + ", ".join(DTYPES) + ")", allow_empty=True)
        if name not in DTYPES:
            self.fail(UnknownDtype, field, "one of " + ", ".join(DTYPES), describe(memoryview(raw)),
                      known=list(DTYPES))
        return name

    def shape(self, raw: msgspec.Raw, field: str, dtype: str) -> tuple[int, ...]:
        encoded = memoryview(raw)
        expected = f"a list of at most {MAX_NDIM} non-negative ints"
        if kind(encoded) != "array":
            self.fail(InvalidArgument, field, expected, describe(encoded))
        if count(encoded) > MAX_NDIM:
            self.fail(InvalidArgument, field, expected, f"{count(encoded)} dims")
        # Each dim's kind before any is decoded: one that is an array of many items costs nothing.
        for i, item in enumerate(self._items(encoded, field, expected)):
            if kind(item) != "int":
                self.fail(InvalidArgument, f"{field}[{i}]", "a non-negative int", describe(item))
        dims = self._decode(ANY_DECODER, raw, field, expected)
        for i, d in enumerate(dims):
            if not 0 <= d <= MAX_DIM:
                self.fail(InvalidArgument, f"{field}[{i}]", "a non-negative int", describe_value(d))
        self.check_extent(field, dtype, dims)
        return tuple(dims)

    def check_extent(self, field: str, dtype: str, shape) -> None:
        """SPEC §5: the shape spans at most 2^63 - 1 bytes, each 0 dim counted as 1, so that
        the server can make an array of it and any tensor_size_mismatch's byte count fits
        msgpack."""
        extent = extent_bytes(shape, DTYPES[dtype][0])
        if extent > MAX_EXTENT_BYTES:
            self.fail(InvalidArgument, field, f"at most 2^63 - 1 bytes of {dtype} with each 0 dim counted as 1",
                      f"{list(shape)}: {extent} bytes")

    def buffer_index(self, raw: msgspec.Raw, field: str) -> int:
        encoded = memoryview(raw)
        n_buffers = len(self.buffers)
        expected = (f"the index of one of the message's {n_buffers} raw buffers (0..{n_buffers - 1})"
                    if n_buffers else "no buf: this message has no raw buffers (buf needs a multipart message)")
        if kind(encoded) == "int":
            index = ANY_DECODER.decode(raw)
            if 0 <= index < n_buffers:
                return index
        self.fail(InvalidArgument, field, expected, describe(encoded))

    def check_buffers_used(self) -> None:
        """Every raw buffer of a multipart message is some tensor's data: a stray buffer is a
        client bug (an index off by one) and is reported, not ignored."""
        for index in range(len(self.buffers)):
            if index not in self.used:
                self.fail(InvalidRequest, f"buffers[{index}]", "every raw buffer referred to by a tensor's buf",
                          f"raw buffer {index} ({self.buffers[index].nbytes} bytes) referred to by no tensor")

    def data(self, raw: msgspec.Raw, field: str) -> memoryview:
        encoded = memoryview(raw)
        view = payload(encoded)
        if view is None:
            self.fail(InvalidArgument, field, "the tensor bytes as bin or str", describe(encoded))
        return view

    def check_size(self, field: str, dtype: str, shape: tuple[int, ...], data: memoryview) -> None:
        expected = math.prod(shape) * DTYPES[dtype][0]
        if data.nbytes != expected:
            self.fail(TensorSizeMismatch, field,
                      f"{expected} bytes ({dtype} {list(shape)})", f"{data.nbytes} bytes",
                      dtype=dtype, shape=list(shape), expected_bytes=expected,
                      got_bytes=data.nbytes)
