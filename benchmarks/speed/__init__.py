"""How fast: training-step tables, MFU, loaders, DDP scaling, numerics, profiles (see benchmarks/__init__.py)."""
