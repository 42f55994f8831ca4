"""The receive buffers' pool: what it keeps committed once the frames are answered."""

from __future__ import annotations

from bridge.buffers import MAX_POOLED_BUFFER, MAX_POOLED_BYTES, BufferPool


def test_the_pool_keeps_what_operations_md_says():
    assert (MAX_POOLED_BYTES, MAX_POOLED_BUFFER) == (128 << 20, 32 << 20)


def test_a_buffer_is_reused_once_given_back():
    pool = BufferPool()
    view, release = pool.acquire(100_000)
    address = view.obj
    release()
    again, _ = pool.acquire(90_000)
    assert again.obj is address and len(again) == 90_000


def test_a_frame_larger_than_a_pooled_buffer_keeps_no_memory_once_answered():
    """Four clients' 120 MiB frames left 480 MiB committed in an idle server for good (found
    in review): a buffer past MAX_POOLED_BUFFER is unmapped when given back."""
    pool = BufferPool(max_buffers=32)
    releases = [pool.acquire(MAX_POOLED_BUFFER + 1)[1] for _ in range(4)]
    for release in releases:
        release()
    assert pool._free == []


def test_the_pool_keeps_at_most_its_bytes_however_many_buffers_it_may_hold():
    pool = BufferPool(max_buffers=32)
    size = MAX_POOLED_BUFFER
    releases = [pool.acquire(size)[1] for _ in range(MAX_POOLED_BYTES // size + 2)]
    for release in releases:
        release()
    assert sum(map(len, pool._free)) == MAX_POOLED_BYTES
