#!/usr/bin/env bash
# The hand-run pipeline from the developers' guide, timed, inside whatever PID
# namespace this script is started in (validate.py starts it under
# `unshare --pid --fork --mount-proc`, so that `grep python3 | kill -9` and
# `fuser -k` can reach nothing but the workloads started here).
#
#   DEV=/dev GPUS=8 WORKLOADS=file pipeline.sh
#
# WORKLOADS names a file with one workload command per line; each must print a
# line starting with "ready" once it holds its GPU memory. (The commands are not
# passed as arguments: `ps aux | grep python3` would find them in this script's
# own command line and kill it.) Prints "pipeline <seconds> clean <0|1> checks <n>".
set -u
DEV=${DEV:-/dev}
GPUS=${GPUS:-1}
tmp=$(mktemp -d)
i=0
while IFS= read -r cmd; do
    [ -n "$cmd" ] || continue
    i=$((i + 1))
    bash -c "exec $cmd" >"$tmp/w$i.out" 2>"$tmp/w$i.err" &
done <"$WORKLOADS"
n=$i
for i in $(seq 1 "$n"); do
    for _ in $(seq 1 600); do
        grep -q '^ready' "$tmp/w$i.out" 2>/dev/null && break
        sleep 0.1
    done
done
# fuser comes from psmisc; where it is missing, an equivalent that SIGKILLs every
# process with an open fd on the device files, as `fuser -k` does.
fuser_k() {
    if command -v fuser >/dev/null 2>&1; then
        fuser -k "$DEV"/nvidia* >/dev/null 2>&1
    else
        for fd in /proc/[0-9]*/fd/*; do
            case "$(readlink "$fd" 2>/dev/null)" in
                "$DEV"/nvidia*) p=${fd#/proc/}; kill -9 "${p%%/*}" 2>/dev/null ;;
            esac
        done
    fi
}
smi() {
    if [ -n "${NVIDIA_SMI:-}" ]; then "$NVIDIA_SMI" "$@"; else nvidia-smi "$@"; fi
}
start=$(date +%s.%N)
# --- the guide's first command (run on the host instead of through pct exec) ---
ps aux | grep python3 | grep -v grep | awk '{print $2}' | xargs -r kill -9
# --- the operator's pause: the guide counts 3-5 s of fixed sleeps in all ---
sleep 3
# --- the guide's second command ---
fuser_k; sleep 2; smi --query-gpu=index,memory.used --format=csv,noheader >"$tmp/smi"
checks=1
# --- count the lines that say "0 MiB"; look again until all GPUs do ---
while [ "$(grep -c ', 0 MiB$' "$tmp/smi")" -lt "$GPUS" ] && [ $checks -lt 10 ]; do
    sleep 2; smi --query-gpu=index,memory.used --format=csv,noheader >"$tmp/smi"; checks=$((checks + 1))
done
end=$(date +%s.%N)
clean=0
[ "$(grep -c ', 0 MiB$' "$tmp/smi")" -ge "$GPUS" ] && clean=1
echo "pipeline $(awk "BEGIN { print $end - $start }") clean $clean checks $checks"
rm -rf "$tmp"
