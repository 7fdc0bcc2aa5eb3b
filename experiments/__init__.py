"""kernjax's benchmarks, one module each, run as `python -m experiments.<name>` from the repository
root; experiments/README.md says what each measures. `harness` is what they share: the record of
where a run ran, timing, the GPU's clocks and the writer of results.json, README.md and plots.
Nothing in `kernjax/` imports this package.
"""
