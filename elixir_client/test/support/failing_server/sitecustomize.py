"""Failures injected into a real server that an Elixir test starts with this folder on its
PYTHONPATH (the interpreter imports sitecustomize at start), as tests/test_torn_state.py injects
them in-process. The server must take the composed step (--backend torch --no-native-step).

- Where SCAN_BRIDGE_TEST_FAIL_PARTWAY names a file, the next model step that finds that file
  removes it and fails at its second layer, once the first has written its state (out of
  memory), so that the session's state is lost (SPEC §6.1). The file holds how many seconds to
  wait before failing (empty: none), for a caller's deadline to pass first.
- Where SCAN_BRIDGE_TEST_FAIL_SNAPSHOT_COPY names a file, the next copy into a snapshot by a
  model step's `snapshot_into` that finds that file removes it and fails before the step writes
  the session: the session is as it was, the snapshot undefined (SPEC §6.4)."""

import os
import time

_TRIGGER = os.environ.get("SCAN_BRIDGE_TEST_FAIL_PARTWAY")
_COPY_TRIGGER = os.environ.get("SCAN_BRIDGE_TEST_FAIL_SNAPSHOT_COPY")

if _TRIGGER:
    from bridge.models.runtime import Model

    _mixer_step = Model._mixer_step

    def _failing_at_the_second_layer(self, layer, h, *args):
        if layer is self.layers[1] and os.path.exists(_TRIGGER):
            with open(_TRIGGER) as trigger:
                delay = float(trigger.read() or 0)
            os.remove(_TRIGGER)
            time.sleep(delay)
            raise MemoryError("no room for the second layer's activations (injected by a test)")
        return _mixer_step(self, layer, h, *args)

    Model._mixer_step = _failing_at_the_second_layer

if _COPY_TRIGGER:
    from bridge.sessions import Session, Snapshot

    _take_again = Snapshot.take_again
    _read_rows_into = Session.read_rows_into

    def _failing_read(self, rows):
        raise MemoryError("no room to copy the session into the snapshot (injected by a test)")

    # The copy fails inside the real take_again, so that its own bookkeeping marks the snapshot.
    def _failing_copy(self, session):
        if not os.path.exists(_COPY_TRIGGER):
            return _take_again(self, session)
        os.remove(_COPY_TRIGGER)
        Session.read_rows_into = _failing_read
        try:
            return _take_again(self, session)
        finally:
            Session.read_rows_into = _read_rows_into

    Snapshot.take_again = _failing_copy
