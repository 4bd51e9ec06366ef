"""cacheblend_rag.concurrency: awaiting blocking calls from an event loop."""

from __future__ import annotations

import asyncio

import pytest

from cacheblend_rag.concurrency import run_in_thread


def test_run_in_thread_returns_and_raises_what_the_call_does():
    def fails():
        raise KeyError("the call's own error")

    async def main():
        assert await run_in_thread(lambda x: x + 1, 41) == 42
        with pytest.raises(KeyError, match="the call's own error"):
            await asyncio.wait_for(run_in_thread(fails), timeout=10)  # before the fix: a hang, not an error

    asyncio.run(main())
