"""A minimal OpenAI-compatible streaming server around an engine, for loadgen's tests.

It serves ``/v1/models``, ``/v1/completions`` (SSE only), ``/health`` and ``/metrics``
(the engine's counters as ``detserve:<key>_total``), on 127.0.0.1 and a free port, from
a background thread. Requests that arrive together are stepped together, so batch sizes
follow the offered load as in a real server. One HTTP/1.1 request per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Iterator
from typing import Any

from detserve.params import SamplingParams


class FakeOpenAIServer:
    def __init__(self, engine: Any, model: str = "fake-model") -> None:
        self.engine = engine
        self.model = model
        self.port = 0
        self._queues: dict[str, asyncio.Queue[Any]] = {}
        self._wake: asyncio.Event | None = None
        self._next_id = 0

    async def serve(self, ready: threading.Event, stop: asyncio.Event) -> None:
        self._wake = asyncio.Event()
        server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        stepper = asyncio.create_task(self._step_loop())
        ready.set()
        async with server:
            await stop.wait()
        stepper.cancel()

    async def _step_loop(self) -> None:
        assert self._wake is not None
        while True:
            if not self.engine.has_unfinished_requests():
                self._wake.clear()
                await self._wake.wait()
                await asyncio.sleep(0.005)     # let requests sent together batch together
                continue
            for out in await asyncio.to_thread(self.engine.step):
                q = self._queues.get(out.request_id)
                if q is not None:
                    q.put_nowait(out)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
            method, path, _ = head.split("\r\n", 1)[0].split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, _, v in
                       (line.partition(":") for line in head.split("\r\n")[1:] if line)}
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            await self._route(method, path, body, writer)
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()
                await writer.wait_closed()

    async def _route(self, method: str, path: str, body: bytes,
                     writer: asyncio.StreamWriter) -> None:
        if method == "GET" and path == "/v1/models":
            _respond(writer, 200, {"object": "list", "data": [{"id": self.model}]})
        elif method == "GET" and path == "/health":
            _respond(writer, 200, {"status": "ok"})
        elif method == "GET" and path == "/metrics":
            lines = [f"detserve:{k}_total {float(v)}" for k, v in self.engine.stats().items()]
            _respond(writer, 200, "\n".join(lines) + "\n", "text/plain")
        elif method == "POST" and path == "/v1/completions":
            await self._complete(json.loads(body), writer)
        else:
            _respond(writer, 404, {"error": {"message": f"no route {method} {path}"}})
        await writer.drain()

    async def _complete(self, req: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        assert self._wake is not None
        self._next_id += 1
        rid = f"cmpl-{self._next_id}"
        try:
            params = SamplingParams(
                max_tokens=int(req.get("max_tokens", 16)),
                temperature=float(req.get("temperature", 0.0)), seed=req.get("seed"),
                is_deterministic=bool(req.get("is_deterministic", False)),
                ignore_eos=bool(req.get("ignore_eos", False)), logprobs=req.get("logprobs"))
            prompt = req["prompt"]
            ids = prompt if isinstance(prompt, list) else None
            self._queues[rid] = asyncio.Queue()
            self.engine.add_request(rid, None if ids else prompt, params, prompt_token_ids=ids)
        except (ValueError, KeyError, TypeError) as e:
            self._queues.pop(rid, None)
            _respond(writer, 400, {"error": {"message": str(e)}})
            return
        self._wake.set()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Connection: close\r\n\r\n")
        sent = 0
        try:
            while True:
                out = await self._queues[rid].get()
                delta = out.text[sent:]
                sent = len(out.text)
                choice: dict[str, Any] = {"index": 0, "text": delta,
                                          "finish_reason": out.finish_reason}
                if out.logprobs is not None and out.num_new_tokens:
                    new = out.logprobs[-out.num_new_tokens:]
                    choice["logprobs"] = {"token_logprobs": [lp.logprob for lp in new]}
                chunk: dict[str, Any] = {"id": rid, "object": "text_completion",
                                         "model": self.model, "choices": [choice]}
                if params.is_deterministic:
                    chunk["determinism"] = {"fingerprint": "fake-profile"}
                _sse(writer, chunk)
                await writer.drain()
                if out.finished:
                    usage = {"prompt_tokens": len(out.prompt_token_ids),
                             "completion_tokens": len(out.token_ids)}
                    _sse(writer, {"id": rid, "choices": [], "usage": usage})
                    writer.write(b"data: [DONE]\n\n")
                    return
        finally:
            self._queues.pop(rid, None)


def _sse(writer: asyncio.StreamWriter, obj: Any) -> None:
    writer.write(f"data: {json.dumps(obj)}\n\n".encode())


def _respond(writer: asyncio.StreamWriter, status: int, body: Any,
             ctype: str = "application/json") -> None:
    data = (body if isinstance(body, str) else json.dumps(body)).encode()
    writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: {ctype}\r\nContent-Length: "
                 f"{len(data)}\r\nConnection: close\r\n\r\n".encode() + data)


@contextlib.contextmanager
def running_server(engine: Any, model: str = "fake-model") -> Iterator[str]:
    """Start a FakeOpenAIServer in a thread; yields its base URL; stops it on exit."""
    srv = FakeOpenAIServer(engine, model)
    ready = threading.Event()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(srv.serve(ready, stop))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    if not ready.wait(10):
        raise RuntimeError("fake server did not start")
    try:
        yield f"http://127.0.0.1:{srv.port}"
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
        loop.close()
