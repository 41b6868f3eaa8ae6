#!/usr/bin/env bash
# Issue 47 item 1: the fused GroupNorm's levers in the step, on one GPU, in one call (NOTES item 29).
#
#   OUT=runs/levers FFCV_DDPM_COMMIT=<sha> bash benchmarks/speed/levers.sh [NAME:KEY=VALUE[,KEY=VALUE...] ...]
#
# Row 24 of the DDPM table (today's defaults: batch 1024, bf16, compiled with CUDA graphs, GPU-resident data) once per
# variant, each a `python -m benchmarks.speed.bench --data data --table ddpm --rows 24 --name NAME data.batch_size=1024
# KEY=VALUE...` in a fresh process, one after another on the one GPU, in the order given: the defaults first (their
# compilation cold: 150 s on an H100 at 5f421de), then each variant (110 s with the Triton cache warm), then the
# defaults again if time is left (a second default row: how far two rows of the same settings drift in one call).
# A row starts only with the time it needs left in BUDGET seconds (default 530: a 9-minute call with a minute to
# start); each row's files (NAME.json/.md/.png under OUT/rows, NAME.log) are in OUT when it ends, phases.log says
# when each ran. Without arguments, the variants of item 29, the lever pair first.
set -u
OUT=${OUT:?"set OUT to the folder the results go to"}
BUDGET=${BUDGET:-530}
T0=$(date +%s)
mkdir -p "$OUT/rows"
el() { echo $(( $(date +%s) - T0 )); }
log() { echo "$(date +%T) +$(el)s $*" | tee -a "$OUT/phases.log"; }

# row NAME NEED [KEY=VALUE...]: one bench row, if NEED seconds are left.
row() {
    local name=$1 need=$2 left
    shift 2
    left=$(( BUDGET - $(el) ))
    if [ "$left" -lt "$need" ]; then
        log "SKIP $name: $left s left, it needs $need"
        return
    fi
    log "START $name (limit $left s): $*"
    timeout "$left" python -m benchmarks.speed.bench --data data --table ddpm --rows 24 --name "$name" \
        --out "$OUT/rows" data.batch_size=1024 "$@" > "$OUT/$name.log" 2>&1
    log "END $name rc=$?"
    grep -a "ms/iter\|rror" "$OUT/$name.log" | tail -3 >> "$OUT/phases.log"
}

if [ $# -eq 0 ]; then
    set -- both:model.norm_saved_means=True,model.norm_mask_bits=True means:model.norm_saved_means=True \
        bits:model.norm_mask_bits=True
fi
{ nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv; nproc; \
  echo "commit ${FFCV_DDPM_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}"; } > "$OUT/machine.txt" 2>&1
row c-defaults 200
for spec in "$@"; do
    IFS=',' read -r -a kv <<< "${spec#*:}"
    row "c-${spec%%:*}" 130 "${kv[@]}"
done
row t-defaults 90
log "ALL DONE"
