"""Reading a checkpoint: where the server may read (the operator's --model-dir), which files
hold the weights, and their tensors' names and shapes before any data is read.

A checkpoint is a directory holding config.json and one of: model.safetensors;
model.safetensors.index.json and its shards (transformers' sharded layout); pytorch_model.bin
(mamba_ssm's, read with torch.load(weights_only=True)). Every file opened is resolved, symlinks
followed, and must lie under an allowed directory, so that no request -- a relative path, a
symlink, a shard name in an index -- makes the server read anything else. It is then opened
along that resolved path without following any link, and read through that open file, so that
a link swapped in after the check leads nowhere; its data is read, not mapped, so that a file
saved over while it is read is a short read, not a fault. A checkpoint's own files are named
in its directory; as links they may lead anywhere under an allowed directory: Hugging Face's
hub cache keeps a snapshot's files as links into the model's blobs/.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
import zipfile
from contextlib import contextmanager

import torch

from ..errors import OpError
from protocol import shown_value
from protocol.schema import MAX_MAP_BYTES

from .config import checkpoint_error

CONFIG = "config.json"
SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN = "pytorch_model.bin"
# A config.json or an index bigger than this is not one. A config.json is held to the bound of
# a config sent in a request: real ones are a few KB.
MAX_CONFIG_BYTES = MAX_MAP_BYTES
MAX_INDEX_BYTES = 16 << 20
# A hub cache's refs/main holds a commit hash and a newline.
HUB_REF_MAX_BYTES = 256
# The floating dtypes a weight may be stored in: one value an element, each converted to the
# model's dtype. Not the packed ones (safetensors' F4, torch's float4_e2m1fn_x2: two values a
# byte), which torch cannot convert and whose tensor is not the shape the header declares.
# safetensors' names for them (the F8 ones where this torch has them).
SAFETENSORS_FLOATS = {name: getattr(torch, dtype) for name, dtype in (
    ("F64", "float64"), ("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"), ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"), ("F8_E8M0", "float8_e8m0fnu")) if hasattr(torch, dtype)}
TORCH_FLOATS = tuple(getattr(torch, name) for name in ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn",
                                                       "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                                       "float8_e8m0fnu") if hasattr(torch, name))


def failure(exc: Exception, path: str, name: str) -> str:
    """A reader's exception as an error's `got`, the file at `path` named by its `name` alone:
    where the operator keeps checkpoints is not the client's to learn."""
    return f"{type(exc).__name__}: {exc}".replace(path, name)


def path_not_allowed(path: str, model_dirs: tuple[str, ...]) -> OpError:
    expected = ("a checkpoint directory under one of the server's --model-dir directories" if model_dirs
                else "no path: this server was started without --model-dir, so it reads no checkpoint files")
    shown = shown_value(path)
    return OpError("path_not_allowed", f"args.path: expected {expected}, got {shown}",
                   {"field": "args.path", "expected": expected, "got": path if shown == repr(path) else shown})


def resolve_checkpoint(path: str, model_dirs: tuple[str, ...]) -> str:
    """The real path of a checkpoint directory under an allowed one (relative paths are taken
    under the first), or of the snapshot a hub model id names (hub_snapshot) where no such
    directory holds a config. The same error for a path outside as for one that does not exist
    there would tell a client which files exist: a path resolving outside, or whose resolution
    fails (a link it may not read), is refused alike. A `..` is refused before anything is
    looked at: resolved, it would look up whatever precedes it, wherever that is."""
    # No OS path holds a NUL.
    if not model_dirs or "\0" in path or os.pardir in path.split(os.sep):
        raise path_not_allowed(path, model_dirs)
    try:
        real = os.path.realpath(os.path.join(model_dirs[0], path))
    except (OSError, ValueError):  # ValueError: a lone surrogate, which no file name holds
        raise path_not_allowed(path, model_dirs) from None
    if not any(_under(real, root) for root in model_dirs):
        raise path_not_allowed(path, model_dirs)
    # Present, not followed: a config.json that is a link out is refused by checkpoint_file
    # alike whether its target exists or not.
    if os.path.lexists(os.path.join(real, CONFIG)):
        return real
    snapshot = hub_snapshot(path, model_dirs)
    if snapshot is None:
        raise checkpoint_error("args.path", f"a checkpoint directory holding {CONFIG}",
                               f"{shown_value(path)} (none there)")
    return snapshot


# A hub model id: NAME or ORG/NAME, as Hugging Face allows them.
HUB_ID = re.compile(r"(?:[A-Za-z0-9][A-Za-z0-9._-]*/)?[A-Za-z0-9][A-Za-z0-9._-]*")
HUB_REVISION = re.compile(r"[A-Za-z0-9._-]{1,128}")


def hub_snapshot(model_id: str, model_dirs: tuple[str, ...]) -> str | None:
    """The real path of the snapshot `refs/main` names of hub model `model_id` (ORG/NAME) in a
    Hugging Face hub cache that is one of `model_dirs` (models--ORG--NAME/snapshots/REV), the
    first that has one; None where none does. What is read stays under that directory."""
    if not HUB_ID.fullmatch(model_id) or ".." in model_id:
        return None
    for root in model_dirs:
        repo = os.path.join(root, "models--" + model_id.replace("/", "--"))
        try:  # a missing ref, as any file the checkpoint lacks, is an OpError
            with checkpoint_file(os.path.join(repo, "refs"), "main", "args.path", (root,)) as ref:
                try:
                    with open(ref, "rb") as f:
                        revision = f.read(HUB_REF_MAX_BYTES).decode("ascii", "replace").strip()
                except OSError as e:
                    if e.errno in _SHORT_OF:
                        raise _short_of(e, "args.path", "refs/main") from None
                    raise
        except OpError as e:
            if e.code == "limit_exceeded":  # the server's want: the load may succeed sent again
                raise
            continue
        if not HUB_REVISION.fullmatch(revision) or revision in (os.curdir, os.pardir):
            continue
        try:
            real = os.path.realpath(os.path.join(repo, "snapshots", revision))
        except OSError:
            continue
        if _under(real, root) and os.path.lexists(os.path.join(real, CONFIG)):
            return real
    return None


def allowed_dirs(dirs) -> tuple[str, ...]:
    """The operator's --model-dir list, resolved (links followed); one that cannot be resolved
    now is kept as given, and a path under it is refused as it fails to resolve too."""
    def resolved(directory: str) -> str:
        try:
            return os.path.realpath(directory)
        except OSError:
            return directory

    return tuple(resolved(d) for d in dirs)


def _under(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


@contextmanager
def checkpoint_file(directory: str, name: str, field: str, roots: tuple[str, ...]):
    """A file of the checkpoint (config.json, the index, a shard the index names): a name in
    its directory, which resolves under one of `roots` (the allowed directories, resolved) and
    is a regular file: reading a FIFO or a device there (a link to /dev/zero) would block the
    serving thread or never end. Yields a path naming the open file itself (/dev/fd/N), good
    for the readers that take only a path, until the block ends."""
    if os.path.basename(name) != name or name in (os.curdir, os.pardir, ""):
        raise checkpoint_error(field, "a file name in the checkpoint's directory", shown_value(name))
    try:
        real = os.path.realpath(os.path.join(directory, name))
    except ValueError:  # no file name holds a NUL, or a lone surrogate (JSON's \ud800), which UTF-8 cannot encode
        raise checkpoint_error(field, "a file name in the checkpoint's directory", shown_value(name)) from None
    except OSError as e:  # a link along it that may not be read, or swapped while it was resolved
        raise checkpoint_error(field, "a file of the checkpoint that resolves under --model-dir",
                               f"{shown_value(name)} ({os.strerror(e.errno)})") from None
    if not any(_under(real, root) for root in roots):
        raise checkpoint_error(field, "a file of the checkpoint that resolves under --model-dir",
                               f"{shown_value(name)} (resolving outside)")
    expected = "a regular file in the checkpoint's directory"
    try:
        # Non-blocking: a FIFO swapped in after the check is opened at once, then refused.
        fd = _open_unlinked(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as e:
        if e.errno in _SHORT_OF:  # the server's want, not the checkpoint's fault: a retry may load it
            raise _short_of(e, field, shown_value(name)) from None
        raise checkpoint_error(field, expected, f"{shown_value(name)} ({os.strerror(e.errno)})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise checkpoint_error(field, expected, f"{shown_value(name)} (not a regular file)")
        yield f"/dev/fd/{fd}"
    finally:
        os.close(fd)


# An open that failed for what the server lacked, by SPEC §7's limit name.
_SHORT_OF = {errno.EMFILE: "open_files", errno.ENFILE: "open_files", errno.ENOMEM: "memory"}


def _short_of(e: OSError, field: str, shown: str) -> OpError:
    return OpError("limit_exceeded", f"{field}: the server could not open {shown}: {os.strerror(e.errno)}",
                   {"limit": _SHORT_OF[e.errno], "field": field})


def _open_unlinked(real: str, flags: int) -> int:
    """`real`, a resolved path, opened one component at a time, none followed if it is a link
    (ELOOP or ENOTDIR then): a link swapped in anywhere along it since it was resolved."""
    parts = real.split(os.sep)[1:]
    # O_PATH where there is one: a directory that may be searched but not read is walked, as
    # the path itself would be.
    walk = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(os.sep, walk)
    try:
        for part in parts[:-1]:
            fd, parent = os.open(part, walk, dir_fd=fd), fd
            os.close(parent)
        return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
    finally:
        os.close(fd)


def read_json(path: str, field: str, max_bytes: int):
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)  # bounded: the file may have grown since it was checked
        if len(data) > max_bytes:
            raise checkpoint_error(field, f"at most {max_bytes} bytes of JSON", "more")
        return json.loads(data)
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: nesting past json's depth
        raise checkpoint_error(field, "a readable JSON file", failure(e, path, field)) from None


class TensorSource:
    """A checkpoint's tensors: names and shapes from the headers, data read on demand."""

    def __init__(self, directory: str, roots: tuple[str, ...]):
        self.directory = directory
        self.roots = roots
        self._files: dict[str, str] = {}  # tensor name -> the name of its file in the directory
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._bin: dict[str, torch.Tensor] | None = None  # a legacy-format pytorch_model.bin's, read whole
        self._bin_stored: int | None = None  # a zip-format one's bytes of storage, read in tensors()
        try:
            fd = _open_unlinked(directory, os.O_RDONLY | os.O_DIRECTORY)
            try:
                names = os.listdir(fd)
            finally:
                os.close(fd)
        except OSError as e:
            raise checkpoint_error("args.path", "a checkpoint directory", os.strerror(e.errno)) from None
        if SAFETENSORS_INDEX in names:
            with checkpoint_file(directory, SAFETENSORS_INDEX, SAFETENSORS_INDEX, roots) as path:
                index = read_json(path, SAFETENSORS_INDEX, MAX_INDEX_BYTES)
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise checkpoint_error(f"{SAFETENSORS_INDEX}.weight_map", "a map of tensor name to shard file",
                                       type(weight_map).__name__)
            for shard in sorted(set(weight_map.values())):
                with checkpoint_file(directory, shard, f"{SAFETENSORS_INDEX}.weight_map", roots) as path:
                    self._read_header(path, shard)
            missing = set(weight_map) - set(self.shapes)
            if missing:
                name = min(missing)
                raise checkpoint_error(f"{weight_map[name]}.{name}", "the tensor its index names", "nothing",
                                       tensor=name)
        elif SAFETENSORS in names:
            with checkpoint_file(directory, SAFETENSORS, SAFETENSORS, roots) as path:
                self._read_header(path, SAFETENSORS)
        elif TORCH_BIN in names:
            with checkpoint_file(directory, TORCH_BIN, TORCH_BIN, roots) as path:
                self._read_bin(path)
        else:
            raise checkpoint_error("args.path", f"{SAFETENSORS}, {SAFETENSORS_INDEX} or {TORCH_BIN} in the directory",
                                   "none of them")

    def _read_header(self, path: str, shown: str) -> None:
        with open(path, "rb") as f:
            for name, entry in safetensors_header(f, shown).items():
                if name in self.shapes:
                    raise checkpoint_error(f"{shown}.{name}", "each tensor in one shard", "it in two", tensor=name)
                self.shapes[name] = entry.shape
                self._files[name] = shown

    def _read_bin(self, path: str) -> None:
        # torch's zip format is mapped to learn its shapes (no data is read), then read anew, not
        # mapped, once the budget is held (tensors()); its legacy format (before 1.6, or
        # _use_new_zipfile_serialization=False) cannot be mapped and is read whole, before the
        # budget is checked (SPEC §6.4).
        zipped = zipfile.is_zipfile(path)
        state = load_bin(path, mapped=zipped)
        self.shapes.update((name, tuple(tensor.shape)) for name, tensor in state.items())
        if zipped:
            self._bin_stored = stored_bytes(state)
        else:
            self._bin = state

    def tensors(self, names: set[str]):
        """(name, tensor) of each of `names`, read one file at a time."""
        if self._bin is not None:
            yield from ((name, self._bin[name]) for name in sorted(names))
            return
        if self._bin_stored is not None:
            with checkpoint_file(self.directory, TORCH_BIN, TORCH_BIN, self.roots) as path:
                state = load_bin(path, mapped=False) if zipfile.is_zipfile(path) else None
            # Read anew, as a shard is: a file rewritten since its shapes were learnt may hold
            # other tensors, or more bytes, than the budget was held for.
            if state is None or stored_bytes(state) != self._bin_stored or any(
                    tuple(state[name].shape) != self.shapes[name] if name in state else True for name in names):
                raise checkpoint_error(TORCH_BIN, "the tensors its shapes were learnt from when the load began",
                                       "a file rewritten since")
            yield from ((name, state[name]) for name in sorted(names))
            return
        for shown in sorted({self._files[name] for name in names}):
            with checkpoint_file(self.directory, shown, shown, self.roots) as path, open(path, "rb") as f:
                # Read anew: a file rewritten since its header was read may hold other tensors
                # than those checked and held against the budget.
                header = safetensors_header(f, shown)
                for name in sorted(n for n in names if self._files[n] == shown):
                    entry = header.get(name)
                    if entry is None or entry.shape != self.shapes[name]:
                        got = "nothing" if entry is None else f"{entry.dtype} of shape {list(entry.shape)}"
                        raise checkpoint_error(f"{shown}.{name}", f"a floating tensor of shape "
                                               f"{list(self.shapes[name])}, as its header said when the load began",
                                               got, tensor=name)
                    yield name, entry.read(f, f"{shown}.{name}")


# torch.save's zip format stores every record uncompressed, and its pickle is a few KB: a
# compressed record (what a zip bomb needs) or a big pickle is not a state dict torch saved.
MAX_BIN_PICKLE_BYTES = 16 << 20


def load_bin(path: str, *, mapped: bool) -> dict[str, torch.Tensor]:
    """The state dict in pytorch_model.bin at `path`, each entry a dense floating tensor under
    its name; `mapped` (the zip format only): the storages mapped, none of their data read."""
    if zipfile.is_zipfile(path):
        try:
            with zipfile.ZipFile(path) as archive:
                records = archive.infolist()
        except (zipfile.BadZipFile, OSError, ValueError) as e:
            raise checkpoint_error(TORCH_BIN, "a torch state dict (weights only)",
                                   failure(e, path, TORCH_BIN)) from None
        for record in records:
            if record.compress_type != zipfile.ZIP_STORED:
                raise checkpoint_error(TORCH_BIN, "records stored uncompressed, as torch.save writes them",
                                       f"{shown_value(record.filename)} compressed")
            if record.filename.endswith(".pkl") and record.file_size > MAX_BIN_PICKLE_BYTES:
                raise checkpoint_error(TORCH_BIN, f"a pickle of at most {MAX_BIN_PICKLE_BYTES} bytes",
                                       f"{shown_value(record.filename)} of {record.file_size}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mapped)
    except Exception as e:
        raise checkpoint_error(TORCH_BIN, "a torch state dict (weights only)", failure(e, path, TORCH_BIN)) from None
    if not isinstance(state, dict):
        raise checkpoint_error(TORCH_BIN, "a state dict", type(state).__name__)
    for name, tensor in state.items():
        if not isinstance(name, str):
            raise checkpoint_error(TORCH_BIN, "a state dict keyed by tensor names", f"a key {name!r}")
        if not isinstance(tensor, torch.Tensor) or tensor.dtype not in TORCH_FLOATS:
            got = str(tensor.dtype) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise checkpoint_error(f"{TORCH_BIN}.{name}", "a floating tensor of one value an element", got,
                                   tensor=str(name))
        # torch.load keeps a sparse layout, and a model saved from the meta device holds no data.
        if tensor.layout != torch.strided or tensor.is_meta:
            got = "a meta tensor (no data)" if tensor.is_meta else f"a {tensor.layout} tensor"
            raise checkpoint_error(f"{TORCH_BIN}.{name}", "a dense tensor with data", got, tensor=name)
    # A tensor may be a view of a storage far bigger than itself (torch.save keeps a slice's
    # whole storage): what is read would then be more than the budget was held for.
    tensor_bytes, storage_bytes = sum(t.numel() * t.element_size() for t in state.values()), stored_bytes(state)
    if storage_bytes > tensor_bytes:
        raise checkpoint_error(TORCH_BIN, f"storages holding its tensors' {tensor_bytes} bytes",
                               f"{storage_bytes} bytes of storage")
    return state


def stored_bytes(state: dict[str, torch.Tensor]) -> int:
    """The bytes of the state dict's storages, each counted once (tied tensors share one)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in state.values()}.values())


# safetensors' format: an 8-byte little-endian header length, the header (JSON: each tensor's
# dtype, shape and byte range in the data after it), the data. Read here through the open file
# rather than mapped: a mapped file truncated while it is read (a save in place, which opens
# it for writing first) kills the process with SIGBUS, and a file too big to map leaked the
# mapper's descriptor. A header bigger than safetensors' own bound is not one.
SAFETENSORS_MAX_HEADER_BYTES = 100_000_000


class SafetensorsEntry:
    """One tensor of a safetensors file: its dtype, shape and where its bytes lie in the file."""

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...], start: int, nbytes: int):
        self.dtype, self.shape, self.start, self.nbytes = dtype, shape, start, nbytes

    def read(self, f, field: str) -> torch.Tensor:
        data = torch.empty(self.nbytes, dtype=torch.uint8)
        view, done = memoryview(data.numpy()), 0
        while done < self.nbytes:  # preadv may return less than asked
            n = os.preadv(f.fileno(), [view[done:]], self.start + done)
            if n == 0:
                raise checkpoint_error(field, f"{self.nbytes} bytes of tensor data at byte {self.start}",
                                       f"the file ending after {done} of them")
            done += n
        return data.view(self.dtype).reshape(self.shape)


def safetensors_header(f, shown: str) -> dict[str, SafetensorsEntry]:
    """The tensors the header of open safetensors file `f` (shown as `shown`) declares, each
    checked to be floating and to lie, whole, in the file, none overlapping another."""
    def corrupt(got: str) -> OpError:
        return checkpoint_error(shown, "a valid safetensors file", got)

    size = os.fstat(f.fileno()).st_size
    prefix = os.pread(f.fileno(), 8, 0)
    if len(prefix) < 8:
        raise corrupt(f"a file of {len(prefix)} bytes")
    length = int.from_bytes(prefix, "little")
    if length > min(SAFETENSORS_MAX_HEADER_BYTES, size - 8):
        raise corrupt(f"a header of {length} bytes in a file of {size}")
    raw = os.pread(f.fileno(), length, 8)
    try:
        header = json.loads(raw) if len(raw) == length else None
    except (ValueError, RecursionError) as e:
        raise corrupt(f"a header that is not JSON ({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise corrupt("a header that is not a JSON object" if len(raw) == length else "a file shorter than its header")
    data_start, data_size = 8 + length, size - 8 - length
    entries: dict[str, SafetensorsEntry] = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        field = f"{shown}.{name}"
        if not (isinstance(spec, dict) and isinstance(spec.get("dtype"), str)
                and isinstance(spec.get("shape"), list) and isinstance(spec.get("data_offsets"), list)):
            raise checkpoint_error(shown, f"{name}: a tensor's dtype, shape and data_offsets", shown_value(spec),
                                   tensor=name)
        dtype = SAFETENSORS_FLOATS.get(spec["dtype"])
        if dtype is None:
            expected = f"a floating tensor ({', '.join(SAFETENSORS_FLOATS)})"
            raise checkpoint_error(field, expected, shown_value(spec["dtype"]), tensor=name)
        shape, offsets = spec["shape"], spec["data_offsets"]
        if not all(type(n) is int and n >= 0 for n in shape + offsets) or len(offsets) != 2:
            raise checkpoint_error(shown, f"{name}: a shape and data_offsets [begin, end] of non-negative integers",
                                   shown_value({"shape": shape, "data_offsets": offsets}), tensor=name)
        begin, end = offsets
        nbytes = math.prod(shape) * dtype.itemsize
        if not begin <= end <= data_size or end - begin != nbytes:
            raise checkpoint_error(shown, f"{name}: {nbytes} bytes (shape {shape}, {spec['dtype']}) within the "
                                   f"{data_size} bytes of data", f"data_offsets {offsets}", tensor=name)
        entries[name] = SafetensorsEntry(dtype, tuple(shape), data_start + begin, nbytes)
    spans = sorted((e.start, e.start + e.nbytes, name) for name, e in entries.items() if e.nbytes)
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise checkpoint_error(shown, f"{second}: data of its own", f"bytes shared with {first}", tensor=second)
    return entries
