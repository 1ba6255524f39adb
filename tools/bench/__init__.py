"""Benchmarks against the peers (TRL, Tunix), the sampler, real-size smoke runs and GPU checks:
``python -m tools.bench`` (``run.py``) and its workers; see ``tools/bench/README.md``."""
