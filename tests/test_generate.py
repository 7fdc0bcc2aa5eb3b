"""Scoring and generation through the cut's programs, in one process: a row's bits whatever its
item (alone, beside 1..15 others, in any order, in any program), the same bits whole and split,
a generated token's log-probability equal to its score in the finished text, and sampling as a
pure function of (seed, choice, step)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from kernjax import artifact, models
from kernjax.core import cut
from kernjax.core.item import Piece, make_item
from kernjax.runtime.chain import chain
from kernjax.runtime.pipeline import Pipeline
from kernjax.runtime.runner import Runner, checkpoint_dir, load_weights

FAM, CFG = models.named("qwen3-tiny")
CHUNK, SEQS, CONTEXT = 32, 4, 512
OUTS = ("next_token", "logprob", "top_ids", "top_logprobs", "logits")


@pytest.fixture(scope="module")
def cuts(tmp_path_factory):
    """float32 qwen3-tiny, whole, cut at 2 and at 1,c33: {stages: Pipeline}."""
    t = tmp_path_factory.mktemp("gen")
    ref = {"model": "qwen3-tiny", "seed": 0, "dtype": "float32"}
    progs = artifact.programs(FAM, CFG, dtype="float32", rows=CHUNK, seqs=SEQS,
                              context=CONTEXT, decode=(1, 4, 16))
    meta = dict(model=artifact.model_meta(FAM, CFG), checkpoint=ref, dtype="float32",
                item=artifact.items(FAM, CFG, progs))
    ckpt = checkpoint_dir(ref)
    cache: dict = {}
    out = {}
    layers = progs[artifact.DEFAULT].layers
    for at in ([layers[2]], [layers[1], 33]):
        sets = cut.cut_all(progs, at)
        d = t / "-".join(map(str, at))
        n = len(sets[artifact.DEFAULT])
        per = [{k: sets[k][s] for k in progs} for s in range(n)]
        artifact.write_cut(d, (*per, cut.whole_all(progs)), meta)
        arts = [artifact.read(d / f"stage{s}") for s in range(n)]
        out[n] = Pipeline([Runner(a, load_weights(a, ckpt, cache=cache)) for a in arts])
        if 1 not in out:
            w = artifact.read(d / "whole")
            out[1] = Pipeline([Runner(w, load_weights(w, ckpt, cache=cache))])
    return out


def _prompts(k: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, CFG.vocab, int(n)).astype(np.int32)
            for n in rng.integers(1, 70, size=k)]


def _pages(i: int) -> tuple[int, ...]:
    return tuple(range(1 + 8 * i, 9 + 8 * i))  # 8 pages of 16: 128 tokens a sequence


def _prefill(pipe: Pipeline, prompts) -> None:
    pipe.reset()
    for i, p in enumerate(prompts):
        for a in range(0, len(p) - 1, CHUNK):
            b = min(a + CHUNK, len(p) - 1)
            pipe.run(make_item([Piece(p[a:b], a, _pages(i))], pipe.shape))


def _steps(pipe: Pipeline, prompts, idx, program: str, sampling=(0.7, 0.9, 0, 0.0)) -> dict:
    """Each sequence of `idx`'s step (its prompt's last token) in one item of `program`."""
    pieces = [Piece(prompts[i][-1:], len(prompts[i]) - 1, _pages(i), sampling=sampling,
                    rng=(11, 0, 0)) for i in idx]
    out = pipe.run(make_item(pieces, pipe.programs[program].item), program)
    return {i: {k: np.asarray(out[k])[j] for k in OUTS} for j, i in enumerate(idx)}


def _same(a: dict, b: dict) -> list[str]:
    return [k for k in OUTS if a[k].tobytes() != b[k].tobytes()]


def test_a_step_gives_the_same_bits_alone_or_beside_1_to_15_others_in_any_order(cuts):
    """The headline of batch invariance on the CPU: a sequence's next token, its log-probability
    and top-20 and its logits are the same bytes in the one-row step, in every decode bucket
    beside others, and in the prefill chunk."""
    pipe = cuts[1]
    prompts = _prompts(16)
    _prefill(pipe, prompts)
    alone = {i: _steps(pipe, prompts, [i], "decode1")[i] for i in range(16)}
    rng = np.random.default_rng(3)
    errs = []
    for size, program in ((2, "decode4"), (4, "decode4"), (5, "decode16"), (16, "decode16"),
                          (3, "prefill"), (4, "score")):
        idx = [int(i) for i in rng.permutation(16)[:size]]
        got = _steps(pipe, prompts, idx, program)
        errs += [f"sequence {i} in {program} beside {size - 1}: {_same(got[i], alone[i])}"
                 for i in idx if _same(got[i], alone[i])]
    assert not errs, errs


def test_steps_beside_prompt_rows_in_one_chunk_are_the_same_bits(cuts):
    pipe = cuts[1]
    prompts = _prompts(3, seed=1)
    _prefill(pipe, prompts)
    alone = {i: _steps(pipe, prompts, [i], "decode1")[i] for i in range(2)}
    # sequences 0 and 1 step while sequence 2's prompt rows fill the rest of the chunk
    other = prompts[2]
    pieces = [Piece(prompts[i][-1:], len(prompts[i]) - 1, _pages(i), sampling=(0.7, 0.9, 0, 0.0),
                    rng=(11, 0, 0)) for i in range(2)]
    pieces.append(Piece(other[:20], 0, _pages(9)))
    out = pipe.run(make_item(pieces, pipe.shape))
    for j in range(2):
        got = {k: np.asarray(out[k])[j] for k in OUTS}
        assert not _same(got, alone[j]), f"sequence {j}: {_same(got, alone[j])}"


def test_the_whole_program_and_two_and_three_stages_give_the_same_bits(cuts):
    prompts = [p.tolist() for p in _prompts(4, seed=2)] + [[5], list(range(1, 34))]
    lines = []
    for n in (2, 3):
        assert chain(cuts[1], cuts[n], prompts, chunk=CHUNK, say=lines.append, steps=6), lines
    assert all("IDENTICAL" in x for x in lines if x.startswith("prompt")), lines
    assert sum("6 decode steps" in x for x in lines) == 2 * len(prompts)


def test_a_generated_tokens_logprob_is_its_score_in_the_finished_text(cuts):
    pipe = cuts[1]
    prompt = _prompts(1, seed=4)[0].tolist() + [7, 8]
    pipe.reset()
    steps = list(pipe.generate(prompt, max_tokens=12, sampling=(1.0, 1.0, 0, 0.0), seed=9))
    made = [int(np.asarray(s["next_token"])[0]) for s in steps]
    lps = [np.asarray(s["logprob"])[0] for s in steps]
    tops = [np.asarray(s["top_logprobs"])[0] for s in steps]
    text = prompt + made
    pipe.reset()
    scored = [{k: np.asarray(v) for k, v in o.items()} for o in pipe.score(text)]
    lp = np.concatenate([o["target_logprob"] for o in scored])
    tl = np.concatenate([o["row_top_logprobs"] for o in scored])
    for k in range(len(made)):
        r = len(prompt) - 1 + k  # the row that scores token k
        assert lp[r].tobytes() == lps[k].tobytes(), (k, lp[r], lps[k])
        assert tl[r].tobytes() == tops[k].tobytes(), k


def test_sampling_is_a_pure_function_of_seed_choice_and_step(cuts):
    pipe = cuts[1]
    prompts = _prompts(4, seed=5)
    _prefill(pipe, prompts)

    def draw(seed, choice, step, program="decode4", t=1.0):
        pieces = [Piece(p[-1:], len(p) - 1, _pages(i), sampling=(t, 1.0, 0, 0.0),
                        rng=(seed, choice, step)) for i, p in enumerate(prompts)]
        out = pipe.run(make_item(pieces, pipe.programs[program].item), program)
        return np.asarray(out["next_token"])[:len(prompts)].tolist()

    a = draw(1, 0, 0)
    assert a == draw(1, 0, 0) == draw(1, 0, 0, "decode16") == draw(1, 0, 0, "prefill")
    others = [draw(2, 0, 0), draw(1, 1, 0), draw(1, 0, 1)]
    assert all(o != a for o in others), (a, others)  # 4 draws from 512 tokens each
    assert draw(1, 0, 0, t=0.0) == draw(7, 3, 9, t=0.0)  # greedy needs no key


def test_top_k_and_top_p_keep_only_the_likeliest_tokens(cuts):
    pipe = cuts[1]
    prompts = _prompts(1, seed=6)
    _prefill(pipe, prompts)
    greedy = _steps(pipe, prompts, [0], "decode1", (0.0, 1.0, 0, 0.0))[0]
    top = greedy["top_ids"][:3].tolist()
    seen = set()
    for seed in range(24):
        pieces = [Piece(prompts[0][-1:], len(prompts[0]) - 1, _pages(0),
                        sampling=(5.0, 1.0, 3, 0.0), rng=(seed, 0, 0))]
        out = pipe.run(make_item(pieces, pipe.programs["decode1"].item), "decode1")
        seen.add(int(np.asarray(out["next_token"])[0]))
    assert seen <= set(top) and len(seen) > 1, (seen, top)
    # top_p small enough keeps the most likely token only, whatever the temperature
    for seed in range(6):
        pieces = [Piece(prompts[0][-1:], len(prompts[0]) - 1, _pages(0),
                        sampling=(5.0, 1e-6, 0, 0.0), rng=(seed, 0, 0))]
        out = pipe.run(make_item(pieces, pipe.programs["decode1"].item), "decode1")
        assert int(np.asarray(out["next_token"])[0]) == int(greedy["next_token"])


def test_scores_alone_and_packed_with_other_prompts_are_the_same_bits(cuts):
    pipe = cuts[1]
    prompts = [p for p in _prompts(6, seed=7) if len(p) > 2][:3]
    sh = pipe.programs["score"].item
    alone = []
    for i, p in enumerate(prompts):
        pipe.reset()
        n = min(len(p), 10)
        out = pipe.run(make_item([Piece(p[:n], 0, _pages(i), targets=p[1:n + 1])], sh), "score")
        alone.append({k: np.asarray(out[k])[:n] for k in ("target_logprob", "row_top_ids",
                                                          "row_top_logprobs")})
    pipe.reset()
    pieces = [Piece(p[:min(len(p), 10)], 0, _pages(i), targets=p[1:min(len(p), 10) + 1])
              for i, p in reversed(list(enumerate(prompts)))]
    out = pipe.run(make_item(pieces, sh), "score")
    at = 0
    for i in reversed(range(len(prompts))):
        n = min(len(prompts[i]), 10)
        for k, v in alone[i].items():
            assert np.asarray(out[k])[at:at + n].tobytes() == v.tobytes(), (i, k)
        at += n


GOLDENS = Path(__file__).parent / "goldens" / "qwen3_tiny_f32_hf_generate.npz"


def test_scores_and_greedy_generation_match_transformers(cuts):
    """Goldens from transformers (`experiments/hf_generate_goldens.py`, float32, the same random
    checkpoint): every prompt row's log-probability of the next token within 2e-4, its most
    likely token the same, and the greedy continuation token for token, with each generated
    token's log-probability within 2e-4."""
    g = np.load(GOLDENS)
    pipe = cuts[1]
    assert json.loads(str(g["checkpoint_sha256"])) == {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(checkpoint_dir({"model": "qwen3-tiny", "seed": 0,
                                        "dtype": "float32"}).glob("*.safetensors"))}
    errs = []
    for k in range(len(g["lengths"])):
        toks = g[f"tokens_{k}"].tolist()
        if len(toks) > 1:
            pipe.reset()
            outs = [{n: np.asarray(v) for n, v in o.items()} for o in pipe.score(toks)]
            lp = np.concatenate([o["target_logprob"] for o in outs])[:len(toks) - 1]
            top = np.concatenate([o["row_top_ids"] for o in outs])[:len(toks) - 1, 0]
            err = float(np.abs(lp - g[f"scores_{k}"]).max())
            if err > 2e-4:
                errs.append(f"prompt {k}: scores differ by up to {err:.2g}")
            if (top != g[f"top5_{k}"][:, 0]).any():
                errs.append(f"prompt {k}: most likely tokens differ at rows "
                            f"{np.flatnonzero(top != g[f'top5_{k}'][:, 0]).tolist()}")
        pipe.reset()
        steps = list(pipe.generate(toks, max_tokens=int(g["new"])))
        made = [int(np.asarray(s["next_token"])[0]) for s in steps]
        if made != g[f"generated_{k}"].tolist():
            errs.append(f"prompt {k}: generated {made}, transformers {g[f'generated_{k}'].tolist()}")
        glp = np.asarray([np.asarray(s["logprob"])[0] for s in steps])
        if float(np.abs(glp - g[f"generated_logprobs_{k}"]).max()) > 2e-4:
            errs.append(f"prompt {k}: generated tokens' log-probabilities differ")
    assert not errs, errs


def test_a_rows_draw_does_not_depend_on_what_its_neighbours_ask(cuts):
    """Filters run for the whole item when any row asks for them (and the draw when any row
    samples): a row that asks for none keeps every token, so its draw is its own."""
    pipe = cuts[1]
    prompts = _prompts(4, seed=8)
    _prefill(pipe, prompts)
    plain = (1.0, 1.0, 0, 0.0)
    asks = [plain, (1.0, 0.3, 5, 0.0), (0.0, 1.0, 0, 0.0), (2.0, 1.0, 0, 0.2)]

    def step(idx, how):
        pieces = [Piece(prompts[i][-1:], len(prompts[i]) - 1, _pages(i), sampling=how[j],
                        rng=(5, 0, 1)) for j, i in enumerate(idx)]
        out = pipe.run(make_item(pieces, pipe.programs["decode4"].item), "decode4")
        return [int(t) for t in np.asarray(out["next_token"])[:len(idx)]]

    alone = [step([i], [asks[i]])[0] for i in range(4)]
    assert step([0, 1, 2, 3], asks) == alone
    assert step([3, 2, 1, 0], asks[::-1]) == alone[::-1]


def test_stages_of_cuts_with_other_program_sets_are_refused_naming_them(tmp_path):
    """Two cuts at the same point whose decode buckets differ have two cut ids (the id covers
    every program), and a pipeline of one's stage 0 and the other's stage 1 is refused, naming
    each stage's programs."""
    from kernjax.runtime.runner import StageError
    ref = {"model": "qwen3-tiny", "seed": 0, "dtype": "float32"}
    arts = {}
    for name, decode in (("a", (1,)), ("b", (1, 4))):
        progs = artifact.programs(FAM, CFG, dtype="float32", rows=16, seqs=2, context=64,
                                  decode=decode)
        sets = cut.cut_all(progs, [progs[artifact.DEFAULT].layers[2]])
        meta = dict(model=artifact.model_meta(FAM, CFG), checkpoint=ref, dtype="float32",
                    item=artifact.items(FAM, CFG, progs))
        artifact.write_cut(tmp_path / name, [{k: sets[k][s] for k in progs} for s in range(2)],
                           meta)
        arts[name] = [artifact.read(tmp_path / name / f"stage{s}") for s in range(2)]
    assert arts["a"][0].cut_id != arts["b"][0].cut_id
    ckpt, cache = checkpoint_dir(ref), {}
    runners = [Runner(a, load_weights(a, ckpt, cache=cache)) for a in (arts["a"][0],
                                                                        arts["b"][1])]
    with pytest.raises(StageError, match="their programs differ") as e:
        Pipeline(runners)
    assert "prefill, score, decode1;" in str(e.value) and "decode1, decode4" in str(e.value)
