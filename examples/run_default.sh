#!/usr/bin/env bash
# The main job on a fresh machine: install what it needs, then pretrain the default Llama on 2 CPU
# ranks with the embedded corpus (no downloads besides the pip packages; a few minutes on 2 cores).
#
#   bash examples/run_default.sh                      # output in runs/default
#   OUT=runs/try2 bash examples/run_default.sh        # another output directory
#   bash examples/run_default.sh --steps 600          # extra flags go to examples/pretrain_llama.py
#   NPROC=4 bash examples/run_default.sh              # more ranks
#
# Running it again on the same OUT stops with "already holds a run": pass --resume to continue that
# run, --overwrite to start it afresh, or choose another OUT. See docs/pretrain.md.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
OUT=${OUT:-runs/default}
NPROC=${NPROC:-2}

# torch is pinned: torch==2.13.0 takes the local CPU wheel; an unpinned torch would pull another build.
$PY -m pip install -q torch==2.13.0
$PY -m pip install -q numpy transformers safetensors tqdm matplotlib nvtx ninja
# --no-build-isolation: build the extension against the torch above, never fetch another one.
$PY -m pip install -q --no-build-isolation -e .
$PY -c "import yafsdp, yafsdp.kernels as k; print('yafsdp', yafsdp.__version__, '| kernels:', k.backend() if hasattr(k, 'backend') else 'torch')"

exec $PY -m torch.distributed.run --nproc-per-node "$NPROC" examples/pretrain_llama.py --out "$OUT" "$@"
