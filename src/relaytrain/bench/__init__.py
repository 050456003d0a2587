"""`relaytrain bench NAME`: benchmarks that measure against a baseline run side by side in the
same process or run, and print ratios (never thresholds in unit tests).

Each module's `bench_*` function returns its result, which an optional `format_report(result)`
turns into text; `relaytrain.cli.bench` names them.
"""
