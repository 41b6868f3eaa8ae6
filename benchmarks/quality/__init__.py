"""How good: sample quality on the digits, the score-SDE samplers, compression, FID (see benchmarks/__init__.py)."""
