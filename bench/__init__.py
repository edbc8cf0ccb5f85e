"""Benchmarks of the commit path: ExtensibleTensor against per-granule and single-handle VMM commits, against
torch's default caching allocator (cudaMalloc) and expandable segments, and the cost of zeroing and of accessing
VMM-backed memory.

Run them with pytest-benchmark (they are plain pytest tests; ``--benchmark-disable`` in pyproject.toml makes each
benchmarked function run once, as a smoke test, unless ``--benchmark-enable`` is given)::

    python3 -m pytest bench --benchmark-enable --benchmark-json=reports/out/bench-cuda.json
    python3 -m extensible_kv bench-summary reports/out/bench-cuda.json

``bench/conftest.py`` picks the driver (``--bench-driver``, default: the best available one) and the sizes
(``--bench-scale``); ``extensible_kv_lab.report.benchmarks`` turns the JSON into the target ratios. Nothing here
asserts a time: the benchmarks assert that what they committed is really usable, the summary compares numbers to
targets.
"""
