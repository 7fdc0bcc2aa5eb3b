"""The head's HTTP front end, OpenAI-compatible as vLLM and SGLang users expect (aiohttp).

  POST /v1/completions       {"model", "prompt", "max_tokens", ...}: a prompt is text or a list
                             of token ids, a list of either a batch (`n` choices each). Sampling
                             (`temperature`, `top_p`, `top_k`, `min_p`, `seed`), `stop` strings,
                             `stop_token_ids` and the checkpoint's EOS, `logprobs` (0..20) of
                             each generated token, `echo` (with `logprobs`: the prompt's own
                             log-probabilities, scored through the pipeline; `max_tokens` 0 scores
                             only), `stream` (server-sent events, `stream_options.include_usage`)
  POST /v1/chat/completions  {"model", "messages", ...}: the checkpoint's chat template, then the
                             same; `logprobs` true with `top_logprobs`
  POST /tokenize, /detokenize, GET /tokenizer_info   the checkpoint's tokenizer, as vLLM answers
  GET  /v1/models            the served model and its context length
  GET  /version              kernjax and jax versions, the model and the cut id
  GET  /health               200 while the pipeline is up, 503 after a fault
  GET  /metrics              Prometheus: requests by outcome, time to first token and per output
                             token, items, rows per item, pages in use, running and waiting
                             sequences, preemptions, per-stage item time

Requests are read and checked by `kernjax/serve/api.py`: a field the server cannot honour is a 400
that names it. Errors use OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`,
unknown paths and methods included. With `api_key`, every path but /health and /metrics wants
`Authorization: Bearer KEY` (else 401).

Bad input cannot stall the server: a body larger than `max_prompts` prompts of a full context can
take (`BYTES_PER_TOKEN` each) is a 413 before it is read (also once decompressed), text longer
than the context could tokenize to is a 400 before it is tokenized, a body slower than
`body_timeout` is a 408 and an idle connection closes after it, requests beyond
`max_connections` get a 503 (logged once per burst), and parsing, checking and tokenizing run on
worker threads, so /health answers meanwhile. A sequence whose client has gone is dropped by the
head at its next step. Client mistakes are logged in one line at INFO.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import hmac
import json
import logging
import resource
import time
import uuid
from importlib import metadata
from pathlib import Path

import numpy as np
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kernjax.serve import api
from kernjax.serve.api import Bad, show as _show
from kernjax.serve.head import Head, Refused
from kernjax.serve.protocol import one_line

log = logging.getLogger("kernjax.serve.http")
log.setLevel(logging.INFO)  # its client-mistake lines show under the shells' WARNING verbosity

# The most JSON bytes (or text characters) one prompt token may take; generous: token ids take
# at most 8 (`"151643, "`), text about 4 characters a token, escaped non-ASCII 6 a character.
BYTES_PER_TOKEN = 32
OPEN = ("/health", "/metrics")            # answered without the API key and outside the cap
ENDPOINTS = ("POST /v1/completions, POST /v1/chat/completions, POST /tokenize, POST /detokenize, "
             "GET /tokenizer_info, GET /v1/models, GET /version, GET /health, GET /metrics")


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
        self.slots = Gauge("kernjax_slots_in_use", "Sequence slots leased from the head's pool "
                           "(models with per-sequence states)", registry=r)
        self.stage = Histogram("kernjax_stage_item_seconds", "Per-stage compute time per item",
                               ["stage"], registry=r)
        self.stage_memory = Gauge("kernjax_stage_memory_bytes", "Per stage: what its weights and "
                                  "states need, its device's peak (where the allocator counts), "
                                  "its program at once (XLA's analysis)", ["stage", "kind"],
                                  registry=r)
        self.transport = Gauge("kernjax_transport", "1 for the transport between the stages "
                               "(`none` for the whole program)", ["kind"], registry=r)
        self.tpot = Histogram("kernjax_time_per_output_token_seconds", "Time per output token "
                              "after the first, per sequence", registry=r,
                              buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5))
        self.generated = Counter("kernjax_generated_tokens", "Tokens generated", registry=r)
        self.running = Gauge("kernjax_running_sequences", "Sequences holding pages: prefilling "
                             "or generating", registry=r)
        self.waiting = Gauge("kernjax_waiting_sequences", "Admitted sequences waiting for pages "
                             "or a place", registry=r)
        self.preemptions = Counter("kernjax_preemptions", "Sequences whose pages were taken back "
                                   "to be recomputed later", registry=r)
        self.in_progress = Gauge("kernjax_http_in_progress", "Requests in progress, counted "
                                 "against --max_connections (all but /health and /metrics)",
                                 registry=r)

    def memory(self, stage: int, m: dict) -> None:
        for kind in ("weights", "states", "peak", "program"):
            v = m.get(kind)
            if type(v) is int and v >= 0:
                self.stage_memory.labels(str(stage), kind).set(v)

    def item(self, rows: int, busy_us) -> None:
        self.items.inc()
        self.rows.observe(rows)
        for s, us in enumerate(busy_us):
            self.stage.labels(str(s)).observe(us / 1e6)


def _error(status: int, message: str, *, param: str | None = None) -> web.Response:
    kind = {401: "authentication_error", 404: "not_found_error", 501: "not_implemented_error"}
    kind = kind.get(status, "invalid_request_error" if status < 500 else "service_unavailable")
    return web.json_response({"error": {"message": message, "type": kind, "param": param,
                                        "code": status}}, status=status)


def chat_template(ckpt: Path | None):
    """`(source, special tokens)` of a checkpoint's chat template (`chat_template.jinja` or
    `tokenizer_config.json`'s `chat_template`), or None when it has none."""
    if ckpt is None:
        return None
    p = Path(ckpt) / "tokenizer_config.json"
    cfg = json.loads(p.read_text()) if p.is_file() else {}
    src = cfg.get("chat_template")
    if isinstance(src, list):  # named templates: the default one
        src = next((t.get("template") for t in src if t.get("name") == "default"), None)
    if (Path(ckpt) / "chat_template.jinja").is_file():
        src = (Path(ckpt) / "chat_template.jinja").read_text()
    special = {k: v.get("content") if isinstance(v, dict) else v for k, v in cfg.items()
               if k.endswith("_token") and isinstance(v, (str, dict))}
    return (src, special) if isinstance(src, str) and src else None


def _compile(source: str):
    """The template rendered as Hugging Face renders it, or a string saying why it cannot be."""
    try:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        return ("the checkpoint has a chat template, but jinja2 is not installed on the server "
                "(pip install jinja2); send /v1/completions with the prompt as text")

    def fail(message):
        raise TemplateError(message)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.globals.update(raise_exception=fail, strftime_now=lambda f: time.strftime(f))
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, indent=indent, ensure_ascii=False)
    try:
        return env.from_string(source)
    except TemplateError as e:
        return f"the checkpoint's chat template does not compile: {e}"


def _fd_cap() -> int:
    """Requests in progress the open-file limit (ulimit -n) leaves room for, at most 4096."""
    return min(4096, max(64, resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 256))


def make_app(head: Head, *, name: str, vocab: int, tokenizer=None, metrics: Metrics | None = None,
             checkpoint: Path | None = None, api_key: str | None = None,
             max_connections: int | None = None, body_timeout: float = 30.0,
             max_prompts: int = 64, max_body: int | None = None,
             eos: frozenset = frozenset(), defaults: dict | None = None) -> web.Application:
    """The aiohttp application serving `head` under the model name `name`.

    `eos` are the checkpoint's end-of-sequence token ids (`weights.eos_ids`), which end a
    generation unless a request says `ignore_eos`; `defaults` its sampling defaults
    (`weights.sampling_defaults`) for the fields a request leaves out;
    `checkpoint` is where the chat template is looked for; `api_key` (None: open) is the Bearer
    token every path but /health and /metrics wants; `max_connections` caps requests in
    progress (None: from the open-file limit); `body_timeout` is the seconds a body may take to
    arrive and an idle connection may stay open; `max_prompts` bounds a batch and, with the
    context, the body size (`max_body` overrides that bound).
    """
    bad = [f"--{k} {v}" for k, v in (("max_prompts", max_prompts), ("body_timeout", body_timeout),
                                     ("max_connections", max_connections))
           if v is not None and v <= 0]
    if bad:
        raise ValueError(f"{', '.join(bad)}: give a value above 0")
    metrics = metrics or head.metrics or Metrics()
    context = head.shape.context
    max_chars = context * BYTES_PER_TOKEN
    max_body = max_body or 65536 + max_prompts * max_chars
    cap = max_connections or _fd_cap()
    tpl = chat_template(checkpoint) if tokenizer is not None else None
    render = _compile(tpl[0]) if tpl else None
    pool = cf.ThreadPoolExecutor(4, thread_name_prefix="http")
    busy = {"now": 0, "refused": 0, "accept": 0.0}

    def tokens(p, i: int, many: bool, param: str = "prompt"):
        at = f"prompt {i}: " if many else ""
        if isinstance(p, str):
            if tokenizer is None:
                raise Bad("this model has no tokenizer; send the prompt as a list of token ids",
                          "prompt")
            if len(p) > max_chars:
                raise Bad(f"{at}the prompt is {len(p)} characters; a sequence holds at most "
                          f"{context} tokens, which no tokenizer makes of more than {max_chars} "
                          f"characters ({BYTES_PER_TOKEN} a token)", "prompt")
            try:
                p.encode("utf-8")
                p = tokenizer.encode(p, add_special_tokens=False).ids
            except UnicodeEncodeError as e:
                raise Bad(f"{at}the text holds {_show(e.object[e.start:e.end])}, a lone surrogate "
                          "(half a UTF-16 pair), which is not text", param) from None
            except Exception as e:  # noqa: BLE001 (the client's text)
                raise Bad(f"{at}the prompt cannot be tokenized: {e}", param) from None
        if not p:
            raise Bad(f"{at}the prompt is empty", "prompt")
        if len(p) <= context and any(not 0 <= t < vocab for t in p):
            raise Bad(f"{at}prompt has token ids outside the vocabulary 0..{vocab - 1}", "prompt")
        return np.asarray(p, np.int32) if len(p) <= context else p  # longer: the head refuses

    def prompts(body: dict) -> list:
        p = body.get("prompt")
        ids = lambda x: isinstance(x, list) and all(type(t) is int for t in x)  # noqa: E731
        if isinstance(p, str) or ids(p):
            return [p]
        if isinstance(p, list) and p and (all(isinstance(x, str) for x in p)
                                          or all(ids(x) for x in p)):
            if len(p) > max_prompts:
                raise Bad(f"prompt is a batch of {len(p)} prompts; this server takes at most "
                          f"{max_prompts} a request", "prompt")
            return p
        raise Bad("prompt must be a string, a list of token ids, or a batch: a list of strings "
                  "or a list of token-id lists", "prompt")

    def messages(body: dict) -> str:
        ms = body.get("messages")
        if not isinstance(ms, list) or not ms or not all(isinstance(m, dict) and isinstance(
                m.get("role"), str) for m in ms):
            raise Bad("messages must be a non-empty list of {\"role\", \"content\"}", "messages")
        out = []
        for m in ms:
            c = m.get("content")
            if isinstance(c, list) and all(isinstance(x, dict) and x.get("type") == "text"
                                           and isinstance(x.get("text"), str) for x in c):
                c = "".join(x["text"] for x in c)
            if not isinstance(c, str):
                raise Bad("message content must be text (a string or a list of text parts)",
                          "messages")
            out.append({**m, "content": c})
        if sum(len(m["content"]) for m in out) > max_chars:
            raise Bad(f"the messages hold more than {max_chars} characters; a sequence holds at "
                      f"most {context} tokens", "messages")
        add = body.get("add_generation_prompt", True)
        if not isinstance(add, bool):
            raise Bad("add_generation_prompt must be true or false", "add_generation_prompt")
        try:
            return render.render(messages=out, add_generation_prompt=add, **tpl[1])
        except Exception as e:  # noqa: BLE001 (the template's own checks: roles, order)
            raise Bad(f"the chat template refused these messages: {_show(str(e))}",
                      "messages") from None

    def parse(data: bytes):
        try:
            return json.loads(data)
        except (ValueError, RecursionError) as e:
            why = "nested too deeply" if isinstance(e, RecursionError) else str(e)[:120]
            raise Bad(f"the request body is not JSON this server reads ({why}); send "
                      "{\"prompt\": ..., \"max_tokens\": 16}") from None

    def prepare(data: bytes, chat: bool):
        """Parses and checks a body and tokenizes its prompts, on a worker thread: the `Job`,
        the prompts' token ids and, where a prompt is text, the text."""
        body = parse(data)
        job = api.read(body, chat=chat, context=context, eos=eos,
                       has_score="score" in head.programs, defaults=defaults)
        if body.get("model") not in (None, name):
            raise Bad(f"the model {_show(body.get('model'))} does not exist; this server serves "
                      f"`{name}`", "model", 404)
        ps, param = ([messages(body)], "messages") if chat else (prompts(body), "prompt")
        if len(ps) * job.ask.n > max_prompts:
            raise Bad(f"{len(ps)} prompts with n {job.ask.n} are {len(ps) * job.ask.n} "
                      f"sequences; this server takes at most {max_prompts} a request", "n")
        if job.ask.max_tokens == 0 and job.ask.n > 1:
            raise Bad("n above 1 with max_tokens 0 would repeat one answer; give n 1", "n")
        ids = [tokens(p, i, len(ps) > 1, param) for i, p in enumerate(ps)]
        job = job.sized(max(map(len, ids)), context)
        texts = [p if isinstance(p, str) else (tokenizer.decode(list(map(int, p)))
                                               if tokenizer else "") for p in ps]
        return job, ids, texts

    async def read(request: web.Request) -> bytes:
        n = request.content_length
        big = (f"this server takes bodies of at most {max_body} bytes ({max_prompts} prompts of "
               f"{context} tokens at {BYTES_PER_TOKEN} bytes a token)")
        if n is not None and n > max_body:
            raise Bad(f"the body is {n} bytes; {big}", status=413)
        try:
            return await asyncio.wait_for(request.read(), body_timeout)
        except TimeoutError:
            raise Bad(f"the body did not arrive within {body_timeout:g} s", status=408) from None
        except web.HTTPRequestEntityTooLarge:
            raise Bad(f"the body is larger (once decompressed); {big}", status=413) from None
        except HttpProcessingError as e:
            raise Bad(f"the body could not be read: {e.message}") from None
        except RequestPayloadError as e:  # a Content-Encoding the body is not in
            raise Bad(f"the body could not be read: {getattr(e.__cause__, 'message', e)}") from None
        except ConnectionError:
            raise Bad("the client closed the connection before its body arrived", status=499) \
                from None
        except asyncio.CancelledError:  # the same, when aiohttp cancels the handler for it
            metrics.requests.labels("abandoned").inc()
            raise

    async def complete(request: web.Request, chat: bool) -> web.StreamResponse:
        if chat and render is None:
            raise Bad("the checkpoint has no chat template (no tokenizer, or neither a "
                      "chat_template.jinja nor a `chat_template` in its tokenizer_config.json); "
                      "send /v1/completions with the prompt as text", "messages")
        if chat and isinstance(render, str):
            raise Bad(render, "messages", 501)
        data = await read(request)
        loop = asyncio.get_running_loop()
        job, ps, texts = await loop.run_in_executor(pool, prepare, data, chat)
        n = job.ask.n
        choices = [api.Choice(k, ps[k // n], job, tokenizer, texts[k // n])
                   for k in range(len(ps) * n)]
        events: asyncio.Queue = asyncio.Queue()
        gone = {"flag": False}

        def emit(k, kind, data):  # on the head's threads
            loop.call_soon_threadsafe(events.put_nowait, (k, kind, data))
        try:
            seqs = head.start(ps, job.ask, emit, lambda: gone["flag"] or request.transport is None)
        except Refused as e:
            raise Bad(str(e), "prompt" if e.status == 400 else None, e.status) from None
        rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        kind = "chat.completion" + ".chunk" * job.stream if chat else "text_completion"
        open_ = set(range(len(choices)))

        async def next_event():
            """The next event, applied to its choice: (the choice, the error or None); (None,
            None) for an event of a choice already closed."""
            while True:
                k, what, data = await events.get()
                c = choices[k]
                if k not in open_:
                    return None, None
                if what == "prompt":
                    c.prompt(data)
                elif what == "token":
                    c.token(data)
                    if c.stopped:  # a stop string: the head drops the sequence
                        seqs[k].cancelled = True
                elif what == "done":
                    c.done(data)
                elif what == "error":
                    open_.discard(k)
                    return c, data
                if c.finish:
                    open_.discard(k)
                return c, None

        def envelope(cs: list) -> dict:
            return {"id": rid, "object": kind, "created": created, "model": name,
                    "choices": cs}

        def counts() -> dict:
            m = sum(c.usage() for c in choices)
            p = sum(map(len, ps))
            return {"prompt_tokens": p, "completion_tokens": m, "total_tokens": p + m}
        try:
            if not job.stream:
                while open_:
                    _, err = await next_event()
                    if err is not None:
                        gone["flag"] = True  # one choice failed: the others have no answer
                        raise Bad(str(err), None, err.status)
                metrics.requests.labels("ok").inc()
                return web.json_response({**envelope([c.final() for c in choices]),
                                          "usage": counts()})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
            await resp.prepare(request)

            async def send(obj) -> None:
                await resp.write(b"data: " + (obj if isinstance(obj, bytes) else
                                              json.dumps(obj).encode()) + b"\n\n")
            outcome = "ok"
            while open_:
                c, err = await next_event()
                touched = {c.index: c} if c else {}
                while err is None and not events.empty() and open_:  # all that has arrived:
                    c, err = await next_event()  # one chunk for a token and its finish
                    if c:
                        touched[c.index] = c
                if err is not None:  # the client went, or the pipeline failed: say so
                    gone["flag"] = True
                    if err.status == 499:
                        metrics.requests.labels("abandoned").inc()
                        return resp
                    outcome = "unavailable"
                    await send({"error": {"message": str(err), "type": "service_unavailable",
                                          "param": None, "code": err.status}})
                    break
                for c in touched.values():
                    d = c.delta()
                    if d is not None:
                        await send(envelope([d]))
            if job.usage and outcome == "ok":
                await send({**envelope([]), "usage": counts()})
            await send(b"[DONE]")
            await resp.write_eof()
            metrics.requests.labels(outcome).inc()
            return resp
        except (asyncio.CancelledError, ConnectionError):
            gone["flag"] = True  # the client went: its sequences are dropped
            metrics.requests.labels("abandoned").inc()
            raise

    async def tokenize(request: web.Request) -> web.Response:
        body = await asyncio.get_running_loop().run_in_executor(pool, parse, await read(request))
        if not isinstance(body, dict) or set(body) - {"model", "prompt", "messages",
                                                      "add_special_tokens",
                                                      "add_generation_prompt",
                                                      "return_token_strs"}:
            raise Bad("/tokenize takes {\"prompt\": text} or {\"messages\": [...]}, and "
                      "add_special_tokens, return_token_strs")
        if tokenizer is None:
            raise Bad("this model has no tokenizer", "prompt")
        if "messages" in body:
            if render is None or isinstance(render, str):
                raise Bad("the checkpoint has no chat template", "messages")
            text = messages(body)
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
        else:
            raise Bad("prompt must be a string", "prompt")
        if len(text) > max_chars:
            raise Bad(f"the text is {len(text)} characters; this server tokenizes at most "
                      f"{max_chars}", "prompt")
        enc = tokenizer.encode(text, add_special_tokens=bool(body.get("add_special_tokens", True)))
        out = {"count": len(enc.ids), "max_model_len": context, "tokens": enc.ids}
        if body.get("return_token_strs"):
            out["token_strs"] = enc.tokens
        return web.json_response(out)

    async def detokenize(request: web.Request) -> web.Response:
        body = await asyncio.get_running_loop().run_in_executor(pool, parse, await read(request))
        ids = body.get("tokens") if isinstance(body, dict) else None
        if not (isinstance(ids, list) and all(type(t) is int and 0 <= t < vocab for t in ids)):
            raise Bad(f"/detokenize takes {{\"tokens\": [ids]}}, ids in 0..{vocab - 1}",
                      "tokens")
        if tokenizer is None:
            raise Bad("this model has no tokenizer", "tokens")
        return web.json_response({"prompt": tokenizer.decode(ids, skip_special_tokens=False)})

    async def tokenizer_info(_: web.Request) -> web.Response:
        if tokenizer is None:
            raise Bad("this model has no tokenizer", status=404)
        cfg = {}
        if checkpoint and (Path(checkpoint) / "tokenizer_config.json").is_file():
            cfg = json.loads((Path(checkpoint) / "tokenizer_config.json").read_text())
        info = {k: v for k, v in cfg.items() if k != "added_tokens_decoder"}
        info.update({"tokenizer_class": cfg.get("tokenizer_class", "PreTrainedTokenizerFast"),
                     "model_max_length": context, "vocab_size": tokenizer.get_vocab_size(),
                     "eos_token_ids": sorted(eos)})
        if tpl:
            info["chat_template"] = tpl[0]
        return web.json_response(info)

    async def completions(request: web.Request) -> web.StreamResponse:
        return await complete(request, False)

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        return await complete(request, True)

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": name, "object": "model", "owned_by": "kernjax",
            "max_model_len": head.shape.context}]})

    async def version(_: web.Request) -> web.Response:
        def v(pkg):
            try:
                return metadata.version(pkg)
            except metadata.PackageNotFoundError:
                return "unknown"
        return web.json_response({"version": v("kernjax"), "jax": v("jax"), "model": name,
                                  "cut": head.art.cut_id, "stages": head.stages})

    async def health(_: web.Request) -> web.Response:
        # 503 while the stages join ("waiting for stages 1..2 to join") and after a fault.
        if head.waiting() or head.failed:
            return _error(503, head.waiting() or head.failed)
        return web.json_response({"status": "ok", "stages": head.stages,
                                  "pages_in_use": head.pool.in_use,
                                  "slots_in_use": head.pool.slots_in_use})

    async def prometheus(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(metrics.registry),
                            content_type="text/plain", charset="utf-8")

    def refuse(request: web.Request, status: int, message: str, param=None,
               allow=()) -> web.Response:
        """An error answer, logged in one line; the connection closes if its body is unread."""
        outcome = ("abandoned" if status == 499 else "bad_request" if status < 500
                   else "unavailable")
        metrics.requests.labels(outcome).inc()
        log.log(logging.INFO if status < 500 else logging.WARNING, "http: %s %s from %s: %d %s",
                request.method, one_line(request.path[:200]), request.remote, status,
                one_line(message))
        resp = _error(status, message, param=param)
        if allow:
            resp.headers["Allow"] = ", ".join(sorted(allow))
        if status == 401:
            resp.headers["WWW-Authenticate"] = "Bearer"
        if not request.content.at_eof():
            resp.force_close()
        return resp

    @web.middleware
    async def guard(request: web.Request, handler):
        counted = request.path not in OPEN
        if counted and busy["now"] >= cap:
            if not busy["refused"]:
                log.warning("http: %d in progress (--max_connections %d): refusing more requests "
                            "with 503 until one ends", busy["now"], cap)
            busy["refused"] += 1
            metrics.requests.labels("overloaded").inc()
            resp = _error(503, f"the server is at its limit of {cap} request"
                               f"{'s' * (cap != 1)} in progress; retry later")
            resp.force_close()
            return resp
        busy["now"] += counted
        metrics.in_progress.set(busy["now"])
        try:
            auth = request.headers.get("Authorization", "")
            if counted and api_key and not hmac.compare_digest(auth.encode(),
                                                               f"Bearer {api_key}".encode()):
                raise Bad("missing or wrong API key; send `Authorization: Bearer KEY`", status=401)
            return await handler(request)
        except Bad as e:
            return refuse(request, e.status, str(e), e.param)
        except web.HTTPNotFound:
            return refuse(request, 404, f"no endpoint {request.method} {request.path}; this "
                                        f"server answers {ENDPOINTS}")
        except web.HTTPMethodNotAllowed as e:
            return refuse(request, 405, f"{request.path} does not take {request.method}; this "
                                        f"server answers {ENDPOINTS}", allow=e.allowed_methods)
        finally:
            busy["now"] -= counted
            metrics.in_progress.set(busy["now"])
            if busy["refused"] and busy["now"] < cap:
                log.warning("http: below --max_connections %d again; refused %d request%s",
                            cap, busy["refused"], "s" * (busy["refused"] != 1))
                busy["refused"] = 0

    def malformed(record: logging.LogRecord) -> bool:
        """aiohttp's record of a request HTTP itself cannot parse (answered 400 by aiohttp, and
        counted here): one line, no traceback. A body that does not decode, met again by
        aiohttp's drain, was answered (and, where read, logged and counted) by its handler: no
        second line. Others (a fault) keep their traceback."""
        e = record.exc_info and record.exc_info[1]
        if isinstance(e, RequestPayloadError):
            return False
        if isinstance(e, HttpProcessingError):
            metrics.requests.labels("bad_request").inc()
            record.msg, record.args = "http: a malformed request, answered 400: %s", (
                one_line(str(getattr(e, "message", e))[:200]),)
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True

    async def start(_: web.Application) -> None:
        """Out of file descriptors, asyncio logs a traceback per failed accept(): one line a
        minute instead."""
        logging.getLogger("aiohttp.server").addFilter(malformed)
        loop = asyncio.get_running_loop()
        default = loop.get_exception_handler()

        def handler(loop, ctx):
            e = ctx.get("exception")
            if isinstance(e, OSError) and "accept" in ctx.get("message", ""):
                if time.time() - busy["accept"] > 60:
                    busy["accept"] = time.time()
                    log.warning("http: cannot accept connections: %s (raise ulimit -n or lower "
                                "--max_connections)", e)
                return
            default(loop, ctx) if default else loop.default_exception_handler(ctx)
        loop.set_exception_handler(handler)

    async def stop(_: web.Application) -> None:
        logging.getLogger("aiohttp.server").removeFilter(malformed)
        pool.shutdown(wait=False, cancel_futures=True)

    app = web.Application(client_max_size=max_body, middlewares=[guard],
                          handler_args={"keepalive_timeout": body_timeout,
                                        "lingering_time": min(2.0, body_timeout)})
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.add_routes([web.post("/v1/completions", completions),
                    web.post("/v1/chat/completions", chat_completions),
                    web.post("/tokenize", tokenize), web.post("/detokenize", detokenize),
                    web.get("/tokenizer_info", tokenizer_info),
                    web.get("/v1/models", models), web.get("/version", version),
                    web.get("/health", health), web.get("/metrics", prometheus)])
    return app
