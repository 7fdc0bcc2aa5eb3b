"""The head's HTTP front end, OpenAI-compatible as vLLM and SGLang users expect (aiohttp).

  POST /v1/completions  {"model", "prompt": text | [token ids], "max_tokens": 1}
                        -> the first token, as text and id, with usage counts
  GET  /v1/models       the served model and its context length
  GET  /health          200 while the pipeline is up, 503 after a fault
  GET  /metrics         Prometheus: requests by outcome, TTFT, items, rows per item, pages in
                        use, per-stage item time

This server does prefill only: `max_tokens` other than 1 is a 400 that says so. Errors use
OpenAI's shape, `{"error": {"message", "type", "code"}}`; a bad body is a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kernjax.serve.head import Head, Refused


class Metrics:
    """The head's Prometheus metrics, in a registry of its own."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kernjax_requests", "Completion requests by outcome", ["outcome"],
                                registry=r)
        self.ttft = Histogram("kernjax_ttft_seconds", "Time to first token", registry=r,
                              buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
        self.items = Counter("kernjax_items", "Items run through the pipeline", registry=r)
        self.rows = Histogram("kernjax_item_rows", "Rows per item", registry=r,
                              buckets=(1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192))
        self.pages = Gauge("kernjax_pages_in_use", "Pages leased from the head's pool", registry=r)
        self.stage = Histogram("kernjax_stage_item_seconds", "Per-stage compute time per item",
                               ["stage"], registry=r)

    def item(self, rows: int, busy_us) -> None:
        self.items.inc()
        self.rows.observe(rows)
        for s, us in enumerate(busy_us):
            self.stage.labels(str(s)).observe(us / 1e6)


def _error(status: int, message: str, *, param: str | None = None) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "service_unavailable"
    return web.json_response({"error": {"message": message, "type": kind, "param": param,
                                        "code": status}}, status=status)


def make_app(head: Head, *, name: str, vocab: int, tokenizer=None,
             metrics: Metrics | None = None) -> web.Application:
    """The aiohttp application serving `head` under the model name `name`."""
    metrics = metrics or head.metrics or Metrics()

    def bad(message: str, param: str | None = None, status: int = 400) -> web.Response:
        metrics.requests.labels("bad_request").inc()
        return _error(status, message, param=param)

    async def completions(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except Exception:  # noqa: BLE001 (any unparsable body is the client's error)
            return bad("the request body is not JSON; send {\"prompt\": ..., \"max_tokens\": 1}")
        if not isinstance(body, dict):
            return bad("the request body must be a JSON object")
        if body.get("model") not in (None, name):
            return bad(f"the model `{body.get('model')}` does not exist; this server serves "
                       f"`{name}`", "model", 404)
        max_tokens = body.get("max_tokens", 1)
        if max_tokens != 1:
            return bad(f"max_tokens is {max_tokens!r}: this server does prefill only and answers "
                       "with the first token; send max_tokens 1", "max_tokens")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if tokenizer is None:
                return bad("this model has no tokenizer; send the prompt as a list of token ids",
                           "prompt")
            tokens = tokenizer.encode(prompt, add_special_tokens=False).ids
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                              for t in prompt):
            tokens = prompt
        else:
            return bad("prompt must be a string or a list of token ids (one prompt per request)",
                       "prompt")
        if not tokens:
            return bad("the prompt is empty", "prompt")
        if any(not 0 <= t < vocab for t in tokens):
            return bad(f"prompt has token ids outside the vocabulary 0..{vocab - 1}", "prompt")
        try:
            token, ttft = await asyncio.wrap_future(head.submit(tokens))
        except Refused as e:
            metrics.requests.labels("bad_request" if e.status < 500 else "unavailable").inc()
            return _error(e.status, str(e), param="prompt" if e.status == 400 else None)
        metrics.requests.labels("ok").inc()
        metrics.ttft.observe(ttft)
        text = tokenizer.decode([token]) if tokenizer else ""
        return web.json_response({
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": name,
            "choices": [{"index": 0, "text": text, "token_ids": [token], "logprobs": None,
                         "finish_reason": "length"}],
            "usage": {"prompt_tokens": len(tokens), "completion_tokens": 1,
                      "total_tokens": len(tokens) + 1}})

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": name, "object": "model", "owned_by": "kernjax",
            "max_model_len": head.shape.context}]})

    async def health(_: web.Request) -> web.Response:
        if head.failed:
            return _error(503, head.failed)
        return web.json_response({"status": "ok", "stages": head.stages,
                                  "pages_in_use": head.pool.in_use})

    async def prometheus(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(metrics.registry),
                            content_type="text/plain", charset="utf-8")

    app = web.Application(client_max_size=64 << 20)
    app.add_routes([web.post("/v1/completions", completions), web.get("/v1/models", models),
                    web.get("/health", health), web.get("/metrics", prometheus)])
    return app
