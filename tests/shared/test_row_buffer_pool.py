import torch

from shared.row_buffer_pool import RowBufferPool


def test_reuses_the_smallest_fitting_buffer():
    pool = RowBufferPool(max_idle_bytes=1 << 20)
    small, big = pool.acquire(100), pool.acquire(1000)
    pool.release(small)
    pool.release(big)
    assert pool.in_use_bytes == 0
    again = pool.acquire(50)
    assert again.data_ptr() == small.data_ptr()
    assert pool.acquire(500).data_ptr() == big.data_ptr()


def test_idle_memory_is_bounded():
    pool = RowBufferPool(max_idle_bytes=1500)
    buffers = [pool.acquire(1000) for _ in range(3)]
    for b in buffers:
        pool.release(b)
    assert pool.idle_bytes == 1000 and pool.in_use_bytes == 0


def test_new_buffer_when_none_fits():
    pool = RowBufferPool(max_idle_bytes=1 << 20)
    pool.release(pool.acquire(10))
    buf = pool.acquire(100)
    assert buf.numel() == 100 and buf.dtype == torch.uint8
    assert pool.in_use_bytes == 100
