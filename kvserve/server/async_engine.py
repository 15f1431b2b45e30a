"""Runs the LLMEngine in its own thread beside the asyncio event loop, so the HTTP side never waits
for a step. Requests and aborts go in through a command queue; outputs come back to each request's
``asyncio.Queue`` with ``call_soon_threadsafe``. Only the engine thread touches the engine."""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections import deque
from typing import AsyncIterator, Callable

from kvserve.engine.llm_engine import LLMEngine
from kvserve.metrics.timeline import RequestTimeline
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shutdown or an internal error)."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_step: Callable[[LLMEngine, list[RequestOutput]], None] | None = None):
        self.engine = engine
        self._on_step = on_step
        self._commands: deque = deque()
        self._wake = threading.Condition()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything in flight and stop the engine thread."""
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    # ------------------------------------------------------------------ requests (event-loop side)
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       prompt: str | None, timeline: RequestTimeline,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes. Validation errors were raised before this is
        called (``engine.validate_request``); leaving the iterator early aborts the request."""
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, queue)
        self._submit(("add", request_id, prompt_token_ids, params, prompt, timeline, cache_salt))
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._submit(("abort", request_id))

    def _submit(self, command: tuple) -> None:
        with self._wake:
            self._commands.append(command)
            self._wake.notify()

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            while True:
                with self._wake:
                    while not self._commands and not self._stop and not self.engine.has_unfinished_requests():
                        self._wake.wait()
                    if self._stop:
                        break
                    commands = list(self._commands)
                    self._commands.clear()
                outputs = [out for cmd in commands for out in self._apply(cmd)]
                if self.engine.has_unfinished_requests():
                    outputs += self.engine.step()
                self._deliver(outputs)
                if self._on_step is not None:  # metrics: also after aborts, so gauges fall to 0
                    self._on_step(self.engine, outputs)
        except BaseException as e:  # keep the server answering: requests get an error, /health says so
            log.exception("engine thread failed")
            self._error = e
        finally:
            self._abort_all()

    def _apply(self, cmd: tuple) -> list[RequestOutput]:
        """Run one command on the engine thread; returns outputs it produced (an abort's)."""
        if cmd[0] == "add":
            _, rid, ids, params, prompt, timeline, cache_salt = cmd
            if rid not in self._streams:  # the client left before the request reached the engine
                return []
            try:
                self.engine.add_request(rid, ids, params, prompt=prompt, timeline=timeline, cache_salt=cache_salt)
            except Exception as e:  # noqa: BLE001 - forwarded to the waiting handler
                self._put(rid, e)
            return []
        out = self.engine.abort_request(cmd[1])
        return [out] if out is not None else []

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._put(out.request_id, out)

    def _put(self, rid: str, item) -> None:
        target = self._streams.get(rid)
        if target is not None:
            loop, queue = target
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def _abort_all(self) -> None:
        for rid in self.engine.unfinished_request_ids():
            out = self.engine.abort_request(rid)
            if out is not None:
                self._deliver([out])
        for rid in list(self._streams):
            self._put(rid, EngineDeadError("the engine stopped"))
