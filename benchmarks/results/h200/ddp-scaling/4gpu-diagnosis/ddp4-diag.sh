# Issue 26 diagnosis on 4 GPUs: PHASE=C -> per-GPU 1024 (host slack) + GPU-resident data + all-reduce timing;
# PHASE=D -> per-GPU 512 again (spread) + GPU-resident data + CUDA graphs. Results in runs/ddp4/<phase>.
set -u; T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p runs/ddp4; (nvidia-smi; nproc) > runs/ddp4/machine-$PHASE.txt 2>&1
D="python -m benchmarks.speed.ddp --data data"
run() { n=$1; shift; L=$(( ${LIMIT:-560} - $(el) )); timeout $L $D "$@" --out runs/ddp4/$n > runs/ddp4/$n.log 2>&1
  echo "$n rc $? at $(el) s" >> runs/ddp4/phases.log; grep -a "bench-ddp" runs/ddp4/$n.log | tail -14 >> runs/ddp4/phases.log; }
[ $PHASE = C ] && run C --gpus 1,4 --mode per-gpu --steps 100 --timeout 240 --allreduce --variant gpu-data:data.loader=gpu data.batch_size=1024
[ $PHASE = D ] && run D --gpus 1,4 --mode per-gpu --steps 150 --timeout 200 --variant gpu-data:data.loader=gpu --variant cuda-graphs:train.compile_mode=reduce-overhead
tar czf $OUT/ddp4-$PHASE.tgz runs/ddp4; cat runs/ddp4/phases.log
