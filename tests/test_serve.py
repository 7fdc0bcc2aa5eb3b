"""Serving as real processes on loopback: 2- and 3-stage pipelines of qwen3-tiny against the
single-process server, packing, 100 concurrent requests, bad input, and faults (a killed stage,
a frozen stage, a stage of another cut)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import jax
import pytest

from kernjax import models
from tests.conftest import add_tokenizer
from tests.serving import Pipeline, Procs, refusing_port, until, writers

_, CFG = models.named("qwen3-tiny")
CONTEXT = 512
LENGTHS = [1, 31, 32, 33, 100, 200, 500]


def _cut(out: Path, at: str) -> Path:
    p = subprocess.run([sys.executable, "-m", "kernjax", "cut", "--model", "qwen3-tiny", "--at", at,
                        "--chunk", "32", "--seqs", "4", "--context", str(CONTEXT), "--decode", "1,4",
                        "--out", str(out)],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    return out


@pytest.fixture(scope="module")
def cuts(tmp_path_factory):
    t = tmp_path_factory.mktemp("cuts")
    return {2: _cut(t / "two", "1"), 3: _cut(t / "three", "1,c33")}


@pytest.fixture(scope="module")
def servers(cuts, tmp_path_factory):
    procs = Procs()
    try:  # the three start at once
        made = {n: Pipeline(procs, cut, tmp_path_factory.mktemp(f"serve{n}"), stages=n)
                for n, cut in ((1, cuts[2]), (2, cuts[2]), (3, cuts[3]))}
        for p in made.values():
            p.start_stages()
        yield {n: p.ready() for n, p in made.items()}
    finally:
        procs.stop()


def _prompts():
    import numpy as np
    rng = np.random.default_rng(7)
    return [rng.integers(0, CFG.vocab, n).tolist() for n in LENGTHS]


async def _post(session, url, body, raw=None):
    data = raw if raw is not None else json.dumps(body)
    async with session.post(url + "/v1/completions", data=data) as r:
        return r.status, await r.json(content_type=None)


def _complete(url, prompts, *, concurrent: bool, model: str = "qwen3-tiny"):
    async def go():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            body = lambda p: {"model": model, "prompt": p, "max_tokens": 1,  # noqa: E731
                              "temperature": 0}
            if concurrent:
                return await asyncio.gather(*(_post(s, url, body(p)) for p in prompts))
            return [await _post(s, url, body(p)) for p in prompts]
    return asyncio.run(go())


def _tokens(results):
    """Each answer's token ids, all of them."""
    assert all(status == 200 and len(r["choices"]) == 1 for status, r in results), results
    return [r["choices"][0]["token_ids"] for _, r in results]


def _metric(url, name) -> float:
    async def go():
        async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
            return await r.text()
    for line in asyncio.run(go()).splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def test_pipelines_give_the_single_process_servers_tokens(servers):
    prompts = _prompts()
    want = _tokens(_complete(servers[1].http, prompts, concurrent=False))
    for n in (2, 3):
        assert _tokens(_complete(servers[n].http, prompts, concurrent=False)) == want, n
        assert _tokens(_complete(servers[n].http, prompts, concurrent=True)) == want, n


def test_the_served_cuts_give_the_whole_programs_logits_bitwise(cuts, tmp_path):
    """The API answers with tokens only; the logits behind them: `kernjax chain` on the cuts the
    pipelines serve compares the last stage's logits and token with the whole program's, byte for
    byte, after every chunk of the prompts the tests above send."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(" ".join(map(str, p)) + "\n" for p in _prompts()))
    for n in (2, 3):
        p = subprocess.run([sys.executable, "-m", "kernjax", "chain", "--stages", str(cuts[n]),
                            "--prompts", str(prompts)], capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, (n, p.stdout, p.stderr)
        assert f"PASS: {len(LENGTHS)} prompts bitwise identical" in p.stdout, (n, p.stdout)
        assert p.stdout.count(": IDENTICAL") == len(LENGTHS), (n, p.stdout)


def test_packed_and_unpacked_give_the_same_first_tokens(servers):
    url = servers[2].http
    short = [p[:20] for p in _prompts()[2:]] + [p[:9] for p in _prompts()[4:]]
    items = _metric(url, "kernjax_items_total")
    alone = _tokens(_complete(url, short, concurrent=False))
    between = _metric(url, "kernjax_items_total")
    packed = _tokens(_complete(url, short, concurrent=True))
    assert packed == alone
    assert _metric(url, "kernjax_items_total") - between < between - items, "nothing was packed"


def test_100_concurrent_requests_all_answered_and_pages_return(servers):
    import numpy as np
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, CFG.vocab, int(rng.integers(1, 120))).tolist() for _ in range(100)]
    res = _complete(servers[2].http, prompts, concurrent=True)
    assert [s for s, _ in res] == [200] * 100
    assert all(r["usage"]["prompt_tokens"] == len(p) for (_, r), p in zip(res, prompts))
    # each the single-process server's token: 100 answers compared, not one
    assert _tokens(res) == _tokens(_complete(servers[1].http, prompts, concurrent=True))
    assert _metric(servers[2].http, "kernjax_pages_in_use") == 0


@pytest.mark.parametrize("body, status, words", [
    (b"{not json", 400, "not JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b'{"max_tokens": 1}', 400, "prompt must be"),
    (b'{"prompt": [1, 2], "presence_penalty": 1}', 400, "applies no penalties"),
    (b'{"prompt": [], "max_tokens": 1}', 400, "empty"),
    (b'{"prompt": [1, 99999]}', 400, "outside the vocabulary"),
    (b'{"prompt": [[1], 2]}', 400, "prompt must be"),
    (b'{"model": "gpt-9", "prompt": [1]}', 404, "does not exist"),
    (json.dumps({"prompt": [1] * (CONTEXT + 1)}).encode(), 400, "512"),
])
def test_bad_requests_get_errors_not_crashes(servers, body, status, words):
    async def go():
        async with aiohttp.ClientSession() as s:
            return await _post(s, servers[2].http, None, raw=body)
    got, r = asyncio.run(go())
    assert got == status and words in r["error"]["message"], r
    assert _complete(servers[2].http, [[1, 2, 3]], concurrent=False)[0][0] == 200


def test_models_and_health(servers):
    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.get(servers[3].http + "/v1/models") as r:
                m = await r.json()
            async with s.get(servers[3].http + "/health") as r:
                return m, r.status, await r.json()
    m, status, h = asyncio.run(go())
    assert m["data"][0]["id"] == "qwen3-tiny" and m["data"][0]["max_model_len"] == CONTEXT
    assert status == 200 and h["stages"] == 3


GENERATE = [
    {"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0, "logprobs": 3, "ignore_eos": True},
    {"prompt": list(range(40, 140)), "max_tokens": 6, "temperature": 0.9, "top_p": 0.9,
     "seed": 4, "n": 2, "logprobs": 1, "ignore_eos": True},
    {"prompt": list(range(3, 80)), "max_tokens": 0, "echo": True, "logprobs": 5},
    {"prompt": "Hello, world!", "max_tokens": 5, "echo": True, "logprobs": 2, "seed": 1,
     "temperature": 1.0, "stop": ["zz"]},
]


def _answers(url, bodies, *, concurrent: bool):
    """The choices of each answer (their token ids, text, log-probabilities, finish)."""
    async def go():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
            if concurrent:
                return await asyncio.gather(*(_post(s, url, b) for b in bodies))
            return [await _post(s, url, b) for b in bodies]
    got = asyncio.run(go())
    assert all(status == 200 for status, _ in got), got
    return [r["choices"] for _, r in got]


def test_generation_and_scores_are_the_same_bits_whole_and_split(servers):
    """Generated tokens, their log-probabilities and a prompt's scores from the 2- and 3-stage
    pipelines equal the whole program's byte for byte (JSON floats round-trip), one request at a
    time and all at once."""
    want = _answers(servers[1].http, GENERATE, concurrent=False)
    assert want[2][0]["logprobs"]["token_logprobs"][0] is None
    assert len(want[2][0]["logprobs"]["token_logprobs"]) == 77
    for n in (2, 3):
        assert _answers(servers[n].http, GENERATE, concurrent=False) == want, n
        assert _answers(servers[n].http, GENERATE * 2, concurrent=True) == want * 2, n
        assert _metric(servers[n].http, "kernjax_pages_in_use") == 0


def test_the_shm_transport_gives_the_same_tokens_and_says_so(cuts, servers, tmp_path, procs):
    """Stages that move activations in their programs (`--transport shm`, kernjax/runtime/edge.py), one
    slot per edge in the 3-stage pipeline: the single-process server's tokens, one request at a
    time and 16 at once; the transport is in /metrics and in every stage's startup line."""
    prompts = _prompts()
    want = _tokens(_complete(servers[1].http, prompts, concurrent=False))
    pipes = {}
    for n, slots in ((2, "2"), (3, "1")):  # both start at once
        (tmp_path / f"shm{n}").mkdir()
        pipes[n, slots] = Pipeline(procs, cuts[n], tmp_path / f"shm{n}", stages=n,
                                   extra=("--transport", "shm", "--edge_slots", slots))
    for pipe in pipes.values():
        pipe.start_stages()
    for (n, slots), pipe in pipes.items():
        pipe.ready()
        assert _tokens(_complete(pipe.http, prompts, concurrent=False)) == want, pipe.logs()
        assert _tokens(_complete(pipe.http, (prompts * 3)[:16], concurrent=True)) == \
            (want * 3)[:16], pipe.logs()
        assert _metric(pipe.http, 'kernjax_transport{kind="shm"}') == 1
        # steps go in the prefill chunk there (the device transports carry its activations
        # only): the same tokens and log-probabilities; scoring is refused, saying why
        gen = [b for b in GENERATE if not b.get("echo")]
        assert _answers(pipe.http, gen, concurrent=True) == \
            _answers(servers[1].http, gen, concurrent=False)
        (status, r), = asyncio.run(_one(pipe.http, GENERATE[2]))
        assert status == 400 and "--transport host" in r["error"]["message"], r
        for st in range(n):  # each stage's weights and states, from its Hello, and what
            # its program holds at once, its arguments among them
            got = {k: _metric(pipe.http, f'kernjax_stage_memory_bytes{{kind="{k}",stage="{st}"}}')
                   for k in ("weights", "states", "program")}
            assert got["weights"] > 0 and got["program"] > got["weights"] + got["states"], got
        assert "weights " in pipe.procs[1].text() and "B + states" in pipe.procs[1].text()
        assert "the program holds " in pipe.procs[1].text()
        assert _metric(pipe.http, "kernjax_pages_in_use") == 0
        for p in pipe.procs[1:]:
            assert f"transport shm ({slots} slots per edge)" in p.text()
        assert "transport shm" in pipe.procs[0].text()


def test_stages_with_different_transports_are_refused(cuts, tmp_path, procs):
    head = procs.head(cuts[2] / "stage0", tmp_path / "h.log", "--transport", "shm")
    stage = procs.joiner(cuts[2] / "stage1", head.pp, tmp_path / "s.log")
    stage.wait_for("uses the shm transport", 60)
    head.wait_for("uses the host transport", 5)
    assert "stage 1 uses the host transport; the head uses shm: start every stage with the " \
        "same --transport" in head.text() + stage.text(), head.text() + stage.text()


def test_a_stage_with_other_weights_of_the_same_shapes_is_refused(cuts, tmp_path, procs):
    """Another seed of the same model: every shape agrees, every byte differs; a pipeline of the
    two would answer with neither model's tokens, so the head refuses the stage, naming both."""
    other = tmp_path / "other"
    p = subprocess.run([sys.executable, "-m", "kernjax", "weights", "random", "--model", "qwen3-tiny",
                        "--seed", "1", "--out", str(other)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    head = procs.head(cuts[2] / "stage0", tmp_path / "h.log")
    stage = procs.joiner(cuts[2] / "stage1", head.pp, tmp_path / "s.log", "--weights", str(other))
    head.wait_for("their tensors differ", 60)
    stage.wait_for("start every stage with --weights ", 30)  # the refusal reaches the stage
    text = head.text() + stage.text()
    assert f"stage 1 runs the weights of `{other}`" in text, text
    assert "start every stage with --weights " in stage.text(), text


def test_a_checkpoint_changed_after_the_head_loaded_it_is_refused(cuts, tmp_path, procs):
    """Head and stage name one directory, but its tensors changed in between: restart them all."""
    def random(seed, out):
        p = subprocess.run([sys.executable, "-m", "kernjax", "weights", "random", "--model",
                            "qwen3-tiny", "--seed", str(seed), "--out", str(out)],
                           capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
    random(0, tmp_path / "mine")
    random(1, tmp_path / "seed1")
    head = procs.head(cuts[2] / "stage0", tmp_path / "h.log", "--weights", str(tmp_path / "mine"))
    pp = head.pp  # named once the head waits for its stage: it has loaded the checkpoint
    (tmp_path / "seed1" / "model.safetensors").replace(tmp_path / "mine" / "model.safetensors")
    stage = procs.joiner(cuts[2] / "stage1", pp, tmp_path / "s.log", "--weights",
                         str(tmp_path / "mine"))
    stage.wait_for("changed since the head loaded it", 60)
    assert "restart the head and every stage" in stage.text(), stage.text()


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the GPU transports need GPUs")
@pytest.mark.parametrize("kind", ["shm", "ipc", "nccl"])
def test_gpu_transports_give_the_single_process_servers_tokens(cuts, servers, tmp_path, kind,
                                                              procs):
    """Each stage on its own GPU where there are two (NCCL wants them): the edge ops' CUDA
    handlers move the activations, and the answers are the single-process server's."""
    gpus = jax.device_count()
    if kind == "nccl" and gpus < 2:
        pytest.skip("NCCL puts its two ranks on two GPUs")
    prompts = _prompts()
    want = _tokens(_complete(servers[1].http, prompts, concurrent=False))
    pipe = Pipeline(procs, cuts[2], tmp_path, stages=2, extra=("--transport", kind),
                    gpus=gpus).ready()
    assert _tokens(_complete(pipe.http, prompts, concurrent=False)) == want, pipe.logs()
    assert _tokens(_complete(pipe.http, (prompts * 3)[:16], concurrent=True)) == \
        (want * 3)[:16], pipe.logs()
    assert _metric(pipe.http, f'kernjax_transport{{kind="{kind}"}}') == 1


@pytest.mark.parametrize("kind", ["ipc", "nccl"])
def test_gpu_transports_on_the_cpu_are_refused_with_what_to_use(cuts, tmp_path, kind, procs):
    if jax.default_backend() == "gpu":
        pytest.skip(f"a GPU process may use --transport {kind}")
    with refusing_port() as nobody:  # refused before it would reach for a head
        p = procs.serve("--stage_dir", str(cuts[2] / "stage1"), "--pp_head",
                        f"127.0.0.1:{nobody.getsockname()[1]}", "--transport", kind,
                        log=tmp_path / f"{kind}.log")
        assert p.wait(60) == 2, p.text()
    assert f"--transport {kind} moves activations between GPUs; this process runs on cpu: use " \
        "--transport shm (one host) or host" in p.text()


async def _many(url, bodies):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        return await asyncio.gather(*(_post(s, url, b) for b in bodies))


def test_a_killed_stage_ends_an_shm_pipeline_with_503s(cuts, tmp_path, procs):
    pipe = Pipeline(procs, cuts[3], tmp_path, stages=3, extra=("--transport", "shm")).ready()
    os.kill(pipe.procs[1].p.pid, signal.SIGKILL)
    (status, r), = asyncio.run(_one(pipe.http, {"prompt": [5, 6, 7]}))
    assert status == 503 and "stage 1" in r["error"]["message"], r
    assert pipe.procs[0].wait(30) not in (None, 0), pipe.logs()
    assert pipe.procs[2].wait(30) not in (None, 0), pipe.logs()
    # the resource trackers (child processes, writing to their process's log) end after it
    assert until(lambda: not any(writers(p.log) for p in pipe.procs), 30), pipe.logs()
    assert "resource_tracker" not in pipe.logs(), pipe.logs()  # no "leak" it mended itself


def test_a_killed_stage_fails_in_flight_requests_with_503_and_every_process_exits(cuts, tmp_path,
                                                                                  procs):
    pipe = Pipeline(procs, cuts[3], tmp_path, stages=3).ready()
    os.kill(pipe.procs[1].p.pid, signal.SIGSTOP)   # hold requests in flight, then kill

    async def go():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            tasks = [asyncio.create_task(_post(s, pipe.http, {"prompt": [1, 2, 3, i]}))
                     for i in range(5)]
            for _ in range(600):  # until all five are in flight
                if "kernjax_http_in_progress 5.0" in await (await s.get(
                        f"{pipe.http}/metrics")).text():
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the five requests never were in flight together")
            os.kill(pipe.procs[1].p.pid, signal.SIGKILL)
            return await asyncio.gather(*tasks)
    # answered (within the client's 60 s, far from a hang), each with a 503 naming the stage
    res = asyncio.run(go())
    assert all(s == 503 and "stage 1" in r["error"]["message"] for s, r in res), res
    assert pipe.procs[0].wait(30) not in (None, 0), pipe.logs()
    assert pipe.procs[2].wait(30) not in (None, 0), pipe.logs()
    assert "error: head: stage 1" in pipe.procs[0].text()


@pytest.mark.parametrize("extra, requests, says", [
    ((), 1, r"stage 1 stopped answering"),
    # shm: the head's programs may be held on the device waiting for the frozen stage's slots;
    # its watcher or its heartbeat notices first
    (("--transport", "shm", "--edge_slots", "1"), 4, r"stage 1 stopped (answering|taking items)"),
], ids=["host", "shm"])
def test_a_frozen_stage_is_detected_within_the_stage_timeout(cuts, tmp_path, extra, requests,
                                                             says, procs):
    """--stage_timeout 3: the requests' 503s say the stage stopped answering, which only the
    timeout tells (the client would give up after 60 s)."""
    pipe = Pipeline(procs, cuts[2], tmp_path, stages=2, timeout=3, extra=extra).ready()
    os.kill(pipe.procs[1].p.pid, signal.SIGSTOP)  # killed (SIGKILL) frozen when reaped
    res = asyncio.run(_many(pipe.http, [{"prompt": [5, 6, 7, i]} for i in range(requests)]))
    assert all(status == 503 and re.search(says, r["error"]["message"])
               for status, r in res), res
    assert pipe.procs[0].wait(30) not in (None, 0), pipe.logs()


@pytest.mark.skipif(jax.default_backend() != "gpu" or jax.device_count() < 2,
                    reason="a stage on each of two GPUs")
@pytest.mark.parametrize("kind", ["ipc", "nccl"])
@pytest.mark.parametrize("fault", ["killed", "frozen"])
def test_a_killed_or_frozen_stage_on_its_own_gpu_ends_the_pipeline_with_503s(cuts, tmp_path, kind,
                                                                            fault, procs):
    """As on the CPU: the head's programs may be held on its GPU by the device transport, and
    still every request gets a 503 naming the stage, and the head exits."""
    pipe = Pipeline(procs, cuts[2], tmp_path, stages=2, timeout=3, extra=("--transport", kind),
                    gpus=2).ready()
    stage = pipe.procs[1].p.pid
    os.kill(stage, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
    res = asyncio.run(_many(pipe.http, [{"prompt": [5, 6, 7, i]} for i in range(4)]))
    assert all(status == 503 and "stage 1" in r["error"]["message"] for status, r in res), res
    assert pipe.procs[0].wait(30) not in (None, 0), pipe.logs()
    if fault == "frozen":  # thawed, it finds the head gone and exits too
        os.kill(stage, signal.SIGCONT)
        assert pipe.procs[1].wait(30) not in (None, 0), pipe.logs()


async def _one(url, body):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        return [await _post(s, url, body)]


def test_bad_frames_and_foreign_stages_are_refused(cuts, tmp_path, procs):
    other = _cut(tmp_path / "other", "2")  # another cut: another id
    head = procs.head(cuts[2] / "stage0", tmp_path / "head.log")
    pp = head.pp
    with socket.create_connection(("127.0.0.1", pp)) as s:
        s.sendall(b"GET / HTTP/1.1\r\n\r\n")
        assert head.wait_for("not a kernjax frame", 30), head.text()
    foreign = procs.joiner(other / "stage1", pp, tmp_path / "foreign.log")
    assert foreign.wait(60) == 1
    assert "belongs to cut" in foreign.text(), foreign.text()
    procs.joiner(cuts[2] / "stage1", pp, tmp_path / "real.log")
    assert head.wait_for("serving"), head.text()
    assert "belongs to cut" in head.text(), head.text()
    (status, _), = asyncio.run(_one(head.url, {"prompt": [1, 2]}))
    assert status == 200


def test_a_text_prompt_is_tokenized_and_answered_as_text(tmp_path, procs):
    ckpt = tmp_path / "ckpt"
    p = subprocess.run([sys.executable, "-m", "kernjax", "weights", "random", "--model", "qwen3-tiny",
                        "--out", str(ckpt)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    add_tokenizer(ckpt, CFG.vocab)
    proc = procs.serve("--weights", str(ckpt), "--port", "0", "--chunk", "32", "--context", "64",
                       log=tmp_path / "serve.log")
    assert proc.wait_for("serving", 120), proc.text()
    assert "steps in decode64, batch-invariant" in proc.text(), proc.text()  # the default policy
    url = proc.url
    (s1, text), = asyncio.run(_one(url, {"prompt": "w5 w6 w7", "max_tokens": 1}))
    (s2, ids), = asyncio.run(_one(url, {"prompt": [5, 6, 7], "max_tokens": 1}))
    assert s1 == s2 == 200, (text, ids, proc.text())
    token = ids["choices"][0]["token_ids"][0]
    assert text["choices"][0]["token_ids"] == [token]
    assert text["choices"][0]["text"] == f"w{token}" and text["usage"]["prompt_tokens"] == 3


def test_a_duplicate_stage_is_refused_and_a_missing_one_ends_the_head(cuts, tmp_path, procs):
    # 20 s: the duplicate, a second python process, must reach the head before it gives up,
    # and with 4 test workers on 2 cores it took more than the 8 s it once had (2026-12-03)
    head = procs.head(cuts[3] / "stage0", tmp_path / "head.log", "--startup_timeout", "20")
    pp = head.pp
    # two stage 1s at once, started when the head waits: the first to say Hello joins
    twins = [procs.joiner(cuts[3] / "stage1", pp, tmp_path / f"stage1-{k}.log") for k in "ab"]
    assert until(lambda: any(p.p.poll() is not None for p in twins), 60), head.text()
    again, first = twins if twins[0].p.poll() is not None else twins[::-1]
    assert again.wait(0) == 1, again.text()
    assert "stage 1 has joined already" in again.text(), again.text()
    assert head.text().count("stage 1 joined from") == 1, head.text()
    assert head.wait(60) == 2, head.text()
    assert "stages [2] did not join within 20 s" in head.text(), head.text()
    assert first.wait(30) not in (None, 0)
    assert "the head gives up: stages [2] did not join" in first.text(), first.text()


def test_a_stage_that_leaves_before_the_pipeline_starts_can_join_again(cuts, tmp_path, procs):
    """Stage 1 says Hello and dies while the head waits for stage 2: its restart joins in its
    place, and once stage 2 is in, the pipeline serves."""
    head = procs.head(cuts[3] / "stage0", tmp_path / "head.log")
    pp = head.pp
    first = procs.joiner(cuts[3] / "stage1", pp, tmp_path / "first.log")
    assert head.wait_for("stage 1 joined"), head.text()
    first.stop()
    procs.joiner(cuts[3] / "stage1", pp, tmp_path / "again.log")
    assert head.wait_for("stage 1 joined from", 60, times=2), head.text()  # the restart
    procs.joiner(cuts[3] / "stage2", pp, tmp_path / "last.log")
    assert head.wait_for("serving", 120), head.text()
    (status, _), = asyncio.run(_one(head.url, {"prompt": [1, 2]}))
    assert status == 200, head.text()
    assert head.text().count("stage 1 joined from") == 2, head.text()


def test_an_oversized_frame_is_refused_with_the_limit(cuts, tmp_path, procs):
    head = procs.head(cuts[2] / "stage0", tmp_path / "head.log")
    stage = procs.joiner(cuts[2] / "stage1", head.pp, tmp_path / "stage1.log", "--max_frame",
                         "4096")
    assert head.wait_for("serving"), head.text() + stage.text()
    (status, r), = asyncio.run(_one(head.url, {"prompt": [1, 2, 3]}))
    assert status == 503 and "stage 1" in r["error"]["message"], r
    assert stage.wait(30) == 1
    assert "over the limit of 4096 bytes (--max_frame)" in stage.text(), stage.text()


@pytest.mark.parametrize("user", ["", "--xla_gpu_command_buffer_update_mode=ALWAYS_UPDATE"])
def test_serving_pins_the_temporaries_before_jax_makes_its_backend(user):
    """`kernjax.serve` asks XLA for CUDA graphs whose temporaries stay put (kernjax/runtime/xla.py)
    before any backend exists, so the flag takes; a mode the user set is left alone."""
    code = ("from jax._src import xla_bridge as xb\nimport kernjax.cli.serve\nimport os\n"
            "print(xb.backends_are_initialized(), os.environ['XLA_FLAGS'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "XLA_FLAGS": user}, check=True).stdout.split()
    modes = [f for f in out if "command_buffer_update_mode" in f]
    assert out[0] == "False" and modes == [user or "--xla_gpu_command_buffer_update_mode=SKIP_TEMP"]


def test_programs_of_many_rows_compile_without_cuda_graphs_on_a_gpu(monkeypatch):
    """`xla.compile_options(rows)`: no graphs on a GPU from `GRAPHS_BELOW_ROWS` rows; fewer rows,
    serving's mode or the user's graph flag in XLA_FLAGS keep XLA's graphs; nothing on the CPU.
    The options compile (XLA knows them)."""
    import jax
    from kernjax.runtime import xla
    off, big, small = {"xla_gpu_enable_command_buffer": ""}, xla.GRAPHS_BELOW_ROWS, 512
    assert small < big <= 2048  # chunks of 512 keep graphs; 2048 and one 8k chunk do not
    lowered = jax.jit(lambda x: x * 2).lower(jax.ShapeDtypeStruct((3,), "float32"))
    lowered.compile(xla.compile_options(big))  # this backend's own
    assert xla.compile_options(big) == ({} if jax.default_backend() != "gpu" else off)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    for flags, want in [("--xla_disable_hlo_passes=dot-merger", off),
                        ("--xla_gpu_command_buffer_update_mode=SKIP_TEMP", {}),
                        ("--xla_gpu_enable_command_buffer=FUSION", {})]:
        monkeypatch.setenv("XLA_FLAGS", flags)
        assert xla.compile_options(big) == want, flags
        assert xla.compile_options(big - 1) == {} and xla.compile_options(small) == {}, flags
    monkeypatch.setenv("XLA_FLAGS", "")
    lowered.compile(xla.compile_options(big))  # the GPU's options are valid XLA options here too
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert xla.compile_options(big) == {}
