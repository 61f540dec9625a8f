"""The compile slots are shared fairly (daemon/workers/compile_slots.py): a client holds
one at a time, its other compiles wait in order while other clients take free slots, a
bounded number wait, and a wait given up returns nothing held."""
from __future__ import annotations

import asyncio

import pytest

from daemon.workers.compile_slots import CompileSlots, SlotRefused, client_of


def test_a_client_holds_one_slot_and_others_take_the_rest():
    async def run():
        slots = CompileSlots(2, per_client=1, waiting_per_client=2)
        await slots.acquire("a")
        second_a = asyncio.ensure_future(slots.acquire("a"))
        await asyncio.sleep(0)
        assert not second_a.done() and slots.waiting("a") == 1    # a slot is free, not for a
        await asyncio.wait_for(slots.acquire("b"), 1)              # b takes it at once
        assert (slots.held("a"), slots.held("b")) == (1, 1)
        slots.release("b")                                         # a's turn is still not due
        await asyncio.sleep(0)
        assert not second_a.done()
        slots.release("a")                                         # now a's second runs
        await asyncio.wait_for(second_a, 1)
        assert slots.held("a") == 1 and slots.waiting("a") == 0
    asyncio.run(run())


def test_a_freed_slot_goes_to_the_oldest_waiter_that_may_take_it():
    async def run():
        slots = CompileSlots(1, per_client=1, waiting_per_client=4)
        await slots.acquire("a")
        order = []

        async def take(client):
            await slots.acquire(client)
            order.append(client)
        tasks = [asyncio.ensure_future(take(c)) for c in ("a", "b", "c")]
        await asyncio.sleep(0)
        for _ in range(3):
            holder = "a" if not order else order[-1]
            slots.release(holder)
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        assert order == ["a", "b", "c"]
        await asyncio.gather(*tasks)
    asyncio.run(run())


def test_the_waiting_compiles_of_a_client_are_bounded():
    async def run():
        slots = CompileSlots(1, per_client=1, waiting_per_client=2)
        await slots.acquire("a")
        waiters = [asyncio.ensure_future(slots.acquire("a")) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(SlotRefused):
            await slots.acquire("a")
        waiter_b = asyncio.ensure_future(slots.acquire("b"))    # another client still waits
        await asyncio.sleep(0)
        assert slots.waiting("b") == 1
        for w in (*waiters, waiter_b):
            w.cancel()
        await asyncio.gather(*waiters, waiter_b, return_exceptions=True)
        assert slots.waiting("a") == slots.waiting("b") == 0
    asyncio.run(run())


def test_a_wait_cancelled_as_its_slot_is_granted_gives_the_slot_back():
    async def run():
        slots = CompileSlots(1)
        await slots.acquire("a")
        waiter = asyncio.ensure_future(slots.acquire("b"))
        await asyncio.sleep(0)
        slots.release("a")              # granted to b ...
        waiter.cancel()                 # ... and cancelled before b ran
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert slots.held("b") == 0
        await asyncio.wait_for(slots.acquire("c"), 1)     # the slot is free again
    asyncio.run(run())


def test_clients_are_told_apart_by_uid_or_address():
    assert client_of(1000, None) == ("uid", 1000)
    assert client_of(None, "192.0.2.7") == ("ip", "192.0.2.7")
    assert client_of(None, "::ffff:192.0.2.7") == ("ip", "192.0.2.7")
    assert client_of(None, "2001:db8:1:2::5") == client_of(None, "2001:db8:1:2:ffff::9") \
        == ("ip", "2001:db8:1:2::/64")
    assert client_of(None, "2001:db8:1:3::5") != client_of(None, "2001:db8:1:2::5")
    assert client_of(None, None) == ("unknown",)
