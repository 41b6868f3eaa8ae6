# One GPU call: DDP on 1, 2, 4 GPUs with one compiled graph (train.ddp_split=False), both modes, loss check.
set -u
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
(nvidia-smi; nvidia-smi topo -m; nproc) > $OUT/machine.txt 2>&1
python -c "from pathlib import Path; from benchmarks.common import ensure_dataset; ensure_dataset(Path('data'), num_synthetic=50000)" > /tmp/data.log 2>&1 || { tail -5 /tmp/data.log >> $OUT/phases.log; exit 1; }
echo "data ready at $(el) s" >> $OUT/phases.log
# Compile the three per-rank batch sizes at once (512: per-GPU points and 4 GPUs at 2048; 1024: 2 GPUs at 2048;
# 2048: one GPU at 2048) so that the timed points below load them from the cache.
warm() { CUDA_VISIBLE_DEVICES=$1 python -m ffcv_ddpm.train --preset ddpm-cifar10 --data data/cifar10_train_raw.beton \
  data.batch_size=$2 data.num_workers=8 train.steps=3 train.log_every=1 train.ckpt_every=1000000000 \
  train.sample_every=0 train.progress=False train.telemetry=False train.out_dir=/tmp/warm$1 train.ddp_split=False \
  > /tmp/warm$1.log 2>&1; rc=$?; echo "warm batch $2: rc $rc at $(el) s" >> $OUT/phases.log; [ $rc = 0 ] || tail -3 /tmp/warm$1.log >> $OUT/phases.log; }
warm 0 512 & warm 1 1024 & warm 2 2048 & wait
O="--data data --steps 150 train.ddp_split=False"
timeout 210 python -m benchmarks.ddp --gpus 1,2,4 --mode per-gpu $O --out $OUT/A 2>&1 | grep -a "bench-ddp\|Error" >> $OUT/phases.log
echo "A done at $(el) s" >> $OUT/phases.log
timeout 250 python -m benchmarks.ddp --gpus 1,2,4 --mode global --loss-check --log-every 10 $O --steps 200 data.batch_size=2048 --out $OUT/G 2>&1 | grep -a "bench-ddp\|Error" >> $OUT/phases.log
echo "G done at $(el) s" >> $OUT/phases.log
left=$(( 575 - $(el) )); [ $left -gt 60 ] && timeout $left python -m benchmarks.ddp --gpus 1,2,4 --mode per-gpu $O --out $OUT/B 2>&1 | grep -a "bench-ddp\|Error" >> $OUT/phases.log
echo "B done at $(el) s" >> $OUT/phases.log
rm -f $OUT/*/ddp.png
cat $OUT/phases.log
