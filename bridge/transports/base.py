"""What every transport's connections share: an id, the reply method, and close callbacks."""
from __future__ import annotations

import itertools
import os
import socket
import stat
import threading

_ids = itertools.count(1)

# How long the lanes' close() go on delivering replies already handed to them, on top of the
# dispatcher's drain (cli.DRAIN_SECONDS; one deadline for all the lanes): stdio and unix
# replies their writer threads still write to slow readers, ZeroMQ replies posted meanwhile
# (a peer's requests that waited past its in-flight cap are answered shutting_down as the
# replies before them go) or waiting for room in a peer's pipe.
FLUSH_SECONDS = 0.5


class SocketPathTaken(OSError):
    """A socket path another file holds, named with its option and path."""


def claim_socket_path(path: str, option: str) -> None:
    """Make `path` free for a socket this server binds (`option` names it in errors): a stale
    socket file a dead server left is removed, but a live server's socket, or any other file,
    is refused (binding over a live one would leave that server running, unreachable)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise SocketPathTaken(f"{option} {path}: expected a free path or a stale socket, got an existing non-socket "
                              "file")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        os.unlink(path)  # nobody listens: a dead server's leftover
    else:
        raise SocketPathTaken(f"{option} {path}: another server is listening there")
    finally:
        probe.close()


class SocketFile:
    """The socket file this server bound at `path`, known by its device and inode: removed on
    close only while it is still that file. One there since is another server's (started after
    this one's file was deleted, or claiming the path while this one stops: the path lingers
    unlistened once the socket closes), and removing it would leave that server unreachable."""

    def __init__(self, path: str):
        self.path = path
        found = os.lstat(path)
        self._identity = (found.st_dev, found.st_ino)

    def remove(self) -> None:
        try:
            found = os.lstat(self.path)
        except FileNotFoundError:
            return
        if (found.st_dev, found.st_ino) == self._identity:
            os.unlink(self.path)


class Connection:
    """One peer. Sessions and handles opened over it belong to it and are freed when it closes
    (`on_close` callbacks)."""

    # Whether the transport counts a reply (stats.reply_out) when it leaves rather than the
    # dispatcher once `send` returns: one that sends later, and may drop it then, says so.
    counts_replies_it_sends = False

    def __init__(self, kind: str):
        self.id = f"{kind}:{next(_ids)}"
        self.lane = kind  # what the stats count its frames and bytes under
        self.closed = False
        self.close_reason = "closed"  # or "idle": a ZeroMQ peer silent past --idle-timeout-s
        self.reply_failed = False  # a reply to it could not be written (bridge.dispatcher logs the first)
        self._close_callbacks = []
        self._close_lock = threading.Lock()

    def send(self, parts: list, buffers: list | None = None) -> None:  # pragma: no cover - each transport implements it
        """Write one reply: `parts` make up one msgpack body (the transport adds its framing);
        `buffers` are the raw buffers of a multipart reply, which only a message-based
        transport (ZeroMQ) carries. Called from any thread."""
        raise NotImplementedError

    @property
    def peer_gone(self) -> bool:
        """The peer is known to read nothing more, so its requests that have not started are
        not run (bridge.dispatcher). Only a transport that can tell says so."""
        return False

    @property
    def has_close_callbacks(self) -> bool:
        """Something (a session, a tensor handle) waits for this connection to close."""
        with self._close_lock:
            return bool(self._close_callbacks)

    def on_close(self, callback) -> None:
        with self._close_lock:
            if self.closed:
                callback(self)
            else:
                self._close_callbacks.append(callback)

    def remove_close_callback(self, callback) -> None:
        """Undo one on_close(callback) not yet run (nothing is left for it to free)."""
        with self._close_lock:
            if callback in self._close_callbacks:
                self._close_callbacks.remove(callback)

    def mark_closed(self, reason: str = "closed") -> None:
        with self._close_lock:
            if self.closed:
                return
            self.closed = True
            self.close_reason = reason
            callbacks, self._close_callbacks = self._close_callbacks, []
        for callback in callbacks:
            callback(self)
