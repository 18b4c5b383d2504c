"""Client-disconnect watching for one request, from admission to the last byte.

Once the body is read, the ASGI ``receive`` channel has nothing left to say
but ``http.disconnect``. One task owns it for the rest of the request, so a
client that leaves while its prompt is classified, while it waits for a swap,
or before the backend sent headers (a non-streaming completion sends none
until generation ends) is noticed at once, and the work done for it is
cancelled, which closes the upstream connection and makes vLLM abort.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

from starlette.types import Receive

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected; what was being done for it was cancelled."""


class DisconnectWatch:
    def __init__(self, receive: Receive):
        self.gone = asyncio.Event()
        self.at: float | None = None
        self._task = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.at = asyncio.get_running_loop().time()
                self.gone.set()
                return

    async def run(self, work: Awaitable[T]) -> T:
        """``await work``, unless the client leaves first: then cancel it and raise ClientGone."""
        if self.gone.is_set():
            if asyncio.iscoroutine(work):
                work.close()
            raise ClientGone()
        task = asyncio.ensure_future(work)
        waiter = asyncio.ensure_future(self.gone.wait())
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # we were cancelled ourselves: take the work down with us
            task.cancel()
            raise
        finally:
            waiter.cancel()
        if task.done():
            return task.result()
        task.cancel()
        try:
            await task
        except BaseException:  # noqa: BLE001 - cancelled work: its outcome no longer matters
            pass
        raise ClientGone()

    def close(self) -> None:
        self._task.cancel()
