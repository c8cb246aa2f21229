"""AsyncEngine: one engine loop in a background thread, many HTTP requests on the event loop.

Continuous batching comes from the engine itself: requests are added and aborted between
steps, so they join and leave the running batch while others keep decoding. The HTTP side
never calls the model; it puts requests on a queue and awaits its own output queue, fed by
the engine thread through `loop.call_soon_threadsafe`. A client that goes away has its
request aborted at the next step boundary, which frees its KV slot.

No single request can stop the others:
- a request the engine fails comes out finished with finish_reason "error" (`RequestOutput.error`
  says why): `generate` raises RequestFailed for it alone;
- if `LLM.step()` itself raises (an engine bug), the requests of that step (the newly admitted
  ones for a prefill, else every running one) are aborted and get RequestFailed; the loop goes
  on, and `health()` reports the engine unhealthy after `max_failed_steps` failed steps in a
  row, until one succeeds;
- tokenising and chat templating run in a small thread pool (`offload`), not on the event loop;
- at most `max_num_seqs + max_waiting` requests are in flight (being prepared, waiting for a
  slot, or running): `admission()` refuses more with EngineBusy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator

from specdecode.config import SamplingParams
from specdecode.engine.engine import LLM, RequestOutput
from specdecode.errors import SpecDecodeError
from specdecode.server.metrics import ServerMetrics

log = logging.getLogger(__name__)


class EngineUnavailable(Exception):
    """The engine loop is not running (the server is stopping, or the loop died)."""


class EngineBusy(Exception):
    """Every place for a request (running or waiting) is taken."""


class RequestFailed(Exception):
    """The request failed inside the engine; requests outside its step are unaffected."""


class AsyncEngine:
    def __init__(self, llm: LLM, metrics: ServerMetrics, log_interval: float = 10.0, max_waiting: int = 256,
                 max_failed_steps: int = 3, prepare_threads: int = 2):
        self.llm = llm
        self.metrics = metrics
        self.log_interval = log_interval
        self.max_waiting = max_waiting
        self.max_failed_steps = max_failed_steps
        self.failed_steps = 0  # consecutive engine steps that raised
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._preparing = 0  # requests admitted and not yet handed to the engine (event loop only)
        self._live: set[str] = set()  # engine thread: added, not yet finished or aborted
        self._pool = ThreadPoolExecutor(prepare_threads, thread_name_prefix="specdecode-prepare")
        self._wake = threading.Event()
        self._stop = False
        self._closed = False  # the engine thread has failed every open stream and takes no more
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
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- HTTP side ----------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self.llm.scheduler.num_slots + self.max_waiting

    @property
    def num_in_flight(self) -> int:
        return len(self._streams) + self._preparing

    @contextlib.contextmanager
    def admission(self):
        """A place for one request while it is prepared (then `generate` holds it)."""
        if self.num_in_flight >= self.capacity:
            raise EngineBusy(f"the server is at capacity ({self.llm.scheduler.num_slots} requests running and "
                             f"{self.max_waiting} waiting); retry later")
        self._preparing += 1
        try:
            yield
        finally:
            self._preparing -= 1

    async def offload(self, fn, *args):
        """fn(*args) in the preparation thread pool (tokenising, templating, parsing)."""
        if self._closed or self._stop:
            raise EngineUnavailable("the engine loop is not running")
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def validate(self, prompt, params: SamplingParams) -> dict:
        """Raise InvalidRequestError now, on the HTTP side, for a request that can never run;
        returns the tokenized prompt so the engine thread does not tokenize again."""
        seq = self.llm._make_sequence(prompt, params, request_id="validate")
        return {"prompt_token_ids": seq.prompt_token_ids, "prompt": seq.prompt}

    def health(self) -> str | None:
        """None when the engine can serve, else why not."""
        if not self.alive:
            cause = f" ({type(self.error).__name__}: {self.error})" if self.error is not None else ""
            return "the engine loop is not running" + cause
        if self.failed_steps >= self.max_failed_steps:
            return (f"the last {self.failed_steps} engine steps failed; the engine is reported healthy again "
                    "after a step succeeds")
        return None

    async def generate(self, prompt, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Yield the request's output after every engine step that advanced it, until finished.
        Raises RequestFailed if the engine fails the request, EngineUnavailable if it stops."""
        with self._lock:
            if self._closed or self._stop:
                raise EngineUnavailable("the engine loop is not running")
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
                    finished = True  # the engine thread let go of the request before it said so
                    raise item
                if item.finished and item.finish_reason == "error":
                    finished = True
                    raise RequestFailed(f"the request failed in the engine: {getattr(item, 'error', None) or 'unknown error'}")
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
            try:
                loop.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:  # its event loop is closed: nobody is waiting any more
                pass

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
                    self._live.add(request_id)
                except SpecDecodeError as e:  # validated before, but never let one request kill the loop
                    self._deliver(request_id, e)
                except Exception:
                    log.exception("adding request %s failed", request_id)
                    self._deliver(request_id, RequestFailed("the engine could not add this request (internal error)"))
            elif command[1] in self._live:
                self._live.discard(command[1])
                self.llm.abort(command[1])
                self.metrics.aborted(command[1])

    def _step(self) -> list[RequestOutput]:
        """One engine step; if it raises, only its requests fail (see the module docstring)."""
        before = {seq.request_id for seq in self.llm.scheduler.running}
        try:
            outputs = self.llm.step()
        except Exception:
            self.failed_steps += 1
            log.exception("engine step failed (%d in a row)", self.failed_steps)
            running = [seq.request_id for seq in self.llm.scheduler.running]
            admitted = [rid for rid in running if rid not in before]  # the step was their prefill
            for request_id in admitted or running:
                self._fail(request_id, RequestFailed(
                    "an internal error in the engine stopped this request; other requests keep running"))
            return []
        self.failed_steps = 0
        return outputs

    def _fail(self, request_id: str, error: Exception) -> None:
        self._live.discard(request_id)
        try:
            self.llm.abort(request_id)
        except Exception:
            log.exception("aborting request %s failed", request_id)
        self.metrics.failed(request_id)
        self._deliver(request_id, error)

    def _run(self) -> None:
        last_log = time.monotonic()
        try:
            while not self._stop:
                self._drain_commands()
                self.metrics.observe_queue(self.llm)
                if not self.llm.has_unfinished():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                outputs = self._step()
                for out in outputs:
                    if out.finished:
                        self._live.discard(out.request_id)
                    self._deliver(out.request_id, out)
                try:
                    self.metrics.observe_step(self.llm, outputs)
                    if time.monotonic() - last_log > self.log_interval:
                        log.info(self.metrics.log_line(self.llm))
                        last_log = time.monotonic()
                except Exception:  # metrics never stop serving
                    log.exception("metrics update failed")
        except BaseException as e:
            self.error = e
            log.exception("the engine loop stopped")
        finally:
            self._close()

    def _close(self) -> None:
        """Fail every open stream: nothing will feed it any more."""
        with self._lock:
            self._closed = True
        message = "the server is shutting down" if self._stop else "the engine loop stopped unexpectedly"
        for request_id in list(self._streams):
            if request_id in self._live:
                self._live.discard(request_id)
                with contextlib.suppress(Exception):
                    self.llm.abort(request_id)
                self.metrics.aborted(request_id)
            self._deliver(request_id, EngineUnavailable(message))

    # ---- introspection (tests, /health) --------------------------------------------------------

    @property
    def num_free_slots(self) -> int:
        return len(self.llm.scheduler.free_slots)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed
