"""Transports move frames; they know nothing of tensors or ops.

A transport hands each complete request body to `Dispatcher.on_frame(conn, body, received_ns,
release)` and implements `Connection.send(parts, buffers)` to write one reply (a list of
buffers making up one msgpack body, the transport adding its framing; plus, for a multipart
reply, the raw buffers its tensors refer to). Lanes: `stdio` (the BEAM Port), `unix` (the same
framing on a unix socket, many connections), `zmq` (ROUTER sockets, one message per body)."""
