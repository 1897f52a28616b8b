"""The engine→service row channel over a real ZMQ ipc socket (no engine needed)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from ar_service.engine.row_channel import RowChannel, RowQueueOverflow, RowSender
from tests.support.waiting import until


@pytest.fixture
def channel(tmp_path):
    channel = RowChannel(f"ipc://{tmp_path}/rows.sock")
    yield channel
    channel.close()


def test_rows_arrive_in_order_per_request(channel):
    sender = RowSender(channel.endpoint)
    rows = torch.randn(5, 4)

    async def scenario():
        a = channel.open_queue("a", 1 << 20)
        b = channel.open_queue("b", 1 << 20)
        sender.send("a", 0, rows[:3])
        sender.send("b", 0, rows[:1])
        sender.send("a", 3, rows[3:], final=True)
        got_a = [await a.next(5), await a.next(5)]
        got_b = await b.next(5)
        return got_a, got_b

    got_a, got_b = asyncio.run(scenario())
    assert [c.start for c in got_a] == [0, 3] and got_a[1].final
    assert torch.equal(torch.cat([c.rows for c in got_a]), rows)
    assert torch.equal(got_b.rows, rows[:1])
    sender.close()


def test_slow_consumer_fails_its_request_only(channel):
    sender = RowSender(channel.endpoint)

    async def scenario():
        slow = channel.open_queue("slow", max_buffered_bytes=64)
        other = channel.open_queue("other", 1 << 20)
        sender.send("slow", 0, torch.zeros(4, 8))  # 128 bytes > 64: over the bound
        sender.send("other", 0, torch.ones(1, 8))
        with pytest.raises(RowQueueOverflow):
            await slow.next(5)
        return await other.next(5)

    assert torch.equal(asyncio.run(scenario()).rows, torch.ones(1, 8))
    sender.close()


def test_chunks_for_closed_queues_are_counted_and_dropped(channel):
    sender = RowSender(channel.endpoint)

    async def scenario():
        queue = channel.open_queue("gone", 1 << 20)
        channel.close_queue("gone")
        sender.send("gone", 0, torch.zeros(1, 8))
        await until(lambda: channel.late_chunks, what="the chunk for the closed queue arrived")
        return queue

    asyncio.run(scenario())
    assert channel.late_chunks == 1 and channel.open_queues == 0
    sender.close()


def test_a_queue_whose_consumer_loop_is_gone_does_not_stop_the_channel(channel):
    sender = RowSender(channel.endpoint)

    async def orphan():
        channel.open_queue("orphan", 1 << 20)  # its event loop closes when this returns

    async def live():
        queue = channel.open_queue("live", 1 << 20)
        sender.send("orphan", 0, torch.zeros(1, 8))
        sender.send("live", 0, torch.ones(1, 8))
        return await queue.next(5)

    asyncio.run(orphan())
    assert torch.equal(asyncio.run(live()).rows, torch.ones(1, 8))
    sender.close()
