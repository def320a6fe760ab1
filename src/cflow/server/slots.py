"""Generation slots: requests wait in arrival order behind N concurrent generations, and each
generation consumes LLM.complete's generator in its own worker thread.

The event loop never runs model code: the worker thread iterates the generator (the engine
releases the GIL) and hands every chunk to the loop through an asyncio.Queue. Cancelling a
generation sets an event the worker checks after each chunk; it then closes the generator,
which stops the engine at the next token. A slot is freed only when its worker has finished,
so at most N generations ever run at once.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque

END = object()  # put on a Generation's queue after its last chunk (or its error)


class QueueFull(Exception):
    pass


class Slots:
    """N slots, granted strictly first come, first served."""

    def __init__(self, n: int, max_queue: int):
        self.n, self.max_queue = n, max_queue
        self.active = 0
        self._waiters: deque[asyncio.Future] = deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        if self.active < self.n and not self._waiters:
            self.active += 1
            return
        if len(self._waiters) >= self.max_queue:
            raise QueueFull
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # granted just as we gave up: pass it on
            else:
                self._waiters.remove(fut)
            raise

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot moves to the waiter; active is unchanged
                return
        self.active -= 1


class Generation:
    """One request's generation. Iterate with `await next()`; each item is a Chunk, an
    Exception (raised by the model) or END."""

    def __init__(self, slots: Slots, llm, prompt: list[int], sampling: dict):
        self.slots, self.llm, self.prompt, self.sampling = slots, llm, prompt, sampling
        self.queue: asyncio.Queue = asyncio.Queue()
        self.started = False
        self._stop = threading.Event()
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._start())

    async def _start(self) -> None:
        try:
            await self.slots.acquire()
        except QueueFull as e:
            self.queue.put_nowait(e)
            self.queue.put_nowait(END)
            return
        if self._stop.is_set():  # cancelled while it waited
            self.slots.release()
            self.queue.put_nowait(END)
            return
        self.started = True
        threading.Thread(target=self._work, name="cflow-generation", daemon=True).start()

    def _work(self) -> None:
        put = lambda item: self._loop.call_soon_threadsafe(self.queue.put_nowait, item)  # noqa: E731
        gen = None
        try:
            gen = self.llm.complete(self.prompt, **self.sampling)
            for chunk in gen:
                put(chunk)
                if self._stop.is_set():
                    break
        except Exception as e:  # the request fails, the worker and the server live on
            put(e)
        finally:
            try:
                if gen is not None:
                    gen.close()  # cancels the engine at the next token
            finally:
                put(END)
                self._loop.call_soon_threadsafe(self.slots.release)

    async def next(self):
        return await self.queue.get()

    def cancel(self) -> None:
        """Stop generating (client gone, or answer no longer wanted); frees the slot soon."""
        self._stop.set()
        if not self._task.done():
            self._task.cancel()  # still queued: leave the queue now
