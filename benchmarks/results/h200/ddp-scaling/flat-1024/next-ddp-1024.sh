# Issue 26, next session (x4; GPUS=1,2 on an x2): per-GPU 1024 with the flat all-reduce, twice (the spread), then the
# global-batch points + loss check with it. Every point's stats.jsonl now has each rank's all-reduce time and GC
# pauses (NOTES item 21's predictions). Call again on the warm machine until the phases are done; a finished phase
# (ddp.md written) is skipped; a cut one has filled the compile cache for the next call.
#   B1: per-GPU 1024 on 1,2,4, flat  (~360 s cold: 3 graphs compile at once, ~170 s)
#   B2: the same again (warm, ~180 s) + the gc.freeze variant on 2 and 4 (~120 s; the same graph)
#   G:  global 512 x M (2048 on 4: what one GPU fits), flat, loss check, 300 steps (the one-GPU control too)
set -u; T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
R=runs/ddp1024; mkdir -p $R; (nvidia-smi; nvidia-smi topo -m; nproc) > $R/machine-$(date +%H%M).txt 2>&1
G=${GPUS:-1,2,4}; M=${G##*,}
D="python -m benchmarks.speed.ddp --data data"; FAST="data.loader=gpu train.compile_mode=reduce-overhead train.ddp_reduce=flat"
run() { n=$1; shift; [ -f $R/$n/ddp.md ] && return; L=$(( ${LIMIT:-560} - $(el) )); [ $L -lt 90 ] && { echo "$n skipped" >> $R/phases.log; return; }
  timeout $L $D "$@" --out $R/$n > $R/$n.log 2>&1; echo "$n rc $? at $(el) s" >> $R/phases.log
  grep -a "bench-ddp" $R/$n.log | tail -8 >> $R/phases.log; }
run B1 --gpus $G --mode per-gpu --steps 150 --timeout 240 data.batch_size=1024 $FAST
run B2 --gpus $G --mode per-gpu --steps 150 --timeout 240 --variant gcfreeze:train.gc_freeze=True data.batch_size=1024 $FAST
run G --gpus $G --mode global --loss-check --steps 300 --log-every 10 --timeout 300 data.batch_size=$(( 512 * M )) $FAST
du -sk .compile-cache/*/* 2>/dev/null | sort -n > $R/cache-sizes.txt   # could a fresh machine be sent the small parts (carry)?
tar czf $OUT/ddp1024.tgz $R; cat $R/phases.log
for f in $R/B1/ddp.md $R/B2/ddp.md; do [ -f $f ] && grep "^| [124] |" $f; done
