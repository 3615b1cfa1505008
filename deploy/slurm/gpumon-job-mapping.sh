#!/usr/bin/env bash
# Slurm prolog and epilog for gpumon's job attribution: keeps a job-mapping directory in
# dcgm-exporter's format (one file per GPU index, one job id per line) that gpumon reads through
# [attribution] job_mapping_dir. Install it as both Prolog and Epilog in slurm.conf; Slurm sets
# SLURM_SCRIPT_CONTEXT (prolog_slurmd / epilog_slurmd) so the one script knows which it is, or pass
# "prolog" / "epilog" as the first argument. The GPUs are SLURM_JOB_GPUS (physical indexes, set for
# gres/gpu jobs in prolog and epilog), else CUDA_VISIBLE_DEVICES.
#
# It never fails a job: a non-zero exit from a prolog drains the node, so every problem is logged
# to stderr (slurmd's log) and the script exits 0.
set -uo pipefail

DIR="${GPUMON_JOB_MAPPING_DIR:-/run/gpumon/job-mapping}"
mode="${1:-${SLURM_SCRIPT_CONTEXT:-}}"
case "$mode" in
    prolog*) mode=prolog ;;
    epilog*) mode=epilog ;;
    *) echo "gpumon-job-mapping: neither prolog nor epilog (SLURM_SCRIPT_CONTEXT='${SLURM_SCRIPT_CONTEXT:-}')" >&2; exit 0 ;;
esac

job="${SLURM_JOB_ID:-}"
gpus="${SLURM_JOB_GPUS:-${CUDA_VISIBLE_DEVICES:-}}"
if [[ ! "$job" =~ ^[0-9]+$ ]]; then
    echo "gpumon-job-mapping: SLURM_JOB_ID '${job}' is not a job id" >&2
    exit 0
fi
[ -n "$gpus" ] || exit 0  # a job without GPUs: nothing to map

mkdir -p "$DIR" 2>/dev/null && chmod 0755 "$DIR" 2>/dev/null
exec 9>>"$DIR/.lock" || { echo "gpumon-job-mapping: cannot open $DIR/.lock" >&2; exit 0; }
flock -w 10 9 || { echo "gpumon-job-mapping: $DIR/.lock held for 10 s" >&2; exit 0; }

IFS=',' read -r -a list <<< "$gpus"
for gpu in "${list[@]}"; do
    if [[ ! "$gpu" =~ ^[0-9]+$ ]]; then
        echo "gpumon-job-mapping: GPU '${gpu}' is not an index (UUIDs in CUDA_VISIBLE_DEVICES are not mapped)" >&2
        continue
    fi
    file="$DIR/$gpu"
    tmp="$DIR/.$gpu.$$"
    { [ -f "$file" ] && grep -vx -- "$job" "$file"; true; } > "$tmp"
    [ "$mode" = prolog ] && echo "$job" >> "$tmp"
    if [ -s "$tmp" ]; then
        chmod 0644 "$tmp" && mv -f "$tmp" "$file"   # rename: a reader never sees half a file
    else
        rm -f "$tmp" "$file"
    fi
done
exit 0
