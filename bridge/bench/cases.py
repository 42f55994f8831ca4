"""The payload sweep: one 32×512×16 `step`, then `scan` windows of ExPhil's shape (batch 32,
dim 512, state 16, layout bld) growing in sequence length through ExPhil's own window (seq 60,
8.1 MB in, 3.9 MB out) up to a ~64 MB request (seq 496)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BATCH, DIM, STATE = 32, 512, 16
EXPHIL_SEQ = 60
# ExPhil's dt clamp (protocol/SPEC.md §9); Case.inputs draws dt within it.
DT_CLAMP = {"dt_min": 0.001, "dt_max": 0.1}
# The largest window whose scan request stays under 64 MiB: 135,168 bytes per timestep (x and dt
# [32, 512] f32, B and C [32, 16] f32) plus A [512, 16] and the msgpack envelope.
LARGEST_SEQ = 496

DEFAULT_SIZES = "step,4,15,60,240,496"
QUICK_SIZES = "step,15,60,496"


@dataclass(frozen=True)
class Case:
    """One payload of the sweep: `op` "step" (one timestep against a session) or "scan" (a
    whole window of `seq` timesteps)."""

    op: str
    seq: int
    batch: int = BATCH
    dim: int = DIM
    state: int = STATE

    @property
    def name(self) -> str:
        return "step" if self.op == "step" else f"scan L={self.seq}"

    @property
    def label(self) -> str:
        """Its shape as a person reads it, for tables and plots."""
        if self.op == "step":
            return f"step {self.batch}×{self.dim}×{self.state}"
        tag = " (ExPhil)" if self.is_exphil_window else ""
        return f"scan {self.batch}×{self.seq}×{self.dim}×{self.state}{tag}"

    @property
    def is_exphil_window(self) -> bool:
        return self.op == "scan" and (self.batch, self.seq, self.dim, self.state) == (BATCH, EXPHIL_SEQ, DIM, STATE)

    def inputs(self, seed: int) -> dict[str, np.ndarray]:
        """Random f32 inputs in the ranges a Mamba layer produces: dt within ExPhil's clamp
        (DT_CLAMP) and A negative, so every server computes the same finite result."""
        rng = np.random.default_rng(seed)
        lead = (self.batch,) if self.op == "step" else (self.batch, self.seq)
        return {
            "x": rng.standard_normal((*lead, self.dim), dtype=np.float32),
            "dt": rng.uniform(DT_CLAMP["dt_min"], DT_CLAMP["dt_max"], (*lead, self.dim)).astype(np.float32),
            "A": -rng.uniform(0.5, 4.0, (self.dim, self.state)).astype(np.float32),
            "B": rng.standard_normal((*lead, self.state), dtype=np.float32),
            "C": rng.standard_normal((*lead, self.state), dtype=np.float32),
        }

    def as_window(self) -> "Case":
        """The scan a client without sessions sends for this payload: a step is a window of
        one timestep (what ExPhil's client does)."""
        return Case("scan", 1, self.batch, self.dim, self.state) if self.op == "step" else self


def parse_sizes(text: str) -> list[Case]:
    """"step,15,60" → [step, scan L=15, scan L=60]: "step" or a sequence length per item, in
    the order given, no repeats."""
    cases: list[Case] = []
    for token in (t.strip() for t in text.split(",")):
        if token == "step":
            case = Case("step", 1)
        elif token.isdigit() and int(token) > 0:
            case = Case("scan", int(token))
        else:
            raise ValueError(f"--sizes: expected 'step' or a positive sequence length per "
                             f"comma-separated item, got {token!r} in {text!r}")
        if case in cases:
            raise ValueError(f"--sizes: expected each size once, got {token!r} twice in {text!r}")
        cases.append(case)
    return cases
