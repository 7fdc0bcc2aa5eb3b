"""`kernjax cut`: trace a model, cut it, write the stage artifacts."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from absl import flags

from kernjax.cli import shell, sources

FLAGS = flags.FLAGS


def main_def():
    """Usage: kernjax cut (--model NAME | --weights DIR) --at POINTS --out DIR

Traces the model's forward, cuts it before each point (18: layer 18; c218: call 218; commas
separate points), prints what each stage keeps and sends, and writes stage0/ .. stageN/ and
whole/ into DIR, replacing a previous cut there. Every stage holds the cut's programs: the
prefill chunk (--chunk rows, --seqs sequences), the same chunk scoring every row (prompt
log-probabilities) and a decode program per --decode bucket; one cut id covers them all. The kernel options (--[no]dense_cuda,
--mlp_tile, --[no]mlp_across, --[no]graph_cuts, --[no]fa3_graphs) choose how a GPU lowers the
calls; they are part of the cut id, so every stage and whole/ share them."""
    from kernjax.artifact import DECODE
    from kernjax.core.lowering import DEFAULT, MLP_TILES
    sources.source_flags()
    flags.DEFINE_string("at", None, "cut points: a layer (18), a call index (c218), comma-separated;"
                        " or `auto`: --stages stages of even periods by --profile")
    flags.DEFINE_integer("stages", 2, "with --at auto: how many stages")
    flags.DEFINE_string("profile", None, "with --at auto: per-call times, as "
                        "`python -m experiments.calls --out` writes them for this model and --chunk "
                        "(run it from the root of a kernjax clone)")
    flags.DEFINE_string("out", None, "directory for stage0/ .. stageN/ and whole/")
    flags.DEFINE_integer("chunk", 512, "rows per run of the program")
    flags.DEFINE_integer("seqs", 4, "sequences one item may hold (packed prefill)")
    flags.DEFINE_integer("context", 4096, "the longest sequence, in tokens")
    flags.DEFINE_integer("pages", None, "pages per KV state (default: seqs full contexts + 1)")
    flags.DEFINE_list("decode", [str(b) for b in DECODE], "decode buckets: a program of B "
                      "sequences of one row each per bucket B (generation); empty for none")
    flags.DEFINE_integer("slots", None, "sequence slots per per-sequence state, slot 0 never "
                         "leased (models with recurrent states, k3-mini; default 4 * seqs + 1)")
    flags.DEFINE_boolean("dense_cuda", DEFAULT.dense_cuda, "GPU: a dense layer's q_norm, k_norm, "
                         "rope, kv_write and add_norm as kernjax's CUDA kernels (else XLA's)")
    flags.DEFINE_enum("mlp_tile", DEFAULT.mlp_tile, list(MLP_TILES), "GPU: the fused MLP GEMM's "
                      "warpgroup tile above 2048 rows")
    flags.DEFINE_boolean("mlp_across", DEFAULT.mlp_across, "GPU: the fused MLP GEMM pipelines "
                         "across a CTA's tiles (four steps)")
    flags.DEFINE_boolean("graph_cuts", DEFAULT.graph_cuts, "GPU: end XLA's CUDA graph three times "
                         "a program, so each graph's host work hides behind the one before")
    flags.DEFINE_boolean("fa3_graphs", DEFAULT.fa3_graphs, "GPU: FlashAttention-3 runs inside "
                         "XLA's CUDA graphs (else outside)")
    flags.mark_flags_as_required(["at", "out"])
    return main


def lowering_from_flags():
    from kernjax.core.lowering import Lowering
    return Lowering(dense_cuda=FLAGS.dense_cuda, mlp_tile=FLAGS.mlp_tile,
                    mlp_across=FLAGS.mlp_across, graph_cuts=FLAGS.graph_cuts,
                    fa3_graphs=FLAGS.fa3_graphs)


def main():
    from kernjax import artifact, weights
    from kernjax.core import cut
    fam, cfg, ref, dtype = sources.source()
    out = Path(FLAGS.out)
    artifact.previous_cut(out)  # refuses an --out that holds other files before tracing
    t0 = time.time()
    low = [f"--{n} {v} must be at least {lo}" + " and below 2^31" * (v >= lo) for n, lo in
           (("chunk", 1), ("seqs", 1), ("context", 1), ("pages", 2), ("slots", 2))
           if (v := getattr(FLAGS, n)) is not None and not lo <= v < 2**31]
    if low:
        raise ValueError("; ".join(low) + " (see --help)")
    lowering = lowering_from_flags()
    bad = [b for b in FLAGS.decode if not (b.isdigit() and 1 <= int(b) < 2**16)]
    if bad:
        raise ValueError(f"--decode {','.join(FLAGS.decode)}: `{bad[0]}` is not a bucket; give "
                         "sequence counts from 1, comma-separated (or --decode= for none)")
    progs = artifact.programs(fam, cfg, dtype=dtype, rows=FLAGS.chunk, seqs=FLAGS.seqs,
                              context=FLAGS.context, pages=FLAGS.pages, slots=FLAGS.slots,
                              decode=[int(b) for b in FLAGS.decode])
    program = progs[artifact.DEFAULT]
    cfg_d = dataclasses.replace(cfg, dtype=dtype)  # the derive program makes weights in it
    if "dir" in ref:
        weights.check_sources(fam, cfg_d, program, Path(ref["dir"]))
    if FLAGS.at.strip() == "auto":
        if not FLAGS.profile:
            raise ValueError("--at auto needs --profile FILE: per-call times from `python -m "
                             f"experiments.calls --model {FLAGS.model or 'NAME'} --rows "
                             f"{FLAGS.chunk} --out FILE`, run from the root of a kernjax clone "
                             "(experiments/ is not installed) on the device that will run the "
                             "stages")
        ms = profile_times(FLAGS.profile, program, cfg.name)
        _, points, periods = cut.auto(program, ms, FLAGS.stages, lowering=lowering)
        even = sum(periods) / len(periods)
        print(f"--at auto: c{', c'.join(map(str, points))} "
              f"({', '.join(f'`{program.calls[p]}`' for p in points)}); stage periods "
              f"{', '.join(f'{p:.3f}' for p in periods)} ms by the profile, the longest "
              f"{max(periods) / even:.3f} of even")
    else:
        points = cut.points(FLAGS.at, program)
    sets = cut.cut_all(progs, points, lowering=lowering)
    stages = sets[artifact.DEFAULT]
    print(f"{cfg.name}, {dtype}, chunk {FLAGS.chunk}: {len(program.calls)} calls, KV in pages "
          f"of {fam.page(cfg)} rows, traced in {time.time() - t0:.1f} s")
    print(cut.describe(program, stages, programs=progs))
    meta = dict(model=artifact.model_meta(fam, cfg), checkpoint=ref, dtype=dtype,
                item=artifact.items(fam, cfg, progs), derive=fam.derived(cfg_d))
    per_stage = [{n: sets[n][s] for n in progs} for s in range(len(stages))]
    artifact.write_cut(out, (*per_stage, cut.whole_all(progs, lowering=lowering)), meta,
                       say=shell.say)
    print(f"wrote {cut.counted(len(stages), 'stage')} and whole/ to {out} in "
          f"{time.time() - t0:.1f} s")


def profile_times(path, program, model: str) -> list[float]:
    """Each call's time (ms) from a profile of `experiments.calls`, which names every call."""
    try:
        prof = json.loads(Path(path).read_text())
        got = {c["name"]: float(c["ms"]) for c in prof["calls"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--profile `{path}` is not a profile of experiments.calls --out "
                         f"({type(e).__name__}: {e})") from None
    if prof.get("model") != model or prof.get("rows") != program.rows:
        raise ValueError(f"--profile `{path}` times {prof.get('model')} at {prof.get('rows')} "
                         f"rows; this cut is {model} at {program.rows} (re-run `python -m "
                         f"experiments.calls --model {model} --rows {program.rows}` from the "
                         "root of a kernjax clone)")
    missing = [c for c in program.calls if c not in got]
    if missing:
        raise ValueError(f"--profile `{path}` has no time for {', '.join(missing[:5])}"
                         f"{' ...' if len(missing) > 5 else ''}; re-run experiments.calls for "
                         "this model")
    return [got[c] for c in program.calls]
