#!/usr/bin/env bash
# Everything a lent GPU is for, in one call of under 10 minutes: build the CUDA extension, run the
# GPU tests (the stream protocol with widened windows, no host sync, parity), the kernel benchmark,
# the world-1 step benchmark against FSDP2/FSDP1/DDP on a ~1B Llama and of the reduce precisions, the
# fake-process-group memory run of large worlds, the overlap trace, and activation checkpointing chosen by
# the plan. Every table lands in benchmarks/results/ as <what>_<gpu>_<date>.md (and, where $OUT is set, a
# copy under it), with the commands and versions.
#
#   bash benchmarks/gpu_suite.sh             # on the GPU machine (torch with CUDA; no package registry needed)
#   bash benchmarks/gpu_suite.sh --dry-run   # print every step and run none (CI runs this so it does not rot)
#
# Needs on the machine: python3 with torch (CUDA), transformers, pytest, ninja, nvcc. Each step has its
# own time limit; a failing step is reported and the suite goes on, and the exit status says whether all passed.
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=0
for a in "$@"; do
  case "$a" in
    --dry-run) DRY=1 ;;
    *) echo "gpu_suite.sh: unknown argument $a (use --dry-run or nothing)" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
DATE=$(date -u +%F)
if [ "$DRY" = 1 ]; then
  GPU=dryrun
else
  GPU=$($PY -c "import torch; n = torch.cuda.get_device_name(0).lower(); print('h200' if 'h200' in n else 'h100' if 'h100' in n else n.split()[-1])") || {
    echo "gpu_suite.sh: no CUDA device visible to $PY" >&2; exit 2; }
fi
RES=benchmarks/results
LOG=runs/gpu_suite_${GPU}_${DATE}.log
mkdir -p runs "$RES"
FAILED=()

step() {  # step NAME LIMIT_S COMMAND... : run it with a time limit, log it, remember a failure
  local name=$1 limit=$2
  shift 2
  echo "=== $name: $*" | tee -a "$LOG"
  if [ "$DRY" = 1 ]; then return 0; fi
  local t0=$SECONDS
  if timeout "$limit" "$@" 2>&1 | tee -a "$LOG"; then
    echo "=== $name: ok in $((SECONDS - t0)) s" | tee -a "$LOG"
  else
    echo "=== $name: FAILED (status ${PIPESTATUS[0]}) after $((SECONDS - t0)) s" | tee -a "$LOG"
    FAILED+=("$name")
  fi
}

export PYTHONUNBUFFERED=1
step versions 60 $PY -c "import torch, sys; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda, '|', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')"
# The extension, CUDA kernels included (YAFSDP_FORCE_CUDA: fail instead of quietly skipping them).
step build 240 env YAFSDP_FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST="9.0" MAX_JOBS=16 $PY setup.py build_ext --inplace
step kernels-check 60 $PY -c "import yafsdp.kernels as k; print(k.describe()); assert k.backend('cuda') == 'extension', k.fallback_reason('cuda')"
step gpu-tests 240 env YAFSDP_REQUIRE_EXT=1 $PY -m pytest -q -p no:cacheprovider -m gpu tests -x
step kernel-bench 60 $PY benchmarks/bench_optimizer.py --device cuda --numel 100000000 --rounds 10 \
  --md "$RES/optimizer_${GPU}_${DATE}.md"
step step-bench 180 $PY -m torch.distributed.run --nproc-per-node 1 benchmarks/bench_step.py --device cuda \
  --preset llama3-1b --batch 2 --seq 2048 --steps 8 --rounds 2 --md "$RES/bench_step_${GPU}_${DATE}.md"
# fp32, bf16 and bf16-summed-in-fp32 reduces (docs/reduce.md): step time, peak, and reduce bytes per step.
# World 1: the NCCL all-to-all and the fp32 fold run, but nothing crosses a link; the bytes column is the
# engine's count of each reduce's input, which is what a larger world sends ((world - 1) / world of it).
step reduce-bench 120 $PY -m torch.distributed.run --nproc-per-node 1 benchmarks/bench_step.py --device cuda \
  --preset llama3-1b --batch 2 --seq 2048 --engines yafsdp-z3,yafsdp-z3+bf16reduce,yafsdp-z3+bf16reduce+fp32acc \
  --steps 6 --rounds 1 --mem-steps 2 --md "$RES/bench_reduce_${GPU}_${DATE}.md"
step fake-world-memory 120 $PY benchmarks/bench_step.py --fake-world 8,64,256 --device cuda --preset llama3-8b \
  --batch 1 --seq 4096 --md "$RES/bench_step_fakeworld_${GPU}_${DATE}.md"
step overlap 120 $PY -m torch.distributed.run --nproc-per-node 1 benchmarks/bench_overlap.py --device cuda \
  --preset llama3-1b --batch 2 --seq 2048 --png "$RES/overlap_${GPU}_${DATE}.png" --md "$RES/overlap_${GPU}_${DATE}.md"
# Activation checkpointing chosen by the plan: predicted vs measured peak, and step time of the auto
# choice against every block and no block checkpointed, at budgets between the two (world 1, bf16).
step ckpt-auto 300 $PY benchmarks/bench_ckpt_auto.py --device cuda --preset llama3-1b --vocab 0 --batch 2 \
  --seq 2048 --bf16 --points 5 --steps 3 --rounds 2 --md "$RES/ckpt_auto_${GPU}_${DATE}.md" \
  --png "$RES/ckpt_auto_${GPU}_${DATE}.png"

if [ "$DRY" = 0 ] && [ -n "${OUT:-}" ]; then
  cp "$LOG" "$RES"/*_"${GPU}"_"${DATE}".* "$OUT"/ 2>/dev/null || true
fi
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "gpu_suite.sh: failed steps: ${FAILED[*]} (log: $LOG)"
  exit 1
fi
echo "gpu_suite.sh: all steps passed (log: $LOG)"
