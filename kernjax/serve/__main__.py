"""`python -m kernjax.serve`: one stage of a pipeline, or the whole program, behind HTTP.

    python -m kernjax.serve --stage_dir stages/stage0 --pp_listen 127.0.0.1:7000 --port 8000
    python -m kernjax.serve --stage_dir stages/stage1 --pp_head 127.0.0.1:7000
    python -m kernjax.serve --stage_dir stages/whole --port 8000      # or --model / --weights

Stage 0 is the head (HTTP, scheduler, page pool); other stages join it. Flags can come from a
file with absl's --flagfile.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from absl import flags

from kernjax import cli

FLAGS = flags.FLAGS


def serve_main():
    cli.source_flags()
    flags.DEFINE_string("stage_dir", None, "a stage directory made by `kernjax.cut` (or whole/)")
    flags.DEFINE_string("pp_listen", None, "head: where the other stages join (HOST:PORT)")
    flags.DEFINE_string("pp_head", None, "a stage past 0: the head's --pp_listen address")
    flags.DEFINE_string("host", "127.0.0.1", "HTTP and stage-link address to bind")
    flags.DEFINE_integer("port", 8000, "HTTP port (head)")
    flags.DEFINE_integer("max_seqs", 256, "prompts admitted at once (head)")
    flags.DEFINE_float("stage_timeout", 60.0, "seconds a stage may stay silent before the head "
                       "gives up on it")
    flags.DEFINE_float("startup_timeout", 600.0, "seconds to wait for the stages to join")
    flags.DEFINE_string("served_model_name", None, "model name in the API (default: the model's)")
    flags.DEFINE_integer("chunk", 512, "rows per item, for --model/--weights")
    flags.DEFINE_integer("seqs", 4, "sequences per item, for --model/--weights")
    flags.DEFINE_integer("context", 4096, "longest prompt, for --model/--weights")
    flags.DEFINE_integer("max_frame", 256 << 20, "largest frame (bytes) a process accepts from a "
                         "peer; raise it for items whose activations are larger")

    def main():
        from aiohttp import web

        from kernjax.runner import Runner, checkpoint_dir, load_weights, open_stage
        from kernjax.serve.head import Head
        from kernjax.serve.http import Metrics, make_app
        from kernjax.serve.stage import serve_stage
        if FLAGS.stage_dir:
            if FLAGS.model:
                raise ValueError("--stage_dir names the model already; drop --model")
            runner = open_stage(FLAGS.stage_dir, weights=FLAGS.weights, dtype=FLAGS.dtype)
            ckpt = Path(FLAGS.weights) if FLAGS.weights else \
                checkpoint_dir(runner.art.manifest["checkpoint"])
        else:
            fam, cfg, ref, dtype = cli.source()
            with tempfile.TemporaryDirectory() as tmp:
                art = cli.whole_artifact(fam, cfg, ref, dtype, rows=FLAGS.chunk, seqs=FLAGS.seqs,
                                         context=FLAGS.context, out=Path(tmp) / "whole")
            ckpt = checkpoint_dir(ref)
            runner = Runner(art, load_weights(art, ckpt))
        art = runner.art
        if art.index > 0:
            if not FLAGS.pp_head:
                raise ValueError(f"`{art.path}` is stage {art.index} of {art.stages}; give "
                                 "--pp_head HOST:PORT (the head's --pp_listen)")
            runner.warm()
            serve_stage(runner, head=FLAGS.pp_head, host=FLAGS.host,
                        startup_timeout=FLAGS.startup_timeout, max_frame=FLAGS.max_frame)
        if FLAGS.pp_head:
            raise ValueError(f"`{art.path}` is stage 0, the head; give --pp_listen, not --pp_head")
        runner.warm()
        metrics = Metrics()
        head = Head(runner, listen=FLAGS.pp_listen, max_seqs=FLAGS.max_seqs,
                    stage_timeout=FLAGS.stage_timeout, startup_timeout=FLAGS.startup_timeout,
                    max_frame=FLAGS.max_frame, metrics=metrics)
        name = FLAGS.served_model_name or art.manifest["model"]["name"]
        app = make_app(head, name=name, vocab=art.manifest["model"]["config"]["vocab"],
                       tokenizer=cli.tokenizer(ckpt), metrics=metrics)
        what = "the whole program" if art.stages == 1 else f"{art.stages} stages"
        print(f"serving `{name}` ({what}, cut `{art.cut_id}`) on "
              f"http://{FLAGS.host}:{FLAGS.port}", file=sys.stderr, flush=True)
        web.run_app(app, host=FLAGS.host, port=FLAGS.port, print=None, handle_signals=True)

    return main


if __name__ == "__main__":
    cli.run(serve_main)
