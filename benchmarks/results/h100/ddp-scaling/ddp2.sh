# DDP on 2 GPUs (issue 26). Phases in order, each skipped when done by an earlier call on this (warm) machine:
# data, warm (the four graphs compiled at once), A (per-GPU, split vs one graph), G (global 1024 + loss check,
# the faster DDP form), B (A again: the spread). Each phase starts only with room for it; results under runs/ddp/.
set -u
T0=$(date +%s); LIMIT=${LIMIT:-575}
el() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( LIMIT - $(el) )); }
log() { echo "$* at $(el) s" | tee -a runs/ddp/phases.log; }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p runs/ddp
log "call start (commit $FFCV_DDPM_COMMIT)"
[ -f runs/ddp/machine.txt ] || (nvidia-smi; nvidia-smi topo -m; nproc) > runs/ddp/machine.txt 2>&1
python -c "from pathlib import Path; from benchmarks.common import ensure_dataset; ensure_dataset(Path('data'), num_synthetic=50000)" > /tmp/data.log 2>&1 || { tail -5 /tmp/data.log >> runs/ddp/phases.log; exit 1; }
log "data ready"
D="python -m benchmarks.speed.ddp --data data"
if [ ! -f runs/ddp/warm.done ]; then
  # Compile every graph the timed points use, at once (CPU-bound), so that each point loads it from .compile-cache.
  CUDA_VISIBLE_DEVICES=0 $D --gpus 1 --steps 3 --log-every 1 --out runs/w/one512 > runs/ddp/w1.log 2>&1 &
  CUDA_VISIBLE_DEVICES=1 $D --gpus 1 --steps 3 --log-every 1 data.batch_size=1024 --out runs/w/one1024 > runs/ddp/w2.log 2>&1 &
  $D --gpus 2 --steps 3 --log-every 1 --out runs/w/split > runs/ddp/w3.log 2>&1 &
  $D --gpus 2 --steps 3 --log-every 1 train.ddp_split=False --out runs/w/onegraph > runs/ddp/w4.log 2>&1 &
  wait
  grep -h "bench-ddp\|Error" runs/ddp/w?.log | tail -8 >> runs/ddp/phases.log
  touch runs/ddp/warm.done; log "warm done"
fi
phase() {  # NAME NEEDED_S ARGS...: run benchmarks.speed.ddp into runs/ddp/NAME unless done or without room
  name=$1; need=$2; shift 2
  [ -f runs/ddp/$name/done ] && return 0
  [ $(left) -lt $need ] && { log "$name skipped: $(left) s left"; return 0; }
  timeout $(( $(left) - 5 )) $D "$@" --out runs/ddp/$name > runs/ddp/$name.log 2>&1; rc=$?
  grep -a "bench-ddp\|Error\|loss" runs/ddp/$name.log | tail -8 >> runs/ddp/phases.log
  [ $rc = 0 ] && touch runs/ddp/$name/done; log "$name rc $rc"
}
phase A 200 --gpus 1,2 --mode per-gpu --steps 150 --timeout 300 --variant one-graph:train.ddp_split=False
# The global-batch check with the faster of the two DDP forms A measured.
WIN=$(python - <<'PY'
import json
try:
    p = json.load(open("runs/ddp/A/ddp.json"))["points"]
    two = lambda m: next((x["img_per_s"] for x in p.get(m, []) if x["nproc"] == 2 and "error" not in x), 0)
    print("train.ddp_split=False" if two("per-GPU, one-graph") > two("per-GPU") else "train.ddp_split=True")
except Exception:
    print("train.ddp_split=True")
PY
)
log "G uses $WIN"
phase G 230 --gpus 1,2 --mode global --loss-check --steps 300 --log-every 10 --timeout 200 data.batch_size=1024 $WIN
phase B 200 --gpus 1,2 --mode per-gpu --steps 150 --timeout 300 --variant one-graph:train.ddp_split=False
rm -rf $OUT/*; mkdir -p $OUT
for n in A G B; do [ -f runs/ddp/$n/ddp.json ] && { mkdir -p $OUT/$n; cp runs/ddp/$n/ddp.json runs/ddp/$n/ddp.md $OUT/$n/; }; done
cp runs/ddp/phases.log runs/ddp/machine.txt $OUT/
cat runs/ddp/phases.log
