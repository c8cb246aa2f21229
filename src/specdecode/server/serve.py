"""`specdecode serve`: build the engine, start its loop, run uvicorn."""

from __future__ import annotations

import gc
import logging
from pathlib import Path

from specdecode.engine.engine import LLM
from specdecode.errors import ConfigError
from specdecode.server.app import DEFAULT_MAX_REQUEST_BYTES, build_app
from specdecode.server.async_engine import AsyncEngine
from specdecode.server.metrics import ServerMetrics

log = logging.getLogger(__name__)


def create_server(model: str | None = None, speculative_config=None, dtype: str = "auto", device: str = "auto",
                  quantization: str | None = None, compile: bool = False, exact: bool = False,
                  hf_overrides: dict | None = None, max_num_seqs: int = 16, max_model_len: int | None = None, api_key: str | None = None,
                  served_model_name: str | None = None, log_interval: float = 10.0,
                  max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, max_waiting: int = 256,
                  public_metrics: bool = False, verify_kernels: str = "auto", kv_cache_dtype: str = "auto"):
    """(app, engine): the engine loop is started; the caller serves the app and shuts the engine down."""
    for key, value, least in (("max_request_bytes", max_request_bytes, 1024), ("max_waiting", max_waiting, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ConfigError(f"{key} must be an integer >= {least}, got {value!r}")
    llm = LLM(model=model, dtype=dtype, device=device, speculative_config=speculative_config, quantization=quantization,
              compile=compile, exact=exact, hf_overrides=hf_overrides, verify_kernels=verify_kernels,
              kv_cache_dtype=kv_cache_dtype,
              max_num_seqs=max_num_seqs, max_model_len=max_model_len)
    name = served_model_name or Path(llm.config.model).name
    engine = AsyncEngine(llm, ServerMetrics(name), log_interval=log_interval, max_waiting=max_waiting)
    engine.start()
    app = build_app(engine, name, api_key=api_key, max_request_bytes=max_request_bytes, public_metrics=public_metrics)
    return app, engine


def serve(host: str, port: int, **kwargs) -> None:
    import uvicorn

    app, engine = create_server(**kwargs)
    # What start-up built (modules, tokenizer tables, kernels' wrappers: ~300k objects with the default
    # model) lives as long as the process: frozen, the collector's full passes skip it. One such pass
    # took 150-185 ms here (benchmarks/gc_pauses.py), a stall of every stream; this process is the
    # server's own, so nothing else's garbage is frozen with it.
    gc.collect()
    gc.freeze()
    log.info("serving %s on http://%s:%d (speculative: %s)", app.title, host, port,
             engine.llm.speculator.config.method if engine.llm.speculator else "off")
    try:
        uvicorn.run(app, host=host, port=port, log_level="info")
    finally:
        engine.shutdown()


class BackgroundServer:
    """A server on a free 127.0.0.1 port in a background thread (tests, load generator)."""

    def __init__(self, **kwargs):
        import socket
        import threading
        import time

        import uvicorn

        self.app, self.engine = create_server(**kwargs)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.engine.shutdown()
