# Issue 26, next session (x4; GPUS=1,2 on an x2): DDP's wrapper against one flat all-reduce (train.ddp_reduce=flat,
# NOTES item 19), all with GPU-resident data + CUDA graphs. Call it on the warm machine until its phases are done;
# a finished phase (ddp.md written) is skipped, a cut one has filled the compile cache for the next call.
#   test: the NCCL test of the flat all-reduce (tests/test_ddp.py -k flat); nothing is measured if it fails
#   F: per-GPU 512 on 1,2,4: ddp (the default) and flat, one call: ~470 s cold (5 graphs compile in one round)
#   then, with RED=<the winner of F> (flat unless F says otherwise):
#   B: per-GPU 1024 on 1,2,4 (the 4-GPU point the final/ B lacked)
#   G: global 512 x M with the loss check
#   prof: rank 0 profile on M GPUs at 512, RED's settings
set -u; T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
R=runs/ddpflat; mkdir -p $R; (nvidia-smi; nvidia-smi topo -m; nproc) > $R/machine-$(date +%H%M).txt 2>&1
[ -f $R/gpu-test.log ] || { timeout 150 python -m pytest -q -p no:cacheprovider tests/test_ddp.py -k "two_gpus or backend" -rs > $R/gpu-test.log 2>&1; echo "gpu-test rc $? at $(el) s" >> $R/phases.log; tail -3 $R/gpu-test.log >> $R/phases.log; }
grep -q " passed" $R/gpu-test.log && ! grep -q "failed\|error" $R/gpu-test.log || { echo "flat GPU test failed: nothing measured" >> $R/phases.log; tar czf $OUT/ddpflat.tgz $R; cat $R/phases.log; exit 1; }
[ -f $R/ops/reducer_ops.json ] || { timeout 120 python -m benchmarks.speed.reducer_ops --device cuda --out $R/ops > $R/ops.log 2>&1; echo "ops rc $? at $(el) s" >> $R/phases.log; }   # the kernels DDP adds per step, counted
G=${GPUS:-1,2,4}; M=${G##*,}; RED=${RED:-flat}
D="python -m benchmarks.speed.ddp --data data"; FAST="data.loader=gpu train.compile_mode=reduce-overhead"
run() { n=$1; shift; [ -f $R/$n/ddp.md ] && return; L=$(( ${LIMIT:-560} - $(el) )); [ $L -lt 90 ] && { echo "$n skipped" >> $R/phases.log; return; }
  timeout $L $D "$@" --out $R/$n > $R/$n.log 2>&1; echo "$n rc $? at $(el) s" >> $R/phases.log
  grep -a "bench-ddp" $R/$n.log | tail -14 >> $R/phases.log; }
run F --gpus $G --mode per-gpu --steps 150 --timeout 240 --variant flat:train.ddp_reduce=flat $FAST
run B --gpus $G --mode per-gpu --steps 150 --timeout 240 data.batch_size=1024 train.ddp_reduce=$RED $FAST
run G --gpus $G --mode global --loss-check --steps 300 --log-every 10 --timeout 300 data.batch_size=$(( 512 * M )) train.ddp_reduce=$RED $FAST
L=$(( ${LIMIT:-560} - $(el) )); [ ! -f $R/prof/profile.md ] && [ $L -gt 150 ] && { timeout $L torchrun --standalone --nproc_per_node $M -m benchmarks.speed.profile --data data --out $R/prof data.batch_size=512 train.ddp_reduce=$RED $FAST > $R/prof.log 2>&1; echo "prof rc $? at $(el) s" >> $R/phases.log; }
tar czf $OUT/ddpflat.tgz $R; cat $R/phases.log
