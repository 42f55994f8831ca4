"""What the benchmark prints: a progress bar while it measures, then the tables."""

from __future__ import annotations

import sys
import time

from .measure import FRAME_BUDGET_60FPS_US, STAGES

STAGE_HEADINGS = {"client_encode": "c.enc", "server_decode": "s.dec", "queue": "queue", "h2d": "h2d",
                  "kernel": "kernel", "d2h": "d2h", "server_encode": "s.enc", "server_other": "s.other",
                  "client_decode": "c.dec", "transport": "transport"}


class Progress:
    """A one-line bar on a terminal (redrawn at most 10 times a second); silent elsewhere, so
    logs of non-interactive runs hold only the tables."""

    def __init__(self, total: int, stream=None, enabled: bool | None = None, width: int = 30):
        self.total = max(total, 1)
        self.done = 0
        self.label = ""
        self.stream = sys.stderr if stream is None else stream
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.width = width
        self._drawn_at = 0.0

    def start(self, label: str) -> None:
        self.label = label
        self._draw(force=True)

    def advance(self, n: int = 1) -> None:
        self.done = min(self.done + n, self.total)
        self._draw()

    def skip_to(self, done: int) -> None:
        """Jump past work not done (a case cut short by its time cap)."""
        self.done = min(max(self.done, done), self.total)
        self._draw(force=True)

    def finish(self) -> None:
        if self.enabled:
            self.stream.write("\r\033[K")
            self.stream.flush()

    def _draw(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self._drawn_at < 0.1):
            return
        self._drawn_at = now
        filled = int(self.width * self.done / self.total)
        bar = "█" * filled + "·" * (self.width - filled)
        self.stream.write(f"\r\033[K[{bar}] {100 * self.done / self.total:3.0f}%  {self.label}")
        self.stream.flush()


def fmt_us(us: float | None) -> str:
    if us is None:
        return "—"
    if abs(us) < 1000:
        return f"{us:.0f}µs"
    if abs(us) < 10_000:
        return f"{us / 1000:.2f}ms"
    return f"{us / 1000:.1f}ms"


def fmt_ratio(ratio: float | None) -> str:
    return "—" if ratio is None else f"{ratio:.2f}×"


def results_table(rows: list[dict], labels: dict[str, str]) -> str:
    """Per transport, backend and device: a line per case with sizes, the round trip (p50,
    p99), the p50 of every stage, the floor and the transport's cost over it."""
    head = (f"{'case':<30}{'in MB':>7}{'out MB':>7}{'rt p50':>9}{'rt p99':>9} |"
            + "".join(f"{STAGE_HEADINGS[s]:>{max(len(STAGE_HEADINGS[s]), 7) + 1}}" for s in STAGES)
            + f" |{'floor':>9}{'ipc/floor':>10}")
    out = []
    groups = dict.fromkeys((r["transport"], r["backend"], r["device"]) for r in rows)
    for transport, backend, device in groups:
        out.append(f"\n{transport} · backend {backend} · device {device}   "
                   f"(p50 of each stage; stages add up to the round trip, percentiles do not)")
        out.append(head)
        for r in rows:
            if (r["transport"], r["backend"], r["device"]) != (transport, backend, device):
                continue
            line = (f"{labels.get(r['case'], r['case']):<30}{r['request_bytes'] / 1e6:>7.2f}{r['reply_bytes'] / 1e6:>7.2f}"
                    f"{fmt_us(r['round_trip_p50_us']):>9}{fmt_us(r['round_trip_p99_us']):>9} |")
            for s in STAGES:
                line += f"{fmt_us(r[f'{s}_p50_us']):>{max(len(STAGE_HEADINGS[s]), 7) + 1}}"
            line += f" |{fmt_us(r['floor_p50_us']):>9}{fmt_ratio(r['ipc_over_floor_ratio']):>10}"
            out.append(line)
    return "\n".join(out)


def fits_table(fits: list[dict]) -> str:
    if not fits:
        return "\nlatency ≈ a + b·bytes: needs at least two sizes"
    out = ["\nlatency ≈ a + b·bytes (p50s; bytes = request + reply frames; fit on relative error)"]
    for f in fits:
        bandwidth = "—" if f["bandwidth_gb_per_s"] is None else f"{f['bandwidth_gb_per_s']:.2f} GB/s"
        out.append(f"  {f['transport']:<9}{f['backend']:<10}{f['measure']:<10} a = {fmt_us(f['intercept_us']):>8}"
                   f"   b = {f['slope_us_per_mb'] / 1000:6.3f} ms/MB ({bandwidth})"
                   f"   worst point off by {100 * f['max_error_ratio']:.0f}%")
    return "\n".join(out)


def frame_budget_table(rows: list[dict], step_case: str | None, window_case: str | None,
                       labels: dict[str, str]) -> str:
    """Whether a step and the ExPhil window fit a 60 FPS frame, judged on the p99 round trip."""
    wanted = [c for c in (step_case, window_case) if c]
    if not wanted:
        return "\n60 FPS frame: the sweep has neither the step nor the ExPhil window"
    out = [f"\n60 FPS frame ({FRAME_BUDGET_60FPS_US / 1000:.1f} ms), judged on the p99 round trip "
           "(of n round trips; under 100 that is about the slowest)"]
    groups = dict.fromkeys((r["transport"], r["backend"]) for r in rows)
    for transport, backend in groups:
        verdicts = []
        for case in wanted:
            row = next((r for r in rows if (r["transport"], r["backend"], r["case"]) == (transport, backend, case)), None)
            if row is not None:
                verdict = "fits" if row["fits_60fps"] else "does NOT fit"
                verdicts.append(f"{labels.get(case, case)} {fmt_us(row['round_trip_p99_us'])} "
                                f"(n={row['iterations']}) {verdict}")
        out.append(f"  {transport:<9}{backend:<10}" + ";  ".join(verdicts))
    return "\n".join(out)


def baseline_table(command: str, rows: list[dict]) -> str:
    out = [f"\nbaseline: {command}  vs  python -m bridge — ExPhil-format requests over pipes, one at a time"]
    for r in rows:
        agree = "" if r["results_agree"] else "   RESULTS DIFFER"
        out.append(f"  {r['case']:<12}{r['request_bytes'] / 1e6:>7.2f} MB   bridge ({r['backend']}) p50 "
                   f"{fmt_us(r['bridge_p50_us']):>8}"
                   f"   baseline p50 {fmt_us(r['baseline_p50_us']):>8}   baseline / bridge = "
                   f"{fmt_ratio(r['baseline_over_bridge_ratio'])}{agree}")
    return "\n".join(out)
