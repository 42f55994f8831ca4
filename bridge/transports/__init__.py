"""Transports move frames; they know nothing of tensors or ops.

A transport hands each complete request body to `Dispatcher.on_frame(conn, body, received_ns,
release)` and implements `Connection.send(parts)` to write one reply (a list of buffers making
up one msgpack body; the transport adds its framing)."""
