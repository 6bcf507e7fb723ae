#!/bin/sh
# Hardware validation: run on a machine with NVIDIA GPUs and python3 with torch,
# nvidia-ml-py and psutil (no network needed). ansible-core is taken from the
# environment, or from wheels carried in .whl/ (see docs/validation.md).
#   tools/gpu/run.sh            real GPUs
#   tools/gpu/run.sh --sim      the same scenarios on the simulated node
set -eu
cd "$(dirname "$0")/../.."
if ! python3 -c 'import ansible' 2>/dev/null; then
    if ls .whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpuops-site .whl/*.whl
        PYTHONPATH=/tmp/gpuops-site${PYTHONPATH:+:$PYTHONPATH}
        PATH=/tmp/gpuops-site/bin:$PATH
        export PYTHONPATH PATH
    else
        echo "ansible-core is not installed and no wheels were carried in .whl/" >&2
        exit 2
    fi
fi
export PYTHONUNBUFFERED=1
case " $* " in
    *" --sim "*) ;;
    *) nvidia-smi -L ;;
esac
exec python3 tools/gpu/validate.py "$@"
