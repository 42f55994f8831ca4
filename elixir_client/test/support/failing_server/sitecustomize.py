"""A failure injected into a real server that an Elixir test starts with this folder on its
PYTHONPATH (the interpreter imports sitecustomize at start), as tests/test_torn_state.py injects
one in-process: where SCAN_BRIDGE_TEST_FAIL_PARTWAY names a file, the next model step that finds
that file removes it and fails at its second layer, once the first has written its state (out of
memory), so that the session's state is lost (SPEC §6.1). The file holds how many seconds to wait
before failing (empty: none), for a caller's deadline to pass first. The server must take the
composed step (--backend torch --no-native-step)."""

import os
import time

_TRIGGER = os.environ.get("SCAN_BRIDGE_TEST_FAIL_PARTWAY")

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
