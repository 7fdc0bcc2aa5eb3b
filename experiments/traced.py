"""`python experiments/traced.py ARGS`: `python -m kernjax.serve ARGS` that records a JAX profile
of items FIRST..FIRST+COUNT-1 into DIR, with `KERNJAX_TRACE=DIR:FIRST:COUNT` in its environment.

The profile starts once item FIRST-1 is logged (`kernjax.timeline.log_item`, which every stage
calls per item) and stops once the last is. `experiments/load.py --trace` starts each serving
process this way and sums each one's kernels (experiments/gpuprofile.py).
"""

import os
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import jax  # noqa: E402

from kernjax import timeline  # noqa: E402

_log = timeline.log_item
_where, _first, _count = os.environ["KERNJAX_TRACE"].rsplit(":", 2)


def log_item(stage: int, item: int, *rest) -> None:
    _log(stage, item, *rest)
    if item == int(_first) - 1:
        jax.profiler.start_trace(_where)
    elif item == int(_first) + int(_count) - 1:
        jax.profiler.stop_trace()


timeline.log_item = log_item  # before kernjax.serve's modules import it
sys.argv[0] = "kernjax.serve"
runpy.run_module("kernjax.serve", run_name="__main__", alter_sys=True)
