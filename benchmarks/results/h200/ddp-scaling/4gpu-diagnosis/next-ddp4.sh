# Issue 26 on 4 GPUs (x4 when status lists it; GPUS=1,2 on x2): per-GPU (graph cuts as the variant), per-GPU at 1024, the global
# check, per-GPU again (spread). Rerun on the warm machine to finish what one call left. The benchmark compiles every point's graph at once first (--warm auto). Results in runs/ddp4/*.
set -u; T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p runs/ddp4; (nvidia-smi; nvidia-smi topo -m; nproc) > runs/ddp4/machine.txt 2>&1
G=${GPUS:-1,2,4}; D="python -m benchmarks.speed.ddp --data data"
run() { n=$1; shift; [ -f runs/ddp4/$n/ddp.md ] && return; L=$(( ${LIMIT:-570} - $(el) )); [ $L -lt 120 ] && { echo "$n skipped" >> runs/ddp4/phases.log; return; }
  timeout $L $D "$@" --out runs/ddp4/$n > runs/ddp4/$n.log 2>&1; echo "$n rc $? at $(el) s" >> runs/ddp4/phases.log
  grep -a "bench-ddp" runs/ddp4/$n.log | tail -12 >> runs/ddp4/phases.log; }
run A --gpus $G --mode per-gpu --steps 150 --timeout 300 --variant graph-cuts:train.ddp_split=True
run C --gpus $G --mode per-gpu --steps 100 --timeout 300 data.batch_size=1024   # NOTES 14's prediction: >= 97%
run G --gpus 1,${G##*,} --mode global --loss-check --steps 300 --log-every 10 --timeout 240 data.batch_size=$(( 512 * ${G##*,} ))
run B --gpus $G --mode per-gpu --steps 150 --timeout 300 --variant graph-cuts:train.ddp_split=True --variant one-bucket:train.ddp_bucket_mb=200   # A again (spread) + one graph with one all-reduce (NOTES 17; same graph: no compile)
tar czf $OUT/ddp4.tgz runs/ddp4; cat runs/ddp4/phases.log
