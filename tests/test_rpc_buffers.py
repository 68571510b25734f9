"""The rpc server's reused payload buffers (``rpc.service.PayloadBuffers``): never shared while
a handler, or work it queued, may still read one."""

from __future__ import annotations

import errno
import os
from typing import NamedTuple

import trio

from jpfs.errors import DeadlineError, JPFSError
from jpfs.rpc import Handler, Method, Pool, Service, method_table, serve

SECRET = b"s3cret"


class Keep(NamedTuple):
    seconds: float


async def test_recycled_payload_buffers_are_never_shared_while_in_use(nursery):
    """A payload method whose handler recycles its payload: payloads of many sizes, sent at
    once, each seen whole and unchanged by its own handler; a handler cancelled by its
    deadline, or failing, keeps its buffer out of reuse (work it queued may still read it), and
    buffers are reused once handlers returned."""
    table = method_table(Method(1, "hold", Keep, bytes, payload=True))
    damaged: list[int] = []
    left_behind: list[tuple[bytes, memoryview]] = []

    async def hold(seconds: float, payload: memoryview) -> bytes:
        digest = bytes(payload[:32])
        kept = payload[:32]  # what a put queued to the group commit would still read
        await trio.sleep(seconds)
        if bytes(payload[:32]) != digest:
            damaged.append(len(payload))
        if seconds > 0.3:
            left_behind.append((digest, kept))
            raise JPFSError(errno.EIO, "failed after its payload was handed on")
        return digest

    async def held(seconds: float, payload: memoryview) -> bytes:
        try:
            return await hold(seconds, payload)
        except trio.Cancelled:  # by its deadline: what it queued may still read its payload
            left_behind.append((bytes(payload[:32]), payload[:32]))
            raise

    service = Service("test", table, {table["hold"]: Handler(held, recycles=True)})
    port = await nursery.start(serve, service, "127.0.0.1", 0, SECRET)
    pool = Pool(nursery, [f"127.0.0.1:{port}"], SECRET, role="test", retry_for=2.0)
    try:
        async def one(i: int) -> None:
            data = os.urandom((64 << 10) + i * 37_000)
            seconds = [0.001, 0.05, 0.5, 2.0][i % 4]
            try:
                got = await pool.call(0, table["hold"], [seconds], payload=[data],
                                      timeout=1.0)
            except (DeadlineError, JPFSError):
                assert seconds > 0.3  # cancelled by its deadline, or failed
                return
            assert got == data[:32]

        for _ in range(3):
            async with trio.open_nursery() as n:
                for i in range(40):
                    n.start_soon(one, i)
        await trio.sleep(2.5)  # the cancelled handlers' leftovers finish reading
        assert left_behind  # some were cancelled or failed
        for digest, kept in left_behind:  # no later request was received into their buffers
            assert bytes(kept) == digest
        assert not damaged
        assert service.buffers.stats["reused"] > 0
    finally:
        pool.close()
