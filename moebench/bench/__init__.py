"""The code the benchmark scripts in benchmarks/ share: the reference model, engines built on its
weights, the measurements, the decode benchmarks' run and the decode goals. Imported by those
scripts and by tests, never by the harness; it needs the engine's extras (torch, transformers).
"""
