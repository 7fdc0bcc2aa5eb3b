"""`python -m experiments.traced ARGS`: `kernjax serve ARGS` that records a JAX profile
of items FIRST..FIRST+COUNT-1 into DIR, with `KERNJAX_TRACE=DIR:FIRST:COUNT` in its environment.

The profile starts once item FIRST-1 is logged (`kernjax.serve.timeline.log_item`, which every stage
calls per item) and stops once the last is. Python's own calls are traced only with
`KERNJAX_TRACE_PYTHON=1`: the tracer slows every Python call, the host's issue most of all.
Meanwhile each issue of a program on the host (`Runner.run`, `Runner.run_edged`) is timed, and
the times go to DIR.issue.json: how long the issuing thread takes per item, profiled or not.
`experiments/load.py --trace` starts each serving process this way and sums each one's kernels
(experiments/gpuprofile.py).
"""

import json
import os
import sys
import time
from pathlib import Path

import jax

from kernjax.runtime import runner
from kernjax.serve import timeline

_log = timeline.log_item
_where, _first, _count = os.environ["KERNJAX_TRACE"].rsplit(":", 2)
_issues: list[float] = []
_on = [False]


def log_item(stage: int, item: int, *rest) -> None:
    _log(stage, item, *rest)
    if item == int(_first) - 1:
        opts = jax.profiler.ProfileOptions()
        opts.python_tracer_level = int(os.environ.get("KERNJAX_TRACE_PYTHON", "0"))
        opts.host_tracer_level = 2
        jax.profiler.start_trace(_where, profiler_options=opts)
        _on[0] = True
    elif item == int(_first) + int(_count) - 1:
        jax.profiler.stop_trace()
        _on[0] = False
        Path(f"{_where}.issue.json").write_text(json.dumps({"issue_ms": _issues}))
        print(f"traced: items {_first}.. in {_where}, {len(_issues)} issues timed", file=sys.stderr,
              flush=True)


def timed(f):
    def issue(self, *args, **kwargs):
        t = time.perf_counter()
        out = f(self, *args, **kwargs)
        if _on[0]:
            _issues.append(1e3 * (time.perf_counter() - t))
        return out
    return issue


runner.Runner.run = timed(runner.Runner.run)
runner.Runner.run_edged = timed(runner.Runner.run_edged)
timeline.log_item = log_item  # before kernjax.serve's head and stage host import it

if __name__ == "__main__":
    from kernjax.cli import main

    main(["serve", *sys.argv[1:]])
