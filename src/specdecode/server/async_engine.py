"""AsyncEngine: one engine loop in a background thread, many HTTP requests on the event loop.

Continuous batching comes from the engine itself: requests are added and aborted between
steps, so they join and leave the running batch while others keep decoding. The HTTP side
never calls the model; it puts requests on a queue and awaits its own output queue, fed by
the engine thread through `loop.call_soon_threadsafe`. A client that goes away has its
request aborted at the next step boundary, which frees its KV slot.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import AsyncIterator

from specdecode.config import SamplingParams
from specdecode.engine.engine import LLM, RequestOutput
from specdecode.server.metrics import ServerMetrics

log = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, llm: LLM, metrics: ServerMetrics, log_interval: float = 10.0):
        self.llm = llm
        self.metrics = metrics
        self.log_interval = log_interval
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="specdecode-engine", daemon=True)
        self._counter = 0
        self._lock = threading.Lock()
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    def validate(self, prompt, params: SamplingParams) -> dict:
        """Raise InvalidRequestError now, on the HTTP side, for a request that can never run;
        returns the tokenized prompt so the engine thread does not tokenize again."""
        seq = self.llm._make_sequence(prompt, params, request_id="validate")
        return {"prompt_token_ids": seq.prompt_token_ids, "prompt": seq.prompt}

    async def generate(self, prompt, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Yield the request's output after every engine step that advanced it, until finished."""
        with self._lock:
            self._counter += 1
            request_id = f"req-{self._counter}"
        out_queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), out_queue)
        self._send("add", request_id, prompt, params)
        finished = False
        try:
            while True:
                item = await out_queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:  # client went away (or the handler failed): free the slot
                self._send("abort", request_id)
            self._streams.pop(request_id, None)

    def _send(self, *command) -> None:
        """A command for the engine thread, applied before its next step."""
        self._commands.put(command)
        self._wake.set()

    # ---- engine thread ---------------------------------------------------------------------

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, q = stream
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, request_id, prompt, params = command
                try:
                    self.llm.add_request(prompt, params, request_id=request_id)
                except Exception as e:  # validated before, but never let one request kill the loop
                    self._deliver(request_id, e)
            else:
                self.llm.abort(command[1])
                self.metrics.forget(command[1])

    def _run(self) -> None:
        last_log = time.monotonic()
        while not self._stop:
            self._drain_commands()
            if not self.llm.has_unfinished():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.llm.step()
            except Exception as e:  # a bug must not hang every client: fail the running requests
                log.exception("engine step failed")
                for seq in list(self.llm.scheduler.running) + list(self.llm.scheduler.waiting):
                    self.llm.abort(seq.request_id)
                    self._deliver(seq.request_id, e)
                continue
            self.metrics.observe_step(self.llm, outputs)
            for out in outputs:
                self._deliver(out.request_id, out)
            if time.monotonic() - last_log > self.log_interval:
                log.info(self.metrics.log_line(self.llm))
                last_log = time.monotonic()

    # ---- introspection (tests, /health) --------------------------------------------------------

    @property
    def num_free_slots(self) -> int:
        return len(self.llm.scheduler.free_slots)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()
