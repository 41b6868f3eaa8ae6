"""Two rooms, and what both use.

- benchmarks.speed: how fast. The training-step tables (bench, rows, runner, jobs, report), FLOPs and card peaks
  (flops, peaks), loaders, DDP scaling (ddp), bf16 vs fp32 curves (numerics), the profiler (profile,
  profile_analysis), sweeps, the normalization kernels (norm_bench), merging tables (merge), trainer_vs_bench.
- benchmarks.quality: how good. Sample quality on the digits (digits, digits_report), the score-SDE samplers (sde,
  sde_report), compression (compress, compress_report), FID (fid), and what the studies share (study).
- shared, at the root: benchmarks.common (dataset names, the results folder, JSON/Markdown/PNG writing),
  benchmarks.ledger (results/README.md, the index of every committed result), results/ (the committed results).
"""
