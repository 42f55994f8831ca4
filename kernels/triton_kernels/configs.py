"""Block sizes of the Triton kernels and how the scan splits a sequence: one table, no autotuning.

Neither kernel is autotuned. The state update writes its state in place, so an autotuner's
trial launches would apply the timestep several times; the scan could be tuned, but a tuning
run on the first request is exactly the JIT stall `warmup` exists to avoid, and a table is
reproducible. The tables are keyed by BLOCK_N, the state size rounded up to a power of two
(Triton tiles are powers of two; the padded lanes are masked).

The sizes below are reasoned from register budgets and checked by compiling for sm_90 without a
GPU (`python -m kernels.triton_kernels.aot_check`: registers per thread, no spills); they have not
been timed on a GPU (the session that wrote them had none), which is open work.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from ..errors import KernelInputError


@dataclass(frozen=True)
class ScanBlocks:
    block_d: int  # channels per program (power of two)
    chunk: int  # timesteps per tile; the associative scan runs over this axis (power of two)
    num_warps: int


# Scan: per tile a program holds decay, input and state tensors of chunk x block_d x BLOCK_N fp32
# values, plus the scan's temporaries. Every row keeps a tile at 4096 values over 8 warps, i.e.
# 16 values per thread per tensor: compiled for sm_90 (ptxas -v, no GPU needed) that is ~80
# registers per thread and no spills for the n=16 output kernel, where 4 warps (32 values per
# thread) took 128-160 registers and spilled, which caps occupancy at ~12 warps per SM for a
# memory-bound kernel. Chunk 16 keeps the scan's log-depth (4 levels) short per step and the
# loop trip count low; the channels take what is left (wider rows also coalesce better in the
# "bld" layout). Beyond BLOCK_N 256 the chunk shrinks instead, down to 4 at BLOCK_N 1024.
#            BLOCK_N  block_d  chunk  warps
SCAN_TABLE = (
    (4, ScanBlocks(64, 16, 8)),
    (8, ScanBlocks(32, 16, 8)),
    (16, ScanBlocks(16, 16, 8)),
    (32, ScanBlocks(8, 16, 8)),
    (64, ScanBlocks(4, 16, 8)),
    (128, ScanBlocks(2, 16, 8)),
    (256, ScanBlocks(1, 16, 8)),
    (512, ScanBlocks(1, 8, 8)),
    (1024, ScanBlocks(1, 4, 8)),
)


@dataclass(frozen=True)
class UpdateBlocks:
    block_d: int  # channels per program (power of two)
    num_warps: int


# State update: one timestep, so a program only streams its block_d x BLOCK_N slice of the
# state in and out (the traffic that bounds this kernel). ~512 state values per program over
# 4 warps (4 per thread) keeps enough programs in flight to hide memory latency at small batch
# (dim 512, state 16: 16 programs per row, 512 for a batch of 32) without starving a program of
# work at large state sizes.
#              BLOCK_N  block_d  warps
UPDATE_TABLE = (
    (16, UpdateBlocks(32, 4)),
    (32, UpdateBlocks(16, 4)),
    (64, UpdateBlocks(8, 4)),
    (128, UpdateBlocks(4, 4)),
    (256, UpdateBlocks(4, 8)),
    (1024, UpdateBlocks(1, 8)),
)

# Largest state size the tables cover: beyond it a single channel's state no longer fits a
# program's registers and the kernels would need a split of the state axis.
MAX_STATE = SCAN_TABLE[-1][0]


def _lookup(table, state: int):
    block_n = triton.next_power_of_2(state)
    for limit, blocks in table:
        if block_n <= limit:
            return block_n, blocks
    raise KernelInputError("A", f"a state size <= {MAX_STATE} (Triton backend)", f"state size {state}")


def scan_blocks(state: int, dim_per_group: int) -> tuple[int, ScanBlocks]:
    """(BLOCK_N, blocks) for a scan; block_d shrinks to the channels of one group when a group is
    narrower than the table's block, so no program is mostly padding."""
    block_n, blocks = _lookup(SCAN_TABLE, state)
    block_d = min(blocks.block_d, triton.next_power_of_2(dim_per_group))
    return block_n, ScanBlocks(block_d, blocks.chunk, blocks.num_warps)


def update_blocks(state: int, dim_per_group: int) -> tuple[int, UpdateBlocks]:
    block_n, blocks = _lookup(UPDATE_TABLE, state)
    block_d = min(blocks.block_d, triton.next_power_of_2(dim_per_group))
    return block_n, UpdateBlocks(block_d, blocks.num_warps)


# Sequence split of the scan. With batch x groups x channel blocks programs alone, batch 1 with
# a long sequence would run a few dozen programs on a 132-SM GPU; splitting the sequence into
# segments multiplies the programs. Aim for SEGMENT_WAVES programs per SM; more segments than
# that only adds carry traffic. Each segment program first folds the carries of all segments
# before it (see scan.py), a cost linear in its index, so segments are capped at MAX_SEGMENTS
# and kept at least MIN_SEGMENT_TILES tiles long: the look-back of the last segment then costs
# at most about as much as its own scan.
SEGMENT_WAVES = 2
MAX_SEGMENTS = 32
MIN_SEGMENT_TILES = 2


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def segment_tiles(n_tiles: int, programs_per_segment: int, device: torch.device) -> int:
    """Tiles per sequence segment for a scan of `n_tiles` tiles whose grid has
    `programs_per_segment` programs for each segment."""
    if device.type != "cuda":
        # The interpreter runs programs one after another: splitting buys nothing.
        return n_tiles
    index = device.index if device.index is not None else torch.cuda.current_device()
    return tiles_per_segment(n_tiles, programs_per_segment, _sm_count(index))


def tiles_per_segment(n_tiles: int, programs_per_segment: int, sm_count: int) -> int:
    wanted = triton.cdiv(SEGMENT_WAVES * sm_count, programs_per_segment)
    segments = max(1, min(wanted, MAX_SEGMENTS, n_tiles // MIN_SEGMENT_TILES))
    return triton.cdiv(n_tiles, segments)
