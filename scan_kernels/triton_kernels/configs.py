"""Block sizes of the Triton kernels and how the scan splits a sequence: one table, no autotuning.

Neither kernel is autotuned. The state update writes its state in place, so an autotuner's
trial launches would apply the timestep several times; the scan could be tuned, but a tuning
run on the first request is exactly the JIT stall `warmup` exists to avoid, and a table is
reproducible. The tables are keyed by BLOCK_N, the state size rounded up to a power of two
(Triton tiles are powers of two; the padded lanes are masked).

The sizes below are reasoned from register budgets and checked by compiling for sm_90 without a
GPU (`python -m scan_kernels.triton_kernels.aot_check`: registers per thread, no spills); the SSD
scan's were also timed against other tiles on an H200 (`bench.ssd_tune`), the others have not
been timed on a GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..errors import KernelInputError
from .common import cdiv, next_power_of_2


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
    block_n = next_power_of_2(state)
    for limit, blocks in table:
        if block_n <= limit:
            return block_n, blocks
    raise KernelInputError("A", f"a state size <= {MAX_STATE} (Triton backend)", f"state size {state}")


def scan_blocks(state: int, dim_per_group: int) -> tuple[int, ScanBlocks]:
    """(BLOCK_N, blocks) for a scan; block_d shrinks to the channels of one group when a group is
    narrower than the table's block, so no program is mostly padding."""
    block_n, blocks = _lookup(SCAN_TABLE, state)
    block_d = min(blocks.block_d, next_power_of_2(dim_per_group))
    return block_n, ScanBlocks(block_d, blocks.chunk, blocks.num_warps)


def update_blocks(state: int, dim_per_group: int) -> tuple[int, UpdateBlocks]:
    block_n, blocks = _lookup(UPDATE_TABLE, state)
    block_d = min(blocks.block_d, next_power_of_2(dim_per_group))
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
    wanted = cdiv(SEGMENT_WAVES * sm_count, programs_per_segment)
    segments = max(1, min(wanted, MAX_SEGMENTS, n_tiles // MIN_SEGMENT_TILES))
    return cdiv(n_tiles, segments)


# --- Mamba-2 (SSD) -----------------------------------------------------------------------------


@dataclass(frozen=True)
class SsdBlocks:
    block_m: int  # chunk positions per program: rows of y and of C.B^T
    block_k: int  # timesteps per step of the loops over a chunk: the dots' inner axis over time
    block_p: int  # headdim channels per program
    block_n: int  # state entries per program (chunk states) or per step (the dots over the state)
    num_warps: int


# The chunk the scan takes when the caller names none: half mamba_ssm's 256, which ran slower
# on an H200 at the 130m layer in fp32 and bf16 alike (docs/performance.md, "Triton SSD tiles").
SSD_CHUNK = 128
# tl.dot on a GPU needs every block dimension >= 16, so each is padded (masked) to at least this.
MIN_DOT_BLOCK = 16
# Keyed by the dtype the dots multiply in (ssd.py). 16-bit operands go to tensor cores: 64 x 64
# output tiles over 4 warps, time steps of 32 (64 made ptxas spill the chunk scan at headdim
# <= 32). fp32 ones go there too through tf32x3, whose split operands take registers: at 64 x 64
# the chunk scan spills, at 32 x 32 it does not. fp64 dots run on FMA units, where each thread
# holds its rows and columns of both operands across the whole inner axis: 32 x 32 tiles keep
# every kernel under 255 registers without spills. Timed against other tiles by `bench.ssd_tune`
# on an H200 (docs/performance.md, "Triton SSD tiles").
SSD_BLOCKS = {
    torch.float16: SsdBlocks(block_m=64, block_k=32, block_p=64, block_n=64, num_warps=4),
    torch.bfloat16: SsdBlocks(block_m=64, block_k=32, block_p=64, block_n=64, num_warps=4),
    torch.float32: SsdBlocks(block_m=32, block_k=32, block_p=32, block_n=32, num_warps=4),
    torch.float64: SsdBlocks(block_m=32, block_k=32, block_p=32, block_n=32, num_warps=4),
}
# tl.dot's input_precision for fp32 operands: "ieee" (FMA units), or "tf32x3" (tensor cores,
# each operand split into a tf32 high and low part and three products summed: about fp32's
# accuracy), which ran the 130m layer's chunk scan faster on an H200 (docs/performance.md,
# "Triton SSD tiles"). The interpreter multiplies in IEEE fp32 whatever this says.
SSD_FP32_DOT = "tf32x3"
# Elements per program of the chunk cumsum and of the state passing (no dots: plain registers).
SSD_ELEMENTWISE_BLOCK = 2048


def _dot_block(limit: int, size: int) -> int:
    return max(MIN_DOT_BLOCK, min(limit, next_power_of_2(size)))


def ssd_blocks(headdim: int, state: int, chunk: int, dot: torch.dtype, blocks: SsdBlocks | None = None) -> SsdBlocks:
    """The table's blocks for dots in `dot` (or `blocks`, which tests shrink), each cut down to
    its axis rounded up to a power of two, but never below MIN_DOT_BLOCK, so no program is mostly
    padding."""
    blocks = blocks or SSD_BLOCKS[dot]
    return SsdBlocks(block_m=_dot_block(blocks.block_m, chunk), block_k=_dot_block(blocks.block_k, chunk),
                     block_p=_dot_block(blocks.block_p, headdim), block_n=_dot_block(blocks.block_n, state),
                     num_warps=blocks.num_warps)


@dataclass(frozen=True)
class SsdUpdateBlocks:
    block_p: int  # headdim channels per program (power of two)
    block_n: int  # state entries per step of the program's loop over the state (power of two)
    num_warps: int


# One decode step streams each head's [headdim, state] state in and out once, so it is bound by
# memory like the Mamba-1 update and takes its budget (UPDATE_TABLE): ~512 state values per
# program over 4 warps, many programs in flight at small batch. The state axis is whole up to
# 256 (one step of the program's loop), headdim cut to fit.
SSD_UPDATE_VALUES = 512
SSD_UPDATE_MAX_BLOCK_N = 256
SSD_UPDATE_WARPS = 4


def ssd_update_blocks(headdim: int, state: int) -> SsdUpdateBlocks:
    block_n = min(next_power_of_2(state), SSD_UPDATE_MAX_BLOCK_N)
    block_p = min(next_power_of_2(headdim), max(1, SSD_UPDATE_VALUES // block_n))
    return SsdUpdateBlocks(block_p, block_n, SSD_UPDATE_WARPS)
