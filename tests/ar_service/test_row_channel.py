"""The engine→service row channel over a real ZMQ ipc socket (no engine needed)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from ar_service.row_channel import RowChannel, RowSender, RowStreamOverflow


@pytest.fixture
def channel(tmp_path):
    channel = RowChannel(f"ipc://{tmp_path}/rows.sock")
    yield channel
    channel.close()


def test_rows_arrive_in_order_per_stream(channel):
    sender = RowSender(channel.endpoint)
    rows = torch.randn(5, 4)

    async def scenario():
        a = channel.open_stream("a", 1 << 20)
        b = channel.open_stream("b", 1 << 20)
        sender.send("a", 0, rows[:3])
        sender.send("b", 0, rows[:1])
        sender.send("a", 3, rows[3:], final=True, total_rows=5)
        got_a = [await a.next(5), await a.next(5)]
        got_b = await b.next(5)
        return got_a, got_b

    got_a, got_b = asyncio.run(scenario())
    assert [c.start for c in got_a] == [0, 3] and got_a[1].final and got_a[1].total_rows == 5
    assert torch.equal(torch.cat([c.rows for c in got_a]), rows)
    assert torch.equal(got_b.rows, rows[:1])
    sender.close()


def test_slow_consumer_fails_its_stream_only(channel):
    sender = RowSender(channel.endpoint)

    async def scenario():
        slow = channel.open_stream("slow", max_buffered_bytes=64)
        other = channel.open_stream("other", 1 << 20)
        sender.send("slow", 0, torch.zeros(4, 8))  # 128 bytes > 64: over the bound
        sender.send("other", 0, torch.ones(1, 8))
        with pytest.raises(RowStreamOverflow):
            await slow.next(5)
        return await other.next(5)

    assert torch.equal(asyncio.run(scenario()).rows, torch.ones(1, 8))
    sender.close()


def test_chunks_for_closed_streams_are_counted_and_dropped(channel):
    sender = RowSender(channel.endpoint)

    async def scenario():
        stream = channel.open_stream("gone", 1 << 20)
        channel.close_stream("gone")
        sender.send("gone", 0, torch.zeros(1, 8))
        for _ in range(100):
            if channel.late_chunks:
                break
            await asyncio.sleep(0.01)
        return stream

    asyncio.run(scenario())
    assert channel.late_chunks == 1 and channel.open_streams == 0
    sender.close()
