"""`kernjax VERB [--flags]`: the command line, one thin shell per verb over the library.

Each verb's module defines `main_def()`, which defines the verb's absl flags and returns its
`main`; `main` turns the flags into plain arguments for library calls and prints. Nothing here
is imported by the library. `kernjax` with no verb (or only flags) runs `demo`, the main job.
"""

from __future__ import annotations

import importlib
import sys

VERBS = {
    "cut": "trace a model and cut it into stage artifacts",
    "run": "prefill one prompt through a cut's stages or the whole program",
    "chain": "the chain gate: whole and stages on prompts, compared bit for bit",
    "serve": "one stage of a pipeline (or the whole program) behind HTTP",
    "weights": "write a named model's deterministic random checkpoint",
    "timeline": "where each stage's time goes, read back from the stages' logs",
    "demo": "the main job: cut the default model into 2 and 3 stages and run the chain gate",
}


def usage() -> str:
    width = max(map(len, VERBS))
    return "\n".join(["usage: kernjax VERB [--flags]   (kernjax VERB --help: the verb's flags)",
                      "", "verbs:", *(f"  {v:<{width}}  {h}" for v, h in VERBS.items()),
                      "", "With no verb, kernjax runs `demo`."])


def main(argv: list[str] | None = None) -> None:
    """Runs the verb `argv[0]` (default: `sys.argv[1:]`) with the rest of `argv` as its flags."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["help"], ["-h"], ["--help"]) and len(argv) == 1:
        print(usage())
        return
    verb = argv[0] if argv and not argv[0].startswith("-") else "demo"
    if argv and argv[0] == verb:
        argv = argv[1:]
    if verb not in VERBS:
        print(f"error: `{verb}` is not a verb of kernjax; the verbs are {', '.join(VERBS)} "
              "(kernjax --help)", file=sys.stderr)
        sys.exit(2)
    from kernjax.cli import shell
    sys.argv = [f"kernjax {verb}", *argv]
    shell.run(importlib.import_module(f"kernjax.cli.{verb}").main_def)
