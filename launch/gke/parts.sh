#!/usr/bin/env bash
# In each pod of a multi-host slice's Job (launch/gke/jobset-multi-host.yaml): answers parts r,
# r + S, r + 2S, ... of N in turn, where r is this slice's replica index (PODRUN_REPLICA), S the
# slices (PODRUN_SLICES) and N the parts (PODRUN_PARTS). Every host of the slice runs the same
# part at the same time, one podrun program. Stops at the first part that fails, with its status,
# so that JobSet restarts the slice; a part already finished exits 0 at once, so the restarted
# slice goes on where it stopped. podrun's arguments are this script's.
set -euo pipefail

for var in PODRUN_PARTS PODRUN_SLICES PODRUN_REPLICA; do
    [[ ${!var:-} =~ ^[0-9]+$ ]] || { echo "parts.sh: $var must be a number, not '${!var:-}'" >&2; exit 2; }
done
((PODRUN_SLICES > 0 && PODRUN_REPLICA < PODRUN_SLICES)) || {
    echo "parts.sh: replica $PODRUN_REPLICA is not one of $PODRUN_SLICES slices" >&2
    exit 2
}
for ((part = PODRUN_REPLICA; part < PODRUN_PARTS; part += PODRUN_SLICES)); do
    echo "parts.sh: part $part of $PODRUN_PARTS (replica $PODRUN_REPLICA of $PODRUN_SLICES slices)" >&2
    python -m runner.main "$@" "--config.io.parts=$PODRUN_PARTS" "--config.io.part=$part"
done
