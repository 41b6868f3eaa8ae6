# Issue 26, the committed points (x4), session of 2026-11-27. Call up to three times on the warm machine: each phase
# is skipped once done (ddp.md written); a phase cut by the call's limit still fills the compile cache for the next.
#   P: per-GPU 1,2,4, GPU-resident data + CUDA graphs (NOTES 18), and the same with FFCV (the epoch start without a
#      drain, 928f730), only if the GPU test of that change passes
#   G: global batch 512 x 4, same settings, loss check over 300 steps
#   S: P's base points again (the spread between two runs on one machine)
#   prof4: rank 0 profile of the final settings on 4
set -u; T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
R=runs/ddpg; mkdir -p $R; (nvidia-smi; nvidia-smi topo -m; nproc) > $R/machine-$(date +%H%M).txt 2>&1
[ -f $R/gpu-test.log ] || { timeout 150 python -m pytest -q -p no:cacheprovider tests/test_data.py -k gpu > $R/gpu-test.log 2>&1; echo "gpu-test rc $? at $(el) s" >> $R/phases.log; tail -3 $R/gpu-test.log >> $R/phases.log; }
FF=""; grep -q " passed" $R/gpu-test.log && ! grep -q "failed\|error" $R/gpu-test.log && FF="--variant ffcv:data.loader=ffcv"
G=${GPUS:-1,2,4}; M=${G##*,}
D="python -m benchmarks.speed.ddp --data data"; FAST="data.loader=gpu train.compile_mode=reduce-overhead"
run() { n=$1; shift; [ -f $R/$n/ddp.md ] && return; L=$(( ${LIMIT:-560} - $(el) )); [ $L -lt 90 ] && { echo "$n skipped" >> $R/phases.log; return; }
  timeout $L $D "$@" --out $R/$n > $R/$n.log 2>&1; echo "$n rc $? at $(el) s" >> $R/phases.log
  grep -a "bench-ddp" $R/$n.log | tail -14 >> $R/phases.log; }
run P --gpus $G --mode per-gpu --steps 150 --timeout 240 $FF $FAST
run G --gpus $G --mode global --loss-check --steps 300 --log-every 10 --timeout 300 data.batch_size=$(( 512 * M )) $FAST
run S --gpus $G --mode per-gpu --steps 150 --timeout 240 $FAST
[ -n "${B:-}" ] && run B --gpus $G --mode per-gpu --steps 150 --timeout 240 data.batch_size=1024 $FAST   # the trainer batch of one GPU, per GPU
L=$(( ${LIMIT:-560} - $(el) )); [ -z "${B:-}" ] && [ ! -f $R/prof4/profile.md ] && [ $L -gt 150 ] && { timeout $L torchrun --standalone --nproc_per_node $M -m benchmarks.speed.profile --data data --out $R/prof4 data.batch_size=512 $FAST > $R/prof4.log 2>&1; echo "prof4 rc $? at $(el) s" >> $R/phases.log; }
tar czf $OUT/ddpg.tgz $R; cat $R/phases.log
