"""The blocking ``Client`` offers exactly ``AsyncClient``'s public API (most of it forwarded by
``jpfs.client.blocking.FORWARDED``), so the two cannot drift apart unnoticed."""

from __future__ import annotations

import inspect

from jpfs.client import blocking
from jpfs.client.blocking import Client
from jpfs.client.client import AsyncClient

BLOCKING_ONLY = {
    "run": "runs any coroutine on the client's loop",
    "aclient": "the AsyncClient behind it",
}
ASYNC_ONLY = {
    # an async iterator cannot be forwarded as a call; Client.scandir and Client.walk cover it
    "iterdir": "async iterator",
}


def _public(cls) -> dict[str, object]:
    return {n: v for n, v in vars(cls).items()
            if not n.startswith("_") and (callable(v) or isinstance(v, property))}


def test_client_has_exactly_the_async_clients_public_api():
    a, b = _public(AsyncClient), _public(Client)
    assert set(a) - set(b) == set(ASYNC_ONLY), "AsyncClient methods missing from Client " \
        "(add them to blocking.FORWARDED)"
    assert set(b) - set(a) == set(BLOCKING_ONLY), "Client methods AsyncClient does not have"


def test_forwarded_methods_are_real_coroutines_with_their_docs():
    forwarded = blocking.FORWARDED
    assert len(forwarded) == len(set(forwarded)), "a name forwarded twice"
    for name in forwarded:
        target = getattr(AsyncClient, name)
        assert inspect.iscoroutinefunction(target), f"{name}: not an async method"
        assert getattr(Client, name).__doc__ == target.__doc__, name
    # what is not forwarded is written by hand in Client, not silently missing
    hand_written = set(_public(AsyncClient)) - set(forwarded) - set(ASYNC_ONLY)
    for name in hand_written:
        assert name in vars(Client), f"{name}: neither forwarded nor written in Client"
