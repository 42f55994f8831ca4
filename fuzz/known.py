"""Findings the harnesses made that are not fixed yet, each with the input that shows it.

A harness that hits one of these counts it (FUZZ-STATS "known <name>") rather than stopping, so
that a long run goes on looking for others; the runner's results report the count. Each is
also a strict-xfail regression test (tests/test_fuzz.py), which fails (XPASS) once the bug is
fixed: then delete its entry here and the test's mark.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class KnownFinding:
    name: str
    exception: type[BaseException]
    # The repository file and function whose frame is the innermost Python one of the raise.
    file: str
    function: str
    reproducer: bytes
    summary: str


# None open: the first (limits-not-utf8, Reader.limits decoding outside Reader._decode) is fixed
# and has its regression test in tests/test_fuzz.py.
KNOWN: tuple[KnownFinding, ...] = ()


def match(exc: BaseException) -> KnownFinding | None:
    """The known finding `exc` is an instance of, else None."""
    tb, last = exc.__traceback__, None
    while tb is not None:
        last = tb.tb_frame
        tb = tb.tb_next
    if last is None:
        return None
    path = Path(last.f_code.co_filename).resolve()
    for known in KNOWN:
        if isinstance(exc, known.exception) and path == ROOT / known.file and last.f_code.co_name == known.function:
            return known
    return None


def count_or_raise(exc: BaseException, tally) -> None:
    """Count `exc` in `tally` when it is a known finding; raise it again when it is not."""
    found = match(exc)
    if found is None:
        raise exc
    tally["known " + found.name] += 1
