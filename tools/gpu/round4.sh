#!/bin/sh
# Round 4 on one real GPU (issue 41), in two device calls of under 10 minutes each; every result lands in $OUT.
#   tools/gpu/round4.sh speed     the playbook A/B with its profile (issue 43), the configuration faults on the real
#                                 driver (issue 40), the readings and the peer check against nvidia-smi (issue 39)
#   tools/gpu/round4.sh stop      a torch server's stop in order, all at once, and after a crash (issue 38)
#   tools/gpu/round4.sh all       all of it in one call of under 10 minutes, with shorter limits (REPEAT=5 for the A/B)
#   tools/gpu/round4.sh short     the same in under 8 minutes (REPEAT=3), for a session with little device time left
# ansible-core comes from the wheels carried in .whl/; the A/B's baseline from .ab-base/<commit> when carried
# (git archive of the commit; docs/validation.md, "Round 4"). Each step has its own time limit, so one that hangs
# leaves the others' results. NVLink multicast stays off; nothing here resets a GPU or changes its settings.
set -u
cd "$(dirname "$0")/../.."
out=${OUT:?OUT names the folder for the results}
if ! python3 -c 'import ansible' 2>/dev/null; then
    # Compiled at install, as pip does by default: the A/B measures Ansible, not a first compile of it at every run
    # (the 2026-12-05 run installed with --no-compile; docs/benchmarks.md, "Cost of trust on a real GPU").
    python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/gpuops-site .whl/*.whl || exit 2
    PYTHONPATH=/tmp/gpuops-site${PYTHONPATH:+:$PYTHONPATH}
    PATH=/tmp/gpuops-site/bin:$PATH
    export PYTHONPATH PATH
fi
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi -L | tee "$out/gpus.txt"
# Whether this machine writes bytecode, and where Ansible comes from: both move every Python figure of the A/B.
{ python3 -VV; env | grep -E '^PYTHON' | sort; python3 -c 'import sys, ansible; print("dont_write_bytecode", sys.dont_write_bytecode, ansible.__file__)'; } > "$out/python.txt" 2>&1
gpus=$(nvidia-smi -L | grep -c '^GPU ')
faults() {
    echo "=== configuration faults"
    timeout "$1" python3 tools/gpu/config_faults.py --out "$out/config-faults" >"$out/config-faults.log" 2>&1
    echo "rc $?"; tail -40 "$out/config-faults.log"
}
ab() {
    base=$(ls -d .ab-base/* 2>/dev/null | head -1)
    echo "=== playbook A/B (baseline ${base:-none})"
    timeout "$1" python3 tools/gpu/playbook_ab.py ${base:+--baseline "$base"} --repeat "${REPEAT:-7}" --gpus "$gpus" --profile \
        >"$out/playbook-ab.md" 2>"$out/playbook-ab.log"
    echo "rc $?"; cat "$out/playbook-ab.md"; tail -5 "$out/playbook-ab.log"
}
peers() {
    echo "=== readings and the peer check"
    timeout "$1" python3 tools/gpu/peers.py --repeat 3 >"$out/peers.json" 2>"$out/peers.log"
    echo "rc $?"; tail -15 "$out/peers.log"
}
stop() {
    echo "=== stop in order"
    timeout "$1" tools/gpu/run.sh --pidns --phases stop --repeat 1 --out "$out/validate" >"$out/stop.log" 2>&1
    echo "rc $?"; tail -60 "$out/stop.log"
}
case ${1:-} in
speed) ab 300; faults 120; peers 120 ;;
stop) stop 540 ;;
all) REPEAT=${REPEAT:-5}; faults 80; stop 260; ab 160; peers 60 ;;
short) REPEAT=${REPEAT:-3}; faults 60; stop 220; ab 120; peers 45 ;;
*)
    echo "usage: $0 speed|stop|all|short" >&2
    exit 2
    ;;
esac
# The device tool brings back at most 8 files from $OUT (on 2026-12-05 the stop's validate JSON, a tenth file, stayed
# there): everything goes back as one archive, round4.tgz.
tar -C "$out" -czf /tmp/round4.tgz . && find "$out" -mindepth 1 -delete && mv /tmp/round4.tgz "$out/"
