#!/usr/bin/env bash
# The main job on a fresh machine: install what it needs, then pretrain the default Llama on 2 CPU
# ranks with the embedded corpus (no downloads besides the pip packages; a few minutes on 2 cores).
#
#   bash examples/run_default.sh                      # output in runs/default
#   OUT=runs/try2 bash examples/run_default.sh        # another output directory
#   bash examples/run_default.sh --steps 600          # extra flags go to examples/pretrain_llama.py
#   NPROC=4 bash examples/run_default.sh              # more ranks
#   SETUP_ONLY=1 bash examples/run_default.sh         # set up (or check the set-up), do not train
#
# Set-up is idempotent: each step runs only when needed, so a second call starts training within
# seconds. pip runs when torch is not 2.13.0 or a dependency does not import; the extension is
# (re)built when the set-up stamp -- a hash of csrc/, setup.py, pyproject.toml, the torch and
# Python versions and this checkout's path -- differs from the one written by the last complete
# build (build/yafsdp-setup.stamp), or when yafsdp does not import from this checkout with its
# CPU kernels. SETUP_DRY_RUN=1 says what would run and runs nothing (the tests use it).
#
# Running it again on the same OUT stops with "already holds a run": pass --resume to continue that
# run, --overwrite to start it afresh, or choose another OUT. See docs/pretrain.md.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
OUT=${OUT:-runs/default}
NPROC=${NPROC:-2}
STAMP_FILE=build/yafsdp-setup.stamp
t0=$(date +%s)

run() {  # a set-up step: run it, or only print it under SETUP_DRY_RUN=1
    if [ -n "${SETUP_DRY_RUN:-}" ]; then echo "setup    would run: $*"; else "$@"; fi
}

# One Python start-up inspects everything: the torch version, missing dependencies, whether yafsdp
# imports from this checkout with its CPU kernels, and the stamp of the sources. Prints one line:
# "<torch version|none> <missing,deps|-> <yes|no> <stamp>".
PROBE='
import glob, hashlib, importlib, os, sys
try:
    import torch
    tv = torch.__version__
except ImportError:
    tv = "none"
missing = []
for name in ("numpy", "transformers", "safetensors", "tqdm", "matplotlib"):
    try:
        importlib.import_module(name)
    except ImportError:
        missing.append(name)
ready = "no"
if tv != "none":
    try:
        import yafsdp, yafsdp.kernels as k
        same = os.path.realpath(os.path.dirname(yafsdp.__file__)) == os.path.realpath("yafsdp")
        built = getattr(k, "_C", None) is not None or os.environ.get("YAFSDP_NO_EXT")  # unless switched off
        ready = "yes" if same and built else "no"
    except Exception:
        pass
h = hashlib.sha256(f"{tv}|{sys.version}|{os.getcwd()}".encode())
for f in sorted(glob.glob("csrc/**/*", recursive=True)) + ["setup.py", "pyproject.toml"]:
    if os.path.isfile(f):
        h.update(f.encode() + bytes(1))
        h.update(open(f, "rb").read())
print(tv, ",".join(missing) or "-", ready, h.hexdigest()[:16])
'
read -r torch_version missing ready stamp < <($PY -c "$PROBE" 2>/dev/null || echo "none - no none")

# torch is pinned: torch==2.13.0 takes the local CPU wheel; an unpinned torch would pull another build.
if [ "${torch_version%%+*}" = "2.13.0" ]; then
    echo "setup    torch $torch_version already installed"
else
    run $PY -m pip install -q torch==2.13.0
fi
if [ "$missing" = "-" ]; then
    echo "setup    numpy, transformers, safetensors, tqdm, matplotlib already installed"
else
    echo "setup    installing the dependencies (missing: $missing)"
    run $PY -m pip install -q numpy transformers safetensors tqdm matplotlib nvtx ninja
fi
if [ "${torch_version%%+*}" != "2.13.0" ] && [ -z "${SETUP_DRY_RUN:-}" ]; then
    read -r torch_version missing ready stamp < <($PY -c "$PROBE")  # the stamp names the torch just installed
fi

if [ "$ready" = "yes" ] && [ -f "$STAMP_FILE" ] && [ "$(cat "$STAMP_FILE")" = "$stamp" ]; then
    echo "setup    yafsdp and its extension are up to date (stamp $stamp)"
else
    why="no set-up stamp"
    [ -f "$STAMP_FILE" ] && why="csrc/, setup.py or torch changed since the last build"
    [ "$ready" != "yes" ] && why="yafsdp does not import from $(pwd) with its kernels"
    echo "setup    building yafsdp and its extension ($why)"
    # --no-build-isolation: build the extension against the torch above, never fetch another one.
    run $PY -m pip install -q --no-build-isolation -e .
    if [ -z "${SETUP_DRY_RUN:-}" ]; then mkdir -p build && echo "$stamp" > "$STAMP_FILE"; fi
fi
echo "setup    done in $(( $(date +%s) - t0 )) s; stamp $stamp"
if [ -n "${SETUP_ONLY:-}${SETUP_DRY_RUN:-}" ]; then exit 0; fi

exec $PY -m torch.distributed.run --nproc-per-node "$NPROC" examples/pretrain_llama.py --out "$OUT" "$@"
