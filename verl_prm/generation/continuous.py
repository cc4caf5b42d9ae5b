"""Requests that join the running batch as they arrive: the engine's continuous batching for asyncio callers.

A caller that sends requests which depend on earlier ones (a tree branch continues its root's response; a search
expands the nodes just scored) would otherwise wait for the whole batch its predecessor ran in: the longest row
of every other prompt. :class:`ContinuousBatcher` runs :meth:`GenerationEngine.serve` in one worker thread;
``await batcher.generate(request)`` queues the request, the worker admits it before its next decode step (the
batch's cache is rebuilt around it, its cached prefix reused), and the request's output is returned as soon as
it ends. An idle engine given a request waits ``gather_seconds`` for the rest of its wave, so one wave of an
agent loop's requests is prefilled as one batch.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque

from verl_prm.generation.engine import GenerationEngine, GenerationOutput, GenerationRequest

__all__ = ["ContinuousBatcher"]


class ContinuousBatcher:
    """One worker thread decoding every queued request with ``engine``, admitting new ones between steps.

    Args:
        engine: the engine to decode with; nothing else may use it while requests are in flight.
        gather_seconds: how long an idle worker waits for the rest of a wave before its first step.
    """

    def __init__(self, engine: GenerationEngine, *, gather_seconds: float = 0.02) -> None:
        number = isinstance(gather_seconds, (int, float)) and not isinstance(gather_seconds, bool)
        if not (number and 0 <= gather_seconds < 60):
            raise ValueError(f"ContinuousBatcher: gather_seconds must be a number in [0, 60), got {gather_seconds!r}")
        self.engine = engine
        self.gather_seconds = float(gather_seconds)
        self._queue: deque[tuple[GenerationRequest, asyncio.AbstractEventLoop, asyncio.Future]] = deque()
        self._in_flight: set[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = set()
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None

    @property
    def busy(self) -> bool:
        """Requests are queued or decoding."""
        with self._lock:
            return bool(self._queue or self._in_flight)

    async def generate(self, request: GenerationRequest) -> GenerationOutput:
        """The request's output, generated beside whatever else is queued or decoding."""
        self.engine.check_request(request)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            self._queue.append((request, loop, future))
            if self._worker is None:
                self._worker = threading.Thread(target=self._run, name="verl-prm-continuous-batcher", daemon=True)
                self._worker.start()
        return await future

    def _take(self, room: int, idle: bool) -> list:
        with self._lock:
            if idle and not self._queue:
                self._worker = None  # the next generate() starts a new worker
                return []
        if idle and self.gather_seconds:
            time.sleep(self.gather_seconds)
        with self._lock:
            taken = [self._queue.popleft() for _ in range(min(room, len(self._queue)))]
            self._in_flight.update((loop, future) for _, loop, future in taken)
        return [(request, self._deliverer(loop, future)) for request, loop, future in taken]

    def _deliverer(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future):
        def deliver(output: GenerationOutput) -> None:
            with self._lock:
                self._in_flight.discard((loop, future))
            loop.call_soon_threadsafe(_settle, future, output, None)
        return deliver

    def _run(self) -> None:
        try:
            self.engine.serve(self._take)
        except BaseException as error:  # every request in flight or queued fails with the cause
            with self._lock:
                failed = list(self._in_flight) + [(loop, future) for _, loop, future in self._queue]
                self._in_flight.clear()
                self._queue.clear()
                self._worker = None
            for loop, future in failed:
                loop.call_soon_threadsafe(_settle, future, None, error)


def _settle(future: asyncio.Future, output, error) -> None:
    if future.done():  # the caller gave up waiting (cancelled)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(output)
