"""Scoring and generation over HTTP, in process (a head on a small float32 whole program, with the
random checkpoint's byte-level tokenizer, ChatML template and EOS): the answers equal the
pipeline's own, the fields OpenAI's clients send (sampling, `n`, `stop`, `logprobs`, `echo`,
streaming, chat), vLLM's tokenizer endpoints, the official `openai` client, and a sequence that
is never lost: preempted when pages run out, dropped when its client goes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

import numpy as np
import pytest

from kernjax import artifact, models, weights
from kernjax.runtime.pipeline import Pipeline
from kernjax.runtime.runner import Runner, checkpoint_dir, load_weights
from kernjax.serve.head import Head
from kernjax.serve.http import Metrics, make_app
from tests.test_http import client, events, post, run

FAM, CFG = models.named("qwen3-tiny")
REF = {"model": "qwen3-tiny", "seed": 0, "dtype": "float32"}
CONTEXT = 256


def _head(tmp, *, pages=None, name="whole", max_seqs=256, decode=(1, 4, 16)):
    progs = artifact.programs(FAM, CFG, dtype="float32", rows=32, seqs=4, context=CONTEXT,
                              pages=pages, decode=decode)
    from kernjax.core.cut import whole_all
    art = artifact.read(artifact.write(
        tmp / name, whole_all(progs), model=artifact.model_meta(FAM, CFG), checkpoint=REF,
        dtype="float32", item=artifact.items(FAM, CFG, progs)))
    runner = Runner(art, load_weights(art, checkpoint_dir(REF)))
    h = Head(runner, metrics=Metrics(), on_exit=lambda code: None, max_seqs=max_seqs)
    h.join()
    return h, runner


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(head, a pipeline over the same runner's artifact for reference answers, checkpoint)."""
    h, _ = _head(tmp_path_factory.mktemp("api"))
    art = h.art
    ref = Pipeline([Runner(art, load_weights(art, checkpoint_dir(REF)))])
    return h, ref, checkpoint_dir(REF)


def _client(h, ckpt, **kw):
    return client(h, ckpt, tokenizer=weights.tokenizer(ckpt), eos=weights.eos_ids(ckpt), **kw)


@contextlib.contextmanager
def _programs(h):
    """Records the programs each row `h` issues runs in: {(prompt, choice, position): {program}}
    (a row recomputed after a preemption runs again)."""
    seen: dict = {}
    take = h._take

    def spy(plan):
        k, program, pieces = take(plan)
        for (r, _, _, _), piece in zip(h.inflight[-1][2], pieces, strict=True):
            for j in range(len(piece.tokens)):
                seen.setdefault((tuple(r.tokens[:r.prompt]), r.choice, piece.start + j),
                                set()).add(program)
        return k, program, pieces
    h._take = spy
    try:
        yield seen
    finally:
        del h._take


def _greedy(pipe, tokens, n):
    pipe.reset()
    steps = list(pipe.generate(tokens, max_tokens=n))
    return [int(np.asarray(s["next_token"])[0]) for s in steps], \
        [float(np.asarray(s["logprob"])[0]) for s in steps]


def test_greedy_generation_is_the_pipelines_token_for_token(served):
    h, ref, ckpt = served
    prompt = list(range(3, 40))
    want, lps = _greedy(ref, prompt, 12)

    async def go():
        async with _client(h, ckpt) as c:
            return await post(c, {"prompt": prompt, "max_tokens": 12, "temperature": 0,
                                  "logprobs": 2, "ignore_eos": True})
    status, r = run(go())
    assert status == 200, r
    ch = r["choices"][0]
    assert ch["token_ids"] == want and ch["finish_reason"] == "length"
    assert ch["logprobs"]["token_logprobs"] == lps  # JSON floats round-trip: the same bits
    assert r["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 12,
                          "total_tokens": len(prompt) + 12}
    tops = ch["logprobs"]["top_logprobs"]
    assert all(2 <= len(t) <= 3 for t in tops)  # the 2 likeliest, and the token when not among them


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(served):
    h, ref, ckpt = served
    prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22] * 4  # 48 tokens: two chunks
    ref.reset()
    outs = [{k: np.asarray(v) for k, v in o.items()} for o in ref.score(prompt)]
    want = np.concatenate([o["target_logprob"] for o in outs])[:len(prompt) - 1]
    body = {"prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0}

    async def go():
        async with _client(h, ckpt) as c:
            one = await post(c, body)
            zero = await post(c, {**body, "max_tokens": 0})
            batch = await post(c, {**body, "prompt": [prompt, prompt[:5]]})
            return one, zero, batch
    (s1, r1), (s0, r0), (sb, rb) = run(go())
    assert s1 == s0 == sb == 200, (r1, r0, rb)
    lp = r1["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:len(prompt)] == want.tolist()
    assert len(lp["tokens"]) == len(prompt) + 1 == len(lp["text_offset"])
    assert r1["choices"][0]["prompt_token_ids"] == prompt
    assert r0["choices"][0]["logprobs"]["token_logprobs"] == lp["token_logprobs"][:-1]
    assert r0["usage"]["completion_tokens"] == 0
    # lm-eval's reading: is_greedy is the token's logprob against the largest of its tops
    for tok_lp, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert tok_lp <= max(top.values()) and len(top) in (1, 2)
    assert rb["choices"][0]["logprobs"] == lp  # the same prompt beside another: the same bits


def test_sampling_with_a_seed_repeats_and_n_draws_different_choices(served):
    h, _, ckpt = served
    body = {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 1.0, "top_p": 0.95,
            "seed": 7, "n": 3, "ignore_eos": True}

    async def go():
        async with _client(h, ckpt) as c:
            a = await post(c, body)
            b = await post(c, body)
            other = await post(c, {**body, "seed": 8})
            r = await c.post("/v1/completions", json={**body, "stream": True})
            return a, b, other, events(await r.text())
    (sa, a), (_, b), (_, other), ev = run(go())
    assert sa == 200, a
    ids = [c["token_ids"] for c in a["choices"]]
    assert ids == [c["token_ids"] for c in b["choices"]]
    assert len({tuple(x) for x in ids}) == 3
    assert ids != [c["token_ids"] for c in other["choices"]]
    assert ev[-1] == "[DONE]"
    streamed = {}
    for e in ev[:-1]:
        for c in e["choices"]:
            streamed[c["index"]] = streamed.get(c["index"], "") + c["text"]
    assert [streamed[i] for i in range(3)] == [c["text"] for c in a["choices"]]


def test_stop_strings_stop_token_ids_and_the_checkpoints_eos_end_a_choice(served):
    h, ref, ckpt = served
    prompt = "The quick brown fox"
    tok = weights.tokenizer(ckpt)
    ids = tok.encode(prompt, add_special_tokens=False).ids
    greedy, _ = _greedy(ref, ids, 8)
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}

    async def go():
        async with _client(h, ckpt) as c:
            full = await post(c, body)
            text = full[1]["choices"][0]["text"]
            cut = text[len(text) // 2:len(text) // 2 + 2] or text
            by_string = await post(c, {**body, "stop": [cut]})
            by_id = await post(c, {**body, "stop_token_ids": [greedy[3]]})
            return full, cut, by_string, by_id
    (_, full), cut, (_, s), (_, i) = run(go())
    text = full["choices"][0]["text"]
    assert full["choices"][0]["token_ids"] == greedy
    assert s["choices"][0]["finish_reason"] == "stop"
    assert s["choices"][0]["text"] == text[:text.find(cut)] and cut not in s["choices"][0]["text"]
    assert i["choices"][0]["finish_reason"] == "stop"
    assert i["choices"][0]["token_ids"] == greedy[:greedy.index(greedy[3]) + 1]
    assert weights.eos_ids(ckpt), "the random checkpoint names its EOS"


def test_chat_renders_the_checkpoints_template_and_answers_with_logprobs(served):
    h, ref, ckpt = served
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    tok = weights.tokenizer(ckpt)
    text = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    greedy, lps = _greedy(ref, tok.encode(text, add_special_tokens=False).ids, 6)

    async def go():
        async with _client(h, ckpt) as c:
            return await post(c, {"messages": msgs, "max_tokens": 6, "temperature": 0,
                                  "logprobs": True, "top_logprobs": 3, "ignore_eos": True},
                              "/v1/chat/completions")
    status, r = run(go())
    assert status == 200, r
    ch = r["choices"][0]
    assert ch["message"]["role"] == "assistant"
    assert [e["logprob"] for e in ch["logprobs"]["content"]] == lps
    assert all(len(e["top_logprobs"]) == 3 for e in ch["logprobs"]["content"])
    assert ch["message"]["content"] == tok.decode(greedy)


@pytest.mark.parametrize("extra, param", [
    ({"logprobs": 21}, "logprobs"), ({"n": 0}, "n"), ({"best_of": 3}, "best_of"),
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"min_p": 2}, "min_p"),
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"logit_bias": {"5": 1}}, "logit_bias"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 0, "echo": True, "n": 2}, "n"),
    ({"stop": [""]}, "stop"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"seed": 1.5}, "seed"), ({"frobnicate": 1}, "frobnicate"),
])
def test_fields_the_server_cannot_honour_are_400s_naming_them(served, extra, param):
    h, _, ckpt = served

    async def go():
        async with _client(h, ckpt) as c:
            return await post(c, {"prompt": [1, 2], **extra})
    status, r = run(go())
    assert status == 400 and r["error"]["param"] == param, r


def test_a_sequence_past_the_context_is_refused_with_the_limit(served):
    h, _, ckpt = served

    async def go():
        async with _client(h, ckpt) as c:
            return await post(c, {"prompt": [1] * 200, "max_tokens": 100})
    status, r = run(go())
    assert status == 400 and "max_tokens is 100" in r["error"]["message"], r
    assert str(CONTEXT) in r["error"]["message"]


def test_the_tokenizer_endpoints_answer_as_vllms(served):
    h, _, ckpt = served
    tok = weights.tokenizer(ckpt)

    async def go():
        async with _client(h, ckpt) as c:
            t = await post(c, {"prompt": "Hello, world!", "add_special_tokens": False},
                           "/tokenize")
            d = await post(c, {"tokens": t[1]["tokens"]}, "/detokenize")
            info = await c.get("/tokenizer_info")
            return t, d, await info.json()
    (st, t), (sd, d), info = run(go())
    assert st == sd == 200
    assert t["tokens"] == tok.encode("Hello, world!", add_special_tokens=False).ids
    assert t["count"] == len(t["tokens"]) and t["max_model_len"] == CONTEXT
    assert d["prompt"] == "Hello, world!"
    assert info["eos_token"] == "<|im_end|>" and "<|im_start|>" in info["chat_template"]


def _alone_then_together(h, ckpt, prompts, body):
    """Each prompt served alone, one after another, then all at once: (the answers alone, the
    answers together, each run's rows by program as `_programs` records them)."""
    async def go():
        async with _client(h, ckpt) as c:
            with _programs(h) as one:
                alone = [await post(c, {**body, "prompt": p}) for p in prompts]
            with _programs(h) as many:
                together = await asyncio.gather(*(post(c, {**body, "prompt": p})
                                                  for p in prompts))
            return alone, together, one, many
    return run(go())


def _steps(rows) -> set:
    """The programs steps ran in (rows from a prompt's last on), in `_programs`' record."""
    return {p for (t, _, pos), ps in rows.items() if pos >= len(t) - 1 for p in ps}


def test_sixteen_at_once_give_each_the_bits_it_gets_alone(served):
    h, _, ckpt = served
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, CFG.vocab, int(n)).tolist() for n in rng.integers(1, 60, 16)]
    body = {"max_tokens": 6, "temperature": 0.8, "seed": 3, "logprobs": 1, "ignore_eos": True}
    alone, together, one, many = _alone_then_together(h, ckpt, prompts, body)
    for (sa, a), (sb, b) in zip(alone, together, strict=True):
        assert sa == sb == 200
        assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
        assert a["choices"][0]["logprobs"] == b["choices"][0]["logprobs"]
    # batch-invariant: each row ran in the same program alone as beside 15 others (on a GPU a
    # row's bits follow its program's row count), every step in the one bucket
    assert one == many
    assert _steps(many) == {"decode16"}
    assert {p for (t, _, pos), ps in many.items() if pos < len(t) - 1 for p in ps} <= {"prefill"}


def test_not_batch_invariant_steps_take_the_smallest_bucket_or_ride_beside_prompt_rows(served):
    """`--nobatch_invariant`: steps take the smallest bucket that holds them, or the chunk beside
    prompt rows, so a row's program follows its company; on the CPU its bits do not."""
    h, _, ckpt = served
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, CFG.vocab, int(n)).tolist() for n in rng.integers(20, 60, 6)]
    body = {"max_tokens": 4, "temperature": 0.8, "seed": 5, "logprobs": 1, "ignore_eos": True}
    h.invariant = False
    try:
        alone, together, one, many = _alone_then_together(h, ckpt, prompts, body)
    finally:
        h.invariant = True
    assert [a[1]["choices"] for a in alone] == [b[1]["choices"] for b in together]
    assert _steps(one) == {"decode1"} and _steps(many) - {"decode1"}, _steps(many)


def test_out_of_pages_a_sequence_is_preempted_and_recomputed_never_lost(served,
                                                                          tmp_path_factory):
    """A pool of 12 pages (192 tokens) and four sequences that grow to 90 tokens each: steps run
    out of pages, the newest sequence gives its pages back and is recomputed later; every answer
    equals the roomy server's, bit for bit."""
    big, _, ckpt = served
    small, _ = _head(tmp_path_factory.mktemp("small"), pages=13, name="small")
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, CFG.vocab, 30).tolist() for _ in range(4)]
    body = {"max_tokens": 60, "temperature": 0.5, "seed": 1, "logprobs": 0, "ignore_eos": True}

    async def go(h):
        async with _client(h, ckpt) as c:
            with _programs(h) as rows:
                return await asyncio.gather(*(post(c, {**body, "prompt": p}) for p in prompts)), \
                    rows
    (want, roomy), (got, tight) = run(go(big)), run(go(small))
    for (sw, w), (sg, g) in zip(want, got, strict=True):
        assert sw == sg == 200, g
        assert w["choices"][0]["token_ids"] == g["choices"][0]["token_ids"]
        assert w["choices"][0]["logprobs"] == g["choices"][0]["logprobs"]
    assert small.preemptions > 0
    assert roomy == tight  # a recomputed row ran in the program it first ran in
    assert small.pool.in_use == 0


def test_a_client_that_goes_mid_stream_frees_its_sequence(served):
    h, _, ckpt = served

    async def go():
        async with _client(h, ckpt) as c:
            r = await c.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 200,
                                                      "stream": True, "ignore_eos": True})
            await r.content.readline()  # the first chunk is out: it is generating
            r.close()
            for _ in range(200):
                if h.pool.in_use == 0 and not h.live:
                    return True
                await asyncio.sleep(0.05)
            return False
    assert run(go())


def test_the_openai_client_completes_chats_streams_and_reads_logprobs(served):
    openai = pytest.importorskip("openai")
    h, ref, ckpt = served
    app = make_app(h, name="qwen3-tiny", vocab=CFG.vocab, tokenizer=weights.tokenizer(ckpt),
                   checkpoint=ckpt, eos=weights.eos_ids(ckpt))
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    from aiohttp import web
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.SockSite(runner, sock).start())
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    try:
        cl = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=60)
        c = cl.completions.create(model="qwen3-tiny", prompt="Hello", max_tokens=5,
                                  temperature=0, logprobs=2, seed=1)
        assert len(c.choices[0].logprobs.tokens) == 5 and c.usage.completion_tokens == 5
        e = cl.completions.create(model="qwen3-tiny", prompt=[1, 2, 3], max_tokens=0,
                                  echo=True, logprobs=1)
        assert e.choices[0].logprobs.token_logprobs[0] is None
        ch = cl.chat.completions.create(model="qwen3-tiny", max_tokens=4, seed=2,
                                        messages=[{"role": "user", "content": "Hi"}],
                                        logprobs=True, top_logprobs=2, stop=["zzz"])
        assert ch.choices[0].message.role == "assistant"
        assert len(ch.choices[0].logprobs.content) == ch.usage.completion_tokens
        parts = list(cl.chat.completions.create(
            model="qwen3-tiny", max_tokens=4, seed=2, stream=True,
            stream_options={"include_usage": True}, stop=["zzz"],
            messages=[{"role": "user", "content": "Hi"}]))
        text = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
        assert text == ch.choices[0].message.content
        assert parts[-1].usage.completion_tokens == ch.usage.completion_tokens
    finally:
        loop.call_soon_threadsafe(loop.stop)
        t.join(10)
        sock.close()


def test_without_decode_programs_steps_go_in_the_chunk_and_give_the_same_bits(served,
                                                                               tmp_path_factory):
    """A cut with no decode bucket (`kernjax cut --decode=`, and what a device transport serves):
    a prompt's last chunk samples its first token and every step is a row of the prefill chunk,
    beside others' rows; the tokens and log-probabilities are the roomy server's."""
    big, _, ckpt = served
    plain, _ = _head(tmp_path_factory.mktemp("plain"), name="plain", decode=())
    assert plain.buckets == []
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, CFG.vocab, int(n)).tolist() for n in (1, 5, 33, 40)]
    body = {"max_tokens": 7, "temperature": 0.7, "seed": 2, "logprobs": 2, "ignore_eos": True}

    async def go(h):
        async with _client(h, ckpt) as c:
            return await asyncio.gather(*(post(c, {**body, "prompt": p}) for p in prompts))
    want, got = run(go(big)), run(go(plain))
    for (sw, w), (sg, g) in zip(want, got, strict=True):
        assert sw == sg == 200, g
        assert w["choices"] == g["choices"]
