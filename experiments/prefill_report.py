"""The prefill benchmark's results: `results.json`, the README that reads them, and `mfu.png`.

`Results` holds one run's data (the harness's record, the run's settings, a row per (system,
prompt, chunk) with its ms, tok/s and MFU, each row's detail: its runs, clock, token, logit
checks, profile) and writes all three after every row, so a run cut short leaves what it had.
The README's first table has a line per row, `| kernjax | 8192 | 512 | ms | tok/s | MFU % | SM
MHz, W | runs |`, in the order the rows ran: runs of other commits are compared line by line
against it. Then each system's time over kernjax's in the same run, and issue 6's goals checked
on those (`goal_checks`): a change is read there, against an unchanged system in the same call,
not against another day's table (machines differ by 2-3 %, docs/lessons.md).
`python -m experiments.prefill --replot DIR` writes README.md and mfu.png again from
DIR/results.json (`replot`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

from experiments import harness
from experiments.systems import SYSTEMS, flop_terms, flops

MFU_GOALS = {"whole": 0.65, "2048": 0.55, "512": 0.45}  # issue 6, at 8k


def goal_checks(ms: dict, keys: list) -> list:
    """Issue 6's goals on one run's rows (`ms[(system, prompt, chunk)]`, chunk as text):
    [(what, met)] for those its rows can answer."""
    out = []
    for c, goal in MFU_GOALS.items():
        if r := ms.get(("kernjax", 8192, c)):
            out.append((f"8k, chunk {c}: {100 * r['mfu']:.2f} % MFU, goal {100 * goal:.0f} %",
                        r["mfu"] >= goal))
    one = [k for k in keys if k[1] == "whole"]
    for a, b, where, lo, hi in (("transformers", "kernjax", keys, 1.0, None),
                                ("jax-plain", "kernjax", one, 1.0, None),
                                ("kernjax", "kernjax-unconstrained", keys, 0.97, 1.03)):
        r = [ms[(a, p, c)]["ms"] / ms[(b, p, c)]["ms"] for p, c in where
             if (a, p, c) in ms and (b, p, c) in ms]
        if r:
            bound = f"within {lo:g}-{hi:g}" if hi else f">= {lo:g}"
            out.append((f"{a} / {b} (time) {bound} on {len(r)} rows"
                        + " in one chunk" * (where is one) + f": {min(r):.3f}-{max(r):.3f}",
                        min(r) >= lo and (hi is None or max(r) <= hi)))
    return out


class Results:
    """One run's data and its writer; `args` are the benchmark's parsed flags."""

    def __init__(self, args, cfg, out: Path, page: int):
        from kernjax.runtime import xla

        self.out, self.args, self.cfg = out, args, cfg
        self.data = {
            **harness.record(), "rows": [],
            "model": cfg.name, "dtype": args.dtype, "iters": args.iters,
            "idle": args.idle, "min_row_s": args.min_row_s,
            "interleave": bool(getattr(args, "interleave", False)),
            "compile_options": {f"rows >= {xla.GRAPHS_BELOW_ROWS}":
                                xla.compile_options(xla.GRAPHS_BELOW_ROWS)},
            "publish": bool(args.publish), "page": page,
            "lowering": dataclasses.asdict(args.lowering),
            "mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
            "flops": dict(zip(("a", "b", "c"), flop_terms(cfg))), "peak_flops": args.peak,
            "cut_at": args.cut_at, "exact_context": args.exact_context,
            "xla_cache": os.environ.get("KERNJAX_XLA_CACHE"),
            "max_seconds": args.max_seconds,
            "compile_s": {}, "compile": [], "details": [], "skipped": [], "errors": [],
            "notes": [],
        }

    def add_row(self, system, s, label, ms, detail):
        f = flops(self.cfg, s)
        self.data["rows"].append({"system": system, "prompt": s, "chunk": label,
                                  "ms": round(ms, 4), "tok_s": round(s / (ms / 1e3), 2),
                                  "mfu": round(f / (ms / 1e3) / self.args.peak, 6)})
        self.data["details"].append({"system": system, "prompt": s, "chunk": label, **detail})

    def add_compile(self, system, s, rows, ctx, info, first_s):
        total = info["trace_s"] + sum(p["export_s"] + p["lower_s"] + p["xla_s"]
                                      for p in info["parts"])
        self.data["compile_s"].setdefault(system, {})[f"rows={rows},context={ctx}"] = round(total, 3)
        self.data["compile"].append({"system": system, "prompt": s, "rows": rows, "context": ctx,
                                     "total_s": round(total, 3), "first_prefill_s": round(first_s, 3),
                                     **{k: v for k, v in info.items() if k != "parts"},
                                     "parts": [{k: (round(v, 3) if isinstance(v, float) else v)
                                                for k, v in p.items()} for p in info["parts"]]})

    def skip(self, system, s, label, why):
        self.data["skipped"].append({"system": system, "prompt": s, "chunk": label, "why": why})

    def fail(self, system, s, label, error):
        self.data["errors"].append({"system": system, "prompt": s, "chunk": label, "error": error})

    def write(self, plot=False):
        harness.write(self.out, self.data, self.readme(), [self.plot] if plot else [])

    def plot(self, data, out):
        harness.mfu_lines(data["rows"], out / "mfu.png",
                          f"prefill {data['model']} on {data['gpu']}", self.args.peak)

    def table(self) -> str:
        lines = ["| system | prompt | chunk | ms | tok/s | MFU % | SM MHz, W | runs |",
                 "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r, x in zip(self.data["rows"], self.data["details"]):
            c = x.get("clock")
            lines.append(f"| {r['system']} | {r['prompt']} | {r['chunk']} | {r['ms']:.2f} | "
                         f"{r['tok_s']:.0f} | {100 * r['mfu']:.2f} | "
                         + (f"{c['sm_mhz']:.0f}, {c['watts']:.0f} |" if c else "- |")
                         + f" {x.get('iters', '-')} |")
        return "\n".join(lines)

    def ratios(self) -> str:
        """kernjax against every other system measured in this run, row by row, then issue 6's
        goals, checked."""
        ms = {(r["system"], r["prompt"], str(r["chunk"])): r for r in self.data["rows"]}
        keys = sorted({(p, c) for s, p, c in ms if s == "kernjax"},
                      key=lambda k: (k[0], k[1] == "whole", k[1].isdigit() and int(k[1])))
        others = [s for s in SYSTEMS[1:] if any(k[0] == s for k in ms)]
        if not keys or not others:
            return ""
        lines = ["| prompt | chunk | kernjax ms | MFU % | " + " | ".join(
                     f"{s} / kernjax" for s in others) + " |",
                 "|---:|---:|---:|---:|" + "---:|" * len(others)]
        for p, c in keys:
            k = ms[("kernjax", p, c)]
            lines.append(f"| {p} | {c} | {k['ms']:.2f} | {100 * k['mfu']:.2f} | " + " | ".join(
                f"{ms[(s, p, c)]['ms'] / k['ms']:.3f}" if (s, p, c) in ms else "-"
                for s in others) + " |")
        lines += ["", "Issue 6's goals on this run (ratios of times, as named):", ""]
        for text, ok in goal_checks(ms, keys):
            lines.append(f"- {text}: **{'met' if ok else 'not met'}**")
        return "\n".join(lines)

    def compile_table(self, key: str = "compile") -> str:
        lines = ["| system | prompt | rows | context | trace s | export s | lower s | XLA compile s "
                 "| persistent cache | total s | first prefill s |",
                 "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
        for c in self.data.get(key, []):
            col = {k: " + ".join(f"{p.get(k, 0.0):.1f}" for p in c["parts"])
                   for k in ("export_s", "lower_s", "xla_s")}
            cache = " + ".join(p.get("cache", "-") for p in c["parts"])
            lines.append(f"| {c['system']} | {c['prompt']} | {c['rows']} | {c['context']} | "
                         f"{c['trace_s']:.1f} | {col['export_s']} | {col['lower_s']} | "
                         f"{col['xla_s']} | {cache} | {c['total_s']:.1f} | "
                         f"{c['first_prefill_s']:.2f} |")
        return "\n".join(lines)

    def readme(self) -> str:
        d, a = self.data, self.args
        a_, b_, c_ = flop_terms(self.cfg)
        m = d["machine"]
        lines = [f"# Prefill of one prompt: {d['model']} on {d['gpu']}", "",
                 "- **Question:** time to first token of one prompt of S tokens, prefilled in "
                 "chunks, for kernjax (whole program, 2 stages, unconstrained jit) against plain "
                 "JAX and Hugging Face transformers.",
                 f"- **Script:** `python -m experiments.prefill` (commit `{d['commit']}`"
                 + (", tree with local changes" if d.get("dirty") else "") + ").",
                 f"- **Machine:** {d['gpu']} ({m.get('nvidia_smi', d['backend'])}); "
                 f"{m.get('cpus')} CPUs ({m.get('cpu', '?')}), host `{m.get('host')}`.",
                 f"- **Date:** {d['time']}. **Versions:** Python {m.get('python')}, jax "
                 f"{d['jax']}, jaxlib {m.get('jaxlib', '?')}"
                 + (f", torch {d['torch']}, transformers {d['transformers']} "
                    f"(attention `{d.get('transformers_attn')}`)" if d.get("torch") else "")
                 + ".",
                 f"- **XLA_FLAGS** (every JAX system, one process): `{d['xla_flags']}`; "
                 f"compile options (`kernjax.runtime.xla.compile_options(rows)`, each JAX program): "
                 f"`{d.get('compile_options', {})}`; kernjax's lowering (`--lowering`, "
                 f"`kernjax.core.lowering.Lowering`): `{d.get('lowering', {})}`; the token "
                 f"published to the host by the program (`kernjax.runtime.tokens`, as the "
                 f"runner's): {d.get('publish', False)}; "
                 f"XLA_PYTHON_CLIENT_PREALLOCATE=false, MEM_FRACTION={d['mem_fraction']}.",
                 "- **Command:**", "", "```", d["command"], "```", "",
                 "## Result", "",
                 f"{d['model']}, {d['dtype']}, random weights; median of `runs` timed prefills "
                 f"of the whole prompt ({a.iters}" + (f", or more for a short row: at least "
                 f"{a.min_row_s:g} s of them and their idle by the warm-up's time, at most 25" if a.min_row_s
                 else "") + ") after one untimed warm-up (ms = time to first token)"
                 + (f", each after {a.idle:g} s idle" if a.idle else ", back to back")
                 + ("; the JAX systems interleaved: at each row they take turns, one prefill "
                    "each per round, the order rotated every round (`--interleave`)"
                    if d.get("interleave") else "")
                 + ". tok/s = S / time; MFU = FLOPs(S) / time / "
                 f"{a.peak / 1e12:.0f} TFLOP/s. SM MHz, W: the GPU's clock (median) and power "
                 "(mean) while the timed prefills ran (nvidia-smi every 100 ms, read only; its "
                 "power reading lags, so a short row reads low). The peak is rated at 1830 MHz; "
                 "a GPU at its power limit runs lower "
                 "(`git show results:experiments/results/2026-12-01-h200-clocks/README.md`).", "",
                 self.table(), ""]
        if ratios := self.ratios():
            lines += ["Each system's time over kernjax's, same prompt and chunk, this run:", "",
                      ratios, ""]
        if d["skipped"]:
            lines += ["Rows not measured:", ""]
            lines += [f"- {x['system']} S={x['prompt']} chunk={x['chunk']}: {x['why']}"
                      for x in d["skipped"]]
            lines.append("")
        if d["errors"]:
            lines += ["Rows that failed (nothing recorded for them):", ""]
            lines += [f"- {x['system']} S={x['prompt']} chunk={x['chunk']}: `{x['error']}`"
                      for x in d["errors"]]
            lines.append("")
        toks = [x for x in d["details"] if x.get("token") is not None]
        if toks:
            lines += ["Checks, not timings: the next token, and the largest absolute difference "
                      "of the last row's logits from jax-plain's (same weights and prompt; torch "
                      "has its own random weights, so none) and from the same system's first "
                      "chunk setting at that prompt (chunking changes the order of the "
                      "arithmetic, not the function). With random weights and a tied head the "
                      "token is mostly the prompt's last token, so the logits are the check.", "",
                      "| system | prompt | chunk | token | vs jax-plain | vs own chunk |",
                      "|---|---:|---:|---:|---:|---|"]
            for x in toks:
                diff, own = x.get("logits_diff"), x.get("self_diff")
                lines.append(f"| {x['system']} | {x['prompt']} | {x['chunk']} | {x['token']} | "
                             + ("-" if diff is None else f"{diff:.4g}") + " | "
                             + ("-" if not own else f"{own['max_abs']:.4g} (chunk {own['chunk']})")
                             + " |")
            lines.append("")
        lines += ["## Compile time", "",
                  "Per program (system, rows, context): tracing the forward into a kernjax "
                  "Program, `export_stage`, then `jax.jit(...).lower` (tracing for "
                  "kernjax-unconstrained and jax-plain) and XLA's `compile` of each part "
                  "(kernjax-2stages: stage 0 + stage 1); then the first (warm-up) prefill after "
                  "it. transformers compiles nothing; its first prefill is its warm-up.", "",
                  self.compile_table(), ""]
        if d.get("compile_second"):
            lines += ["Second start (`--second_start`): the same kernjax programs built again by a "
                      "new process (`--compile_only`) with this run's caches, as a restarted stage "
                      "builds them: tracing and export again, then XLA's compile, which JAX's "
                      "persistent compilation cache answers if it holds the program (`persistent "
                      "cache`: hit or miss; nothing run, so no first prefill).", "",
                      self.compile_table("compile_second"), ""]
        lines += ["## How it was measured", "",
                  "- One prompt of S random tokens (seed 0, the same for every system), one "
                  f"sequence per item, pages of {d.get('page', 16)} rows (kernjax), ids "
                  f"1..S/{d.get('page', 16)}. "
                  "A chunk >= S is S: one pass of S rows; "
                  "two chunk settings that give the same rows at one S share a program and a "
                  "measurement.",
                  "- kernjax: `fam.program(rows=chunk, seqs=1, context)` (context below), "
                  "`artifact.export_stage(cut.whole(program))`, `jax.jit(exp.call, donate_argnums="
                  "states)`, AOT-compiled once per (rows, context). Items from "
                  "`item.make_item([Piece(chunk tokens, start, pages)])`, put on the device "
                  "before the clock. States zeroed between prefills (outside the clock), fed back "
                  "after every chunk; no block between chunks, one `block_until_ready` at the end.",
                  f"- kernjax-2stages: `cut.cut(program, cut.points('{d['cut_at']}', program))` "
                  f"(calls {d.get('cut_points', '?')}), each stage exported and jitted with its "
                  "states donated, run back to back in this process per chunk.",
                  "- kernjax-unconstrained: the same program's jaxpr as `lower.as_function(jaxpr, "
                  "platform, fences=False)`, jitted directly: every call's body inlined bare, "
                  "kernjax's own kernels (`on_gpu`) in place, no barriers (XLA may fuse across "
                  "calls), the whole program's CUDA graph cuts (since 2026-12-04: host work, "
                  "no kernel), so that the two differ by the barriers only.",
                  "- jax-plain: a plain JAX Qwen3 (`experiments/peers/plain_jax.py`: no paging, "
                  "dense per-layer KV `[S, KV, D]` returned as the cache), attention "
                  "`jax.nn.dot_product_attention(is_causal=True, "
                  f"implementation={d.get('plain_attention', 'cudnn')!r})`. Only one-pass rows: the "
                  "public `is_causal` is top-left aligned (query i sees keys 0..i), so for a "
                  "later chunk, whose queries sit at positions after the keys already cached, it "
                  "would hide most of the context; a bottom-right mask needs an explicit mask "
                  "array, which is not the fused causal path.",
                  "- transformers (`experiments/peers/transformers.py`): "
                  "`Qwen3ForCausalLM(Qwen3Config(same shapes))`, random init, "
                  "sdpa, under `torch.inference_mode()`; one chunk = one forward with the cache "
                  "(`DynamicCache`, created by the first chunk) carried, logits of the last row "
                  "only; `torch.cuda.synchronize()` before the clock is read. Run last, its model "
                  "freed after.",
                  "- Programs are compiled once per (system, rows, context) and reused across "
                  "iterations, chunk settings with the same rows and prompts: "
                  + ("every program has context = S (`--exact_context`)." if d["exact_context"]
                     else "a chunk program (rows < S) is compiled once with context = the largest "
                     "prompt and serves every S (the attention in `kernjax/kernels/attention.py` visits "
                     "only the key blocks the item's sequence reaches, so the page table's width "
                     "adds no attention work; the states are sized for the largest prompt); a "
                     "one-pass program (rows = S) has context S, one per S.")
                  + " The compile table lists each program once, at the first prompt that used "
                  "it. Compiling runs with kernjax's XLA set-up (`kernjax/runtime/xla.py`: each GEMM's "
                  + ("algorithm chosen untimed" if "exclude_nondeterministic_ops=true" in
                     d.get("xla_flags", "") else "kernel timed by XLA (XLA_FLAGS above)")
                  + ", JAX's persistent compilation cache) in "
                  + ("a fresh directory for this run: every program's first compile is a "
                     "cold one." if d["xla_cache"] and "prefill-xla-" in
                     d["xla_cache"] else f"`{d['xla_cache']}`, set by the caller (maybe warm)."),
                  f"- FLOPs(S) = {a_:.4g}·S + {b_:.6g}·S² + {c_:.4g} (2 × non-embedding weights "
                  "per token; causal attention 2·2·layers·heads·head_dim·S²/2; the lm_head of "
                  "the last row). For qwen3-4b this is 7.267e9·S + 294912·S² + 0.778e9.",
                  "- `--max_seconds` "
                  + (f"{d['max_seconds']:.0f}" if d["max_seconds"] else "(off)")
                  + ": rows are started only while time is left; each system gets a share of "
                  "the time left in proportion to its distinct rows plus two for each program it "
                  "compiles, a row whose predicted time (the "
                  "longest compile so far when the row needs a new program, + 2 × the previous prefill of that chunk setting, or of a one-pass "
                  "row, scaled by (S/S_prev)²) does not fit is skipped, and iterations are cut to what fits "
                  "after the warm-up (at least one).",
                  "- Systems run in the order jax-plain, kernjax-unconstrained, kernjax, "
                  "kernjax-2stages, transformers (cheap ones first, so their unused time goes to "
                  "the later ones; torch last)."]
        lines += [f"- {n}" for n in d["notes"]]
        lines.append("")
        return "\n".join(lines)


def replot(out: Path) -> None:
    """Rewrites README.md and mfu.png of a results directory from its results.json (for a
    machine without matplotlib: run this where it is installed)."""
    from kernjax import models

    data = json.loads((out / "results.json").read_text())
    _, cfg = models.named(data["model"])
    res = Results.__new__(Results)
    res.out, res.cfg, res.data = out, cfg, data
    res.args = argparse.Namespace(iters=data["iters"], peak=data["peak_flops"],
                                  idle=data.get("idle", 0.0), min_row_s=data.get("min_row_s", 0))
    res.write(plot=True)
    harness.say(f"rewrote {out}/README.md and mfu.png from results.json")
