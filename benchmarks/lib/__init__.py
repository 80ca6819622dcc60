"""The benchmarks' one small library: environment capture (`env`), timing (`timing`), model building and the
decode step (`models`), command-line flags (`cli`), and tables, JSON and plots (`report`).

Every `benchmarks/bench_*.py` script is a thin layer over it: what it measures, not how it times or writes.
"""
