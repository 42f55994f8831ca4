"""What a harness's inputs came to (accepted per op, refused per error code, ...), printed as a
`FUZZ-STATS {json}` line every so many executions: the runner keeps the last one, and the tests
read it to see that a run got past the envelope checks, not only that it did not crash."""

from __future__ import annotations

import json
import sys
from collections import Counter

STATS_PREFIX = "FUZZ-STATS "
EVERY = 1 << 10


class Tally(Counter):
    def execution(self) -> None:
        """Count one execution; print the tally every EVERY of them."""
        self["executions"] += 1
        if self["executions"] % EVERY == 0:
            print(STATS_PREFIX + json.dumps(dict(self), sort_keys=True), file=sys.stderr, flush=True)
