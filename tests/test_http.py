"""The HTTP front end in process (aiohttp's TestServer on 127.0.0.1) against a head on a small whole
program: OpenAI's conventions (batches, server-sent events, refused fields, JSON 404/405, the API
key, /version, the chat template) and bad input that must not stall or kill the server (413s,
text refused before tokenizing, slow bodies, the request cap, gone clients, one-line logs)."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import logging
import re
import threading
import time

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer
from tokenizers import Tokenizer

from kernjax import artifact, models
from kernjax.runtime.runner import Runner, checkpoint_dir, load_weights
from kernjax.serve.head import Head
from kernjax.serve.http import BYTES_PER_TOKEN, Metrics, make_app
from tests.conftest import add_tokenizer

_, CFG = models.named("qwen3-tiny")
CONTEXT = 64
PROMPTS = [[5, 6, 7], list(range(1, 40)), [9] * 64, [300, 2]]
TEMPLATE = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}w9{% endif %}")


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("http")
    ref = {"model": "qwen3-tiny", "seed": 0, "dtype": CFG.dtype}
    fam, _ = models.named("qwen3-tiny")
    art = artifact.whole_artifact(fam, CFG, ref, CFG.dtype, rows=32, seqs=4, context=CONTEXT,
                             out=tmp / "whole")
    h = Head(Runner(art, load_weights(art, checkpoint_dir(ref))), metrics=Metrics(),
             on_exit=lambda code: None)
    getattr(h, "join", lambda: None)()
    return h


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A checkpoint directory with a word-level tokenizer (`w0`..) and a chat template."""
    d = tmp_path_factory.mktemp("ckpt")
    add_tokenizer(d, CFG.vocab)
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE,
                                                         "eos_token": "w1"}))
    return d


@contextlib.asynccontextmanager
async def client(head, ckpt=None, tokenizer=None, **kw):
    tok = tokenizer or (Tokenizer.from_file(str(ckpt / "tokenizer.json")) if ckpt else None)
    app = make_app(head, name="tiny", vocab=CFG.vocab, tokenizer=tok, checkpoint=ckpt, **kw)
    async with TestClient(TestServer(app, host="127.0.0.1")) as c:
        yield c


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def post(c, body, path="/v1/completions", **kw):
    r = await c.post(path, data=body if isinstance(body, bytes) else json.dumps(body), **kw)
    return r.status, await r.json(content_type=None)


def events(text: str) -> list:
    """The `data:` payloads of a server-sent event stream, `[DONE]` as a string."""
    out = []
    for block in text.split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def raw(c, data: bytes, seconds: float = 10) -> bytes:
    """Sends `data` on a connection of its own; the answer's head and body."""
    r, w = await asyncio.open_connection("127.0.0.1", c.server.port)
    w.write(data)

    async def answer():
        head = await r.readuntil(b"\r\n\r\n")
        n = next(int(x.split(b":")[1]) for x in head.split(b"\r\n")
                 if x.lower().startswith(b"content-length:"))
        return head + await r.readexactly(n)
    try:
        return await asyncio.wait_for(answer(), seconds)
    finally:
        w.close()


def request(path: str, length: int, body: bytes = b"", extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n{extra}\r\n").encode() + body


# --- OpenAI and vLLM conventions -----------------------------------------------------------

ONE = {"max_tokens": 1, "temperature": 0}  # the most likely next token


def test_a_batch_gives_the_single_prompts_tokens_in_order(head, ckpt):
    async def go():
        async with client(head, ckpt) as c:
            one = [await post(c, {"prompt": p, **ONE}) for p in PROMPTS]
            assert all(s == 200 and len(r["choices"]) == 1 for s, r in one), one
            s, batch = await post(c, {"prompt": PROMPTS, **ONE})
            assert s == 200, batch
            assert [x["index"] for x in batch["choices"]] == list(range(len(PROMPTS)))
            assert [x["token_ids"] for x in batch["choices"]] == \
                [r["choices"][0]["token_ids"] for _, r in one]
            n = sum(map(len, PROMPTS))
            assert batch["usage"] == {"prompt_tokens": n, "completion_tokens": 4,
                                      "total_tokens": n + 4}
            texts = ["w5 w6 w7", "w300 w2"]
            s, tb = await post(c, {"prompt": texts, **ONE})
            assert s == 200 and [x["token_ids"] for x in tb["choices"]] == \
                [one[0][1]["choices"][0]["token_ids"], one[3][1]["choices"][0]["token_ids"]]
            assert [x["text"] for x in tb["choices"]] == \
                [f"w{x['token_ids'][0]}" for x in tb["choices"]]
    run(go())


def test_stream_answers_with_server_sent_events_then_done(head, ckpt):
    async def go():
        async with client(head, ckpt) as c:
            _, want = await post(c, {"prompt": PROMPTS, **ONE})
            r = await c.post("/v1/completions", json={"prompt": PROMPTS[0], "stream": True, **ONE})
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            ev = events(await r.text())
            assert ev[-1] == "[DONE]" and len(ev) == 2  # the token and its finish: one chunk
            w = want["choices"][0]
            assert ev[0]["object"] == "text_completion" and ev[0]["choices"] == \
                [{"index": 0, "text": w["text"], "logprobs": None, "finish_reason": "length"}]
            r = await c.post("/v1/completions", json={
                "prompt": PROMPTS, "stream": True, "stream_options": {"include_usage": True},
                **ONE})
            ev = events(await r.text())
            chunks, usage, done = ev[:-2], ev[-2], ev[-1]
            assert done == "[DONE]" and usage["choices"] == [] and usage["usage"] == want["usage"]
            got = sorted((x["choices"][0] for x in chunks), key=lambda x: x["index"])
            assert [(x["text"], x["finish_reason"]) for x in got] == \
                [(x["text"], x["finish_reason"]) for x in want["choices"]]
            assert len({x["id"] for x in ev[:-1]}) == 1
    run(go())


@pytest.mark.parametrize("extra, param", [
    ({"best_of": 3}, "best_of"), ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"logprobs": 21}, "logprobs"), ({"suffix": "x"}, "suffix"),
    ({"logit_bias": {"5": 100}}, "logit_bias"), ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 1.0}, "max_tokens"), ({"max_tokens": -1}, "max_tokens"),
    ({"frobnicate": 1}, "frobnicate"), ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"n": True}, "n"),
])
def test_fields_the_server_cannot_honour_are_400s_naming_the_field(head, extra, param):
    async def go():
        async with client(head) as c:
            return await post(c, {"prompt": [1, 2], **extra})
    status, r = run(go())
    assert status == 400 and r["error"]["param"] == param, r
    assert set(r["error"]) == {"message", "type", "param", "code"}
    assert param in r["error"]["message"], r


def test_harmless_fields_and_defaults_are_accepted(head):
    body = {"prompt": [1, 2], "max_tokens": 1, "n": 1, "best_of": 1, "echo": False,
            "logprobs": None, "suffix": None, "user": "u", "temperature": 0.7, "top_p": 0.9,
            "seed": 3, "stop": ["\n"], "presence_penalty": 0, "frequency_penalty": 0.0,
            "model": "tiny", "stream": False}

    async def go():
        async with client(head) as c:
            return await post(c, body)
    status, r = run(go())
    assert status == 200, r


def test_unknown_paths_and_wrong_methods_answer_json_404_and_405(head):
    async def go():
        async with client(head) as c:
            r404 = await c.post("/v1/embeddings", json={})
            r405 = await c.get("/v1/completions")
            return (r404.status, await r404.json(), r405.status, r405.headers.get("Allow"),
                    await r405.json())
    s404, e404, s405, allow, e405 = run(go())
    assert s404 == 404 and e404["error"]["type"] == "not_found_error"
    assert "/v1/embeddings" in e404["error"]["message"] and e404["error"]["code"] == 404
    assert s405 == 405 and allow == "POST" and "does not take GET" in e405["error"]["message"]


def test_the_api_key_guards_all_but_health_and_metrics(head):
    async def go():
        async with client(head, api_key="sekrit") as c:
            out = []
            for h in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "sekrit"}):
                out.append(await post(c, {"prompt": [1]}, headers=h))
            out.append(await post(c, {"prompt": [1]}, headers={"Authorization": "Bearer sekrit"}))
            out += [(r.status, None) for r in [await c.get("/health"), await c.get("/metrics"),
                                               await c.get("/version"), await c.get("/nope")]]
            return out
    res = run(go())
    assert [s for s, _ in res] == [401, 401, 401, 200, 200, 200, 401, 401], res
    assert res[0][1]["error"]["type"] == "authentication_error"


def test_version_and_models(head):
    async def go():
        async with client(head) as c:
            return await (await c.get("/version")).json(), await (await c.get("/v1/models")).json()
    v, m = run(go())
    assert v["model"] == "tiny" and v["cut"] == head.art.cut_id and v["stages"] == 1
    assert v["version"] and v["jax"] and m["data"][0]["max_model_len"] == CONTEXT


def test_chat_uses_the_checkpoints_template_or_says_why_not(head, ckpt, tmp_path):
    msgs = {"messages": [{"role": "user", "content": "w5"},
                         {"role": "user", "content": [{"type": "text", "text": "w6"}]}]}
    plain = tmp_path / "plain"
    plain.mkdir()
    add_tokenizer(plain, CFG.vocab)

    async def go():
        async with client(head, plain) as c:
            none = await post(c, msgs, "/v1/chat/completions")
        async with client(head, ckpt) as c:
            chat = await post(c, {**msgs, **ONE}, "/v1/chat/completions")
            r = await c.post("/v1/chat/completions", json={**msgs, "stream": True, **ONE})
            stream = events(await r.text()) if r.status == 200 else None
            text = await post(c, {"prompt": "w5 w6 w9", **ONE})
        return none, chat, stream, text
    (s0, none), (s1, chat), stream, (_, text) = run(go())
    assert s0 == 400 and "no chat template" in none["error"]["message"], none
    try:
        import jinja2  # noqa: F401
    except ImportError:
        assert s1 == 501 and "jinja2 is not installed" in chat["error"]["message"], chat
        return
    assert s1 == 200 and chat["object"] == "chat.completion", chat
    token = text["choices"][0]["token_ids"][0]
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": f"w{token}"}
    assert chat["usage"]["prompt_tokens"] == 3
    assert stream[0]["object"] == "chat.completion.chunk" and stream[-1] == "[DONE]"
    assert stream[0]["choices"][0]["delta"]["content"] == f"w{token}"


# --- bad input cannot stall or kill the server ---------------------------------------------

def test_oversized_bodies_and_gzip_bombs_are_413(head):
    async def go():
        async with client(head) as c:
            limit = c.server.app._client_max_size
            assert limit == 65536 + 64 * CONTEXT * BYTES_PER_TOKEN
            declared = await raw(c, request("/v1/completions", 60 << 20))
            bomb = gzip.compress(b"[" + b" " * (10 << 20) + b"]")
            zipped = await post(c, bomb, headers={"Content-Encoding": "gzip"})
            chunks = [b'{"prompt": [' + b"1, " * (limit // 3) + b"1]}"]
            chunked = await raw(c, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                b"Transfer-Encoding: chunked\r\n\r\n" + b"".join(
                                    b"%x\r\n%s\r\n" % (len(x), x) for x in chunks) + b"0\r\n\r\n")
            after = await post(c, {"prompt": [1, 2, 3]})
            return declared, zipped, chunked, after
    declared, (zs, zipped), chunked, (s, _) = run(go())
    assert declared.startswith(b"HTTP/1.1 413") and b"62914560 bytes" in declared, declared[:300]
    assert zs == 413 and "decompressed" in zipped["error"]["message"], zipped
    assert chunked.startswith(b"HTTP/1.1 413"), chunked[:300]
    assert s == 200


def test_text_too_long_for_the_context_is_refused_before_tokenizing(head, ckpt):
    calls = []
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))

    class Counting:
        def encode(self, text, **kw):
            calls.append(len(text))
            return tok.encode(text, **kw)

        def decode(self, ids, **kw):
            return tok.decode(ids, **kw)

    async def go():
        async with client(head, tokenizer=Counting()) as c:
            return await post(c, {"prompt": "w1 " * (CONTEXT * BYTES_PER_TOKEN // 3 + 1)})
    status, r = run(go())
    assert status == 400 and "characters" in r["error"]["message"] and calls == [], r


def test_health_answers_while_a_prompt_is_parsed_and_tokenized(head, ckpt):
    """The tokenizer is held until /health has answered: it answers while a prompt is being
    tokenized (tokenizing on the event loop's thread, it would wait for the release that comes
    only after it: the test's 60 s)."""
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    where, started, release = [], threading.Event(), threading.Event()

    class Held:
        def encode(self, text, **kw):
            where.append(threading.current_thread() is threading.main_thread())
            started.set()
            release.wait(60)
            return tok.encode(text, **kw)

        def decode(self, ids, **kw):
            return tok.decode(ids, **kw)

    async def go():
        async with client(head, tokenizer=Held()) as c:
            slow = asyncio.create_task(post(c, {"prompt": "w5 w6"}))
            while not started.is_set():
                await asyncio.sleep(0.01)
            try:
                r = await asyncio.wait_for(c.get("/health"), 30)
                status, done = r.status, slow.done()
            finally:
                release.set()
            return status, done, await slow
    status, done, (s, _) = run(go())
    assert status == 200 and not done and s == 200
    assert where == [False]


def test_a_slow_body_gets_408_and_health_answers_meanwhile(head):
    async def go():
        async with client(head, body_timeout=1.0) as c:
            # answered at all within 30 s: the body timeout (1 s, which the answer names) ended
            # the wait for the 100 bytes that never come
            slow = asyncio.create_task(raw(c, request("/v1/completions", 100, b'{"prompt": ['),
                                           seconds=30))
            await asyncio.sleep(0.2)
            health = (await c.get("/health")).status
            answer = await slow
            return health, answer
    health, answer = run(go())
    assert health == 200 and answer.startswith(b"HTTP/1.1 408"), answer[:300]
    assert b"did not arrive within 1 s" in answer


def test_requests_over_the_cap_get_503_logged_once(head, caplog):
    caplog.set_level(logging.INFO, logger="kernjax.serve.http")

    async def go():
        async with client(head, max_connections=2, body_timeout=1.5) as c:
            slow = [asyncio.create_task(raw(c, request("/v1/completions", 50, b"{")))
                    for _ in range(2)]
            for _ in range(1000):  # until both are in progress (their body timeout ends them)
                if "kernjax_http_in_progress 2.0" in await (await c.get("/metrics")).text():
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("the two slow requests never were in progress together")
            over = [await post(c, {"prompt": [1]}) for _ in range(3)]
            health = (await c.get("/health")).status
            slow = await asyncio.gather(*slow)
            return over, health, slow, await post(c, {"prompt": [1]})
    over, health, slow, (s, _) = run(go())
    assert [st for st, _ in over] == [503] * 3 and "limit of 2" in over[0][1]["error"]["message"]
    assert health == 200 and all(x.startswith(b"HTTP/1.1 408") for x in slow) and s == 200
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert sum("refusing more" in x for x in lines) == 1, lines
    assert sum("refused 3 requests" in x for x in lines) == 1, lines


class _Gate:
    """The head's runner, held at each item until `go` is set; counts the items it ran."""

    def __init__(self, runner):
        self.runner, self.go, self.entered, self.items = runner, threading.Event(), \
            threading.Event(), 0

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def run(self, item, *args, **kw):
        self.entered.set()
        self.go.wait(30)
        self.items += 1
        return self.runner.run(item, *args, **kw)


def _counts(text: str) -> dict:
    """The request outcomes /metrics counts: {outcome: count}."""
    return {m[1]: float(m[2]) for m in
            re.finditer(r'^kernjax_requests_total\{outcome="(\w+)"\} (\S+)$', text, re.M)}


async def _outcomes(c) -> dict:
    return _counts(await (await c.get("/metrics")).text())


def _added(before: dict, after: dict) -> dict:
    """The outcomes counted between two reads of /metrics (a module's head counts them all)."""
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


def test_a_request_whose_client_has_gone_is_dropped_before_it_is_packed(head):
    gate = head.runner = _Gate(head.runner)
    body = json.dumps({"prompt": [[4, 5, 6], [7]], "stream": True}).encode()  # a batch, streamed

    async def go():
        async with client(head) as c:
            before = await _outcomes(c)
            first = asyncio.create_task(post(c, {"prompt": [1, 2, 3], **ONE}))
            while not gate.entered.is_set():
                await asyncio.sleep(0.02)
            _, w = await asyncio.open_connection("127.0.0.1", c.server.port)
            w.write(request("/v1/completions", len(body), body))
            while len(head.queue) < 2:
                await asyncio.sleep(0.02)
            w.close()
            for _ in range(200):
                if all(r.abandoned() for r in head.queue):
                    break
                await asyncio.sleep(0.02)
            gate.go.set()
            s1, _ = await first
            for _ in range(1500):  # until the head holds nothing: the gone request dropped or run
                if not (head.queue or head.live or head.inflight):
                    break
                await asyncio.sleep(0.02)
            items = gate.items
            s2, _ = await post(c, {"prompt": [7, 8], **ONE})
            return s1, s2, items, gate.items, _added(before, await _outcomes(c))
    try:
        s1, s2, items, after, added = run(go())
    finally:
        head.runner = gate.runner
    # each answered request: its prompt's chunk and its one-row step; the gone one: nothing
    assert (s1, s2, items, after) == (200, 200, 2, 4), (s1, s2, items, after)
    assert added == {"ok": 2, "abandoned": 1}, added
    assert head.pool.in_use == 0 and not head.queue and not head.live


def test_client_mistake_lines_show_under_the_shells_warning_verbosity():
    from absl import logging as absl_logging
    before = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.WARNING)  # what kernjax.cli.run sets
    try:
        assert logging.getLogger("kernjax.serve.http").isEnabledFor(logging.INFO)
    finally:
        absl_logging.set_verbosity(before)


def test_client_mistakes_are_logged_in_one_line_below_error(head, ckpt, caplog):
    caplog.set_level(logging.DEBUG)
    bodies = [b"{not json", b"[1]", b'{"prompt": [1], "max_tokens": true}', b"[" * 100000,
              b'{"prompt": [1, 99999]}', b'{"prompt": "w1 \\ud800"}', b'{"prompt": [1.5]}',
              b'{"prompt": [[1], 2]}', b'{"prompt": {"a": 1}}', b"\xff\xfe",
              json.dumps({"prompt": [1] * 65}).encode(), b'{"prompt": [1], "model": [1]}',
              b'{"prompt": [1], "\\ud800\\npp item stage=0 item=9": 1}', b"[" * 9 + b"1" * 5000,
              b'{"prompt": [1], "model": "\\ud800\\npp item stage=0 item=9 ' + b"x" * 10**5 + b'"}']

    async def go():
        async with client(head, ckpt) as c:
            return [await post(c, b) for b in bodies]
    res = run(go())
    assert [s for s, _ in res] == [400] * (len(bodies) - 1) + [404], res
    assert "lone surrogate" in res[5][1]["error"]["message"], res[5]
    assert "digits" in res[-2][1]["error"]["message"] and len(res[-1][1]["error"]["message"]) < 200
    mine = [r for r in caplog.records if r.name == "kernjax.serve.http"]
    # one line each, whatever the client sent: no newline (a forged `pp item` line), ASCII only
    assert len(mine) == len(bodies) and all(r.levelno == logging.INFO and not r.exc_info and
                                            "\n" not in r.getMessage() and r.getMessage().isascii()
                                            for r in mine), mine
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_bodies_and_requests_http_cannot_read_are_one_counted_line_each(head, caplog):
    """A body not in its Content-Encoding: a JSON 400. A request HTTP itself cannot parse:
    aiohttp's 400, logged in one line and counted. A client gone halfway through its body:
    counted abandoned. No traceback for any."""
    caplog.set_level(logging.DEBUG)
    want = {"bad_request": 2, "abandoned": 1}

    async def go():
        async with client(head) as c:
            before = await _outcomes(c)
            bad = await post(c, b"notgzip", headers={"Content-Encoding": "gzip"})
            framing = await raw(c, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                   b"Content-Length: -1\r\n\r\n")
            _, w = await asyncio.open_connection("127.0.0.1", c.server.port)
            w.write(request("/v1/completions", 100, b'{"prompt": [1,'))
            await w.drain()
            w.close()
            for _ in range(1500):  # until the gone client is counted too (or 30 s)
                if (added := _added(before, await _outcomes(c))) == want:
                    break
                await asyncio.sleep(0.02)
            return bad, framing, added
    bad, framing, added = run(go())
    assert bad[0] == 400 and "could not be read" in bad[1]["error"]["message"], bad
    assert framing.split(b"\r\n")[0].endswith(b" 400 Bad Request"), framing
    assert added == want, added
    lines = [r for r in caplog.records if r.name in ("aiohttp.server", "kernjax.serve.http")]
    said = [r.getMessage() for r in lines]
    assert any("could not be read" in m for m in said) and any(
        "malformed request" in m and "Content-Length" in m and "\n" not in m for m in said), said
    # the body that does not decode is said once, by its handler (aiohttp's drain meets it again)
    assert sum("gzip" in m.lower() for m in said) == 1, said
    assert not [r for r in caplog.records if r.exc_info or
                                    r.levelno >= logging.ERROR], caplog.records


def test_bounds_below_one_are_refused(head):
    with pytest.raises(ValueError, match="--max_prompts 0, --body_timeout 0: give a value above 0"):
        make_app(head, name="tiny", vocab=CFG.vocab, max_prompts=0, body_timeout=0)


class _Unread:
    """An item's next_token that the head can read only once `go` is set."""

    def __init__(self, x, go):
        self.x, self.go = x, go

    def __array__(self, dtype=None, copy=None):
        self.go.wait(30)
        return np.asarray(self.x, dtype)


@pytest.mark.parametrize("tokens", [CONTEXT, 40], ids=["two-full-items", "full-then-partial"])
def test_the_head_issues_the_next_item_before_it_reads_the_tokens_of_the_last(head, tokens):
    """Rows 32: a 64-token prompt's first 63 rows are a full item and a partial one, a 40-token
    prompt's 39 the same; its last token is the one-row step. A partial item that holds all
    there is to issue goes once as many items as stages are in flight, so the device never idles
    between a lone prompt's last two chunks (kern's head held it until fewer than stages were in
    flight: the pipeline drained first), and the step goes at once: three items issued before
    any token is read."""
    prompt = list(range(1, tokens + 1))
    want = head.submit(prompt).result(30)[0]
    runner, go, issued = head.runner, threading.Event(), []

    class Late:
        def __getattr__(self, name):
            return getattr(runner, name)

        def run(self, item, *args, **kw):
            issued.append(item)
            deps, out = runner.run(item, *args, **kw)
            return deps, {**out, "next_token": _Unread(out["next_token"], go)}

    head.runner = Late()
    try:
        fut = head.submit(prompt)
        deadline = time.time() + 10
        while len(issued) < 3 and time.time() < deadline:
            time.sleep(0.01)
        unread = len(issued)  # items issued while no token had been read
        go.set()
        got = fut.result(30)[0]
    finally:
        head.runner = runner
    assert unread == 3 and got == want, (unread, got, want)

