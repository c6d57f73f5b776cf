#!/usr/bin/env bash
# The one prepared script a GPU machine runs: every CUDA path of the engine (docs/testing.md, "GPU suite",
# has the table of paths and the check covering each), in two parts that each fit one device call
# and together fit 15 minutes of a GPU machine, its start included:
#
#   bash benchmarks/gpu_suite.sh part1    # build the CUDA extension, every test marked `gpu`     (<= 400 s)
#   bash benchmarks/gpu_suite.sh part2    # the benchmarks: step time and memory against FSDP2/DDP,
#                                         # the reduce precisions, fake-world memory, auto checkpointing,
#                                         # the kernels' launch shapes and bandwidth (<= 320 s)
#   bash benchmarks/gpu_suite.sh all      # both, one after the other
#   bash benchmarks/gpu_suite.sh multigpu # a machine with several GPUs: the tests marked `multigpu` (NCCL
#                                         # across devices: grad_quant, secondary_shard, TP x dp at world 4; HSDP x TP at 8)
#                                         # (<= 400 s; on fewer than 2 GPUs it prints why and exits 0)
#   bash benchmarks/gpu_suite.sh part1 --dry-run   # print every step with its time limit, run none
#
# Results go to $OUT (the device tool's output folder) or, where it is unset, benchmarks/results/gpu_<date>/:
# <part>.log (everything printed), <part>_summary.md (the command, the versions, each check's status and
# time), versions.txt, the pytest report (gpu_tests.xml) and each benchmark's table (.md / .json / .png).
# A failing or timed-out check is reported and the part goes on; the exit status is 1 when any failed.
# Each step's limit is its own or what is left of its part's, whichever is smaller; a step with under
# 10 s left is reported as not run. part2 builds the extension again only when part1's build is gone
# (a fresh machine): then its benchmarks get less time.
#
# Needs on the machine: python3 with torch (CUDA), transformers, pytest; nvcc (and ninja, else the
# build is serial and slow). No package registry. tests/gpu/test_gpu_suite.py checks this file on the CPU.
set -uo pipefail
cd "$(dirname "$0")/.."

PART=""
DRY=0
for a in "$@"; do
  case "$a" in
    --dry-run) DRY=1 ;;
    part1|part2|all|multigpu) PART=$a ;;
    *) echo "gpu_suite.sh: unknown argument $a (use part1, part2, all or multigpu, and optionally --dry-run)" >&2
       exit 2 ;;
  esac
done
if [ -z "$PART" ]; then
  echo "gpu_suite.sh: name a part: part1, part2, all or multigpu (see the header of $0)" >&2
  exit 2
fi

PY=${PYTHON:-$(command -v python3 || command -v python)}
DATE=$(date -u +%F)
RES=${OUT:-benchmarks/results/gpu_${DATE}}
# The multigpu part needs NCCL across devices: on fewer than two GPUs it has nothing to run (each of its tests
# names the count it needs and is skipped below it), so it says so and succeeds without touching the results.
if [ "$PART" = multigpu ] && [ "$DRY" = 0 ]; then
  NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
  if [ "$NGPU" -lt 2 ]; then
    echo "gpu_suite.sh multigpu: skipped: $NGPU GPU(s) listed by nvidia-smi -L; its tests run NCCL across devices" \
      "and need 4 (NCCL refuses two ranks on one device)"
    exit 0
  fi
fi
if [ "$DRY" = 1 ]; then
  GPU=dryrun
else
  mkdir -p "$RES"
  GPU=$($PY -c "import torch; n = torch.cuda.get_device_name(0).lower(); print('h200' if 'h200' in n else 'h100' if 'h100' in n else n.split()[-1])") || {
    echo "gpu_suite.sh: no CUDA device visible to $PY" >&2; exit 2; }
fi
# Part time limits (seconds). Their sum plus the machine's start (~150 s) stays under 900 s (15 minutes):
# tests/gpu/test_gpu_suite.py checks it, and that the steps of each part fit it.
declare -A PART_LIMIT=([part1]=400 [part2]=350 [multigpu]=400)
# With less time on the machine a part can be shortened: PART_LIMIT_S=250 bash benchmarks/gpu_suite.sh part2
# (its later steps are then reported as not run, and the summary is still written).
if [ -n "${PART_LIMIT_S:-}" ] && [ "$PART" != all ]; then PART_LIMIT[$PART]=$PART_LIMIT_S; fi
MIN_STEP_S=10

# The test files that hold `gpu` tests, found rather than listed (the tests may move between folders); the
# engine's (test_gpu.py) first and the benchmarks' smoke runs last, so a part that runs out of time loses the least.
GPU_TESTS=$(grep -rlE --include='test_*.py' 'pytest\.mark\.gpu' tests \
  | awk '{ print (/test_gpu\.py$/ ? 0 : /test_bench_smoke\.py$/ ? 2 : 1), $0 }' | sort -k1,1n -k2 | cut -d' ' -f2 \
  | tr '\n' ' ')
# The files with tests that need several GPUs (marked `multigpu`), for the multigpu part.
MULTIGPU_TESTS=$(grep -rlE --include='test_*.py' 'pytest\.mark\.multigpu' tests | sort | tr '\n' ' ')

STATUS=()   # "name|status|seconds" per step of the part being run
FAILED=()

step() {  # step NAME LIMIT_S COMMAND... : run it under min(LIMIT_S, what is left of the part), log it, record it
  local name=$1 limit=$2
  shift 2
  local shown
  shown=$(printf '%s ' "$@" | tr '\n' ' ')  # one line (the versions step's Python is several)
  if [ "$DRY" = 1 ]; then echo "=== $name [limit $limit s]: $shown"; return 0; fi
  local left=$((PART_END - SECONDS))
  [ "$limit" -gt "$left" ] && limit=$left
  echo "=== $name [limit $limit s]: $shown" | tee -a "$LOG"
  if [ "$left" -lt "$MIN_STEP_S" ]; then
    echo "=== $name: NOT RUN (the part's time is spent)" | tee -a "$LOG"
    STATUS+=("$name|NOT RUN (the part's time is spent)|0"); FAILED+=("$name"); return 0
  fi
  local t0=$SECONDS rc why
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  if [ "$rc" = 0 ]; then
    echo "=== $name: ok in $((SECONDS - t0)) s" | tee -a "$LOG"
    STATUS+=("$name|pass|$((SECONDS - t0))")
  else
    why="FAILED (status $rc)"
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then why="FAILED (timed out after $limit s)"; fi
    echo "=== $name: $why after $((SECONDS - t0)) s" | tee -a "$LOG"
    STATUS+=("$name|$why|$((SECONDS - t0))"); FAILED+=("$name")
  fi
}

VERSIONS_PY="import os, shutil, subprocess, sys, torch
print('python', sys.version.split()[0]); print('torch', torch.__version__, '| CUDA', torch.version.cuda)
print('gpu', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none',
      '| capability', torch.cuda.get_device_capability(0) if torch.cuda.is_available() else None,
      '| NCCL', torch.cuda.nccl.version() if torch.cuda.is_available() else None)
for m in ('transformers', 'peft', 'pytest', 'numpy'):
    try: print(m, __import__(m).__version__)
    except Exception as e: print(m, 'missing:', type(e).__name__)
print('nvcc', shutil.which('nvcc') or 'missing', '| ninja', shutil.which('ninja') or 'missing (serial build)')
import yafsdp.comm.collectives as c  # torch 2.11 has only the *_tensor forms; 2.13 the *_single ones
print('collectives', c._all_gather.__name__, c._reduce_scatter.__name__)
git = shutil.which('git') and subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True)
print('git', (git.stdout.strip() if git else '') or '? (not a git checkout here)')"

# The extension with its CUDA kernels (YAFSDP_FORCE_CUDA: fail instead of quietly skipping them). The CPU
# extension of this Python is built too (the tree's copy may be for another Python).
BUILD=(env YAFSDP_FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST="9.0" MAX_JOBS=16 "$PY" setup.py build_ext --inplace)
HAVE_CUDA_EXT="import yafsdp.kernels as k; print(k.describe()); assert k.backend('cuda') == 'extension', k.fallback_reason('cuda')"

run_part1() {
  step build 80 "${BUILD[@]}"
  step kernels-check 20 "$PY" -c "$HAVE_CUDA_EXT"
  # Every test marked gpu: kernels against their twins bit for bit, the NCCL engine at world 1 with the
  # stream windows widened, offload, the narrow reduce, int8/fp8/NF4 gathers, GradScaler, async saves,
  # auto checkpointing, the benchmarks' smoke runs. -v: each test's outcome is in the log as it happens.
  # shellcheck disable=SC2086
  step gpu-tests 280 env YAFSDP_REQUIRE_EXT=1 "$PY" -m pytest -v -rfEs -p no:cacheprovider -m gpu \
    --junitxml="$RES/gpu_tests.xml" $GPU_TESTS
}

run_part2() {
  # A fresh machine (part1 ran elsewhere): build again, else the benchmarks would time the twins.
  if [ "$DRY" = 0 ] && "$PY" -c "$HAVE_CUDA_EXT" >/dev/null 2>&1; then
    echo "=== build-if-missing: part1's build is here" | tee -a "$LOG"
  else  # (its time is not counted in the part's limit: on a fresh machine the benchmarks get less)
    step build-if-missing 200 "${BUILD[@]}"
  fi
  # Peak memory per rank against FSDP2 with the CUDA caching allocator (allocated and reserved), emulated
  # worlds 8 and 64 at Llama-3.2-1B shapes (the memory goal's setup, docs/reduce.md: 2 layers, batch 1 x 256, bf16 on GPU).
  step fake-world-memory 30 "$PY" benchmarks/bench_step.py --fake-world 8,64 --device cuda --preset llama3-1b \
    --layers 2 --batch 1 --seq 256 --md "$RES/bench_step_fakeworld_${GPU}_${DATE}.md" \
    --json "$RES/bench_step_fakeworld_${GPU}_${DATE}.json"
  # World 1 peak memory (allocated and reserved) against plain PyTorch and FSDP2, fp32 and bf16 full fine-tunes,
  # bf16 LoRA and QLoRA at Llama-3.2-1B shapes (2 layers), with the grad shards allocated in backward and freed by
  # zero_grad and the weight buffers held in use only (docs/benchmarks.md section 8): the fake process group of one
  # rank, as on the CPU. QLoRA's plain row needs torchao (here or in ./.torchao); without it the row says so.
  step world1-memory 30 "$PY" benchmarks/bench_world1.py --device cuda --preset llama3-1b --layers 2 --batch 2 \
    --seq 1024 --configs fp32-full,bf16-full,bf16-lora,bf16-qlora --md "$RES/world1_${GPU}_${DATE}.md"
  # World 1 under NCCL, a ~1B Llama in bf16: step time and peak (allocated, reserved) against FSDP2 and DDP,
  # and the reduce precisions (docs/reduce.md): fp32, bf16 summed in bf16, bf16 summed in fp32 (the all-to-all
  # and the fp32 fold run; nothing crosses a link at world 1: the bytes column is each reduce's input).
  # Two rounds: with one, the engine measured first ran 1.09x DDP on 2026-11-27 and 1.00x in a three-round rerun.
  step step-bench 75 "$PY" -m torch.distributed.run --nproc-per-node 1 benchmarks/bench_step.py --device cuda \
    --preset llama3-1b --batch 2 --seq 2048 \
    --engines yafsdp-z3,yafsdp-z3+FusedAdamW,yafsdp-z3+bf16reduce,yafsdp-z3+bf16reduce+fp32acc,fsdp2,ddp \
    --warmup 2 --steps 5 --rounds 2 --mem-steps 2 --md "$RES/bench_step_${GPU}_${DATE}.md" \
    --json "$RES/bench_step_${GPU}_${DATE}.json"
  # Where each engine's step goes: forward, backward and optimizer against DDP's (synchronised at each mark).
  step step-phases 70 "$PY" -m torch.distributed.run --nproc-per-node 1 benchmarks/bench_step.py --device cuda \
    --preset llama3-1b --batch 2 --seq 2048 --engines yafsdp-z3,fsdp2,ddp --phases \
    --warmup 2 --steps 5 --rounds 2 --mem-steps 0 --md "$RES/bench_step_phases_${GPU}_${DATE}.md" \
    --json "$RES/bench_step_phases_${GPU}_${DATE}.json"
  # Is communication hidden at world 1? The two-lane timeline (bench_overlap.py) for yafsdp and FSDP2 under NCCL:
  # with one rank the collectives are copies, so this measures what the engine's comm stream and its events cost
  # a single GPU (the exposed fraction should be near zero), not overlap across a link.
  step overlap-world1 25 "$PY" -m torch.distributed.run --nproc-per-node 1 benchmarks/bench_overlap.py --device cuda \
    --preset llama3-1b --layers 8 --batch 2 --seq 2048 --steps 3 --trace-dir '' \
    --png "$RES/overlap_${GPU}_${DATE}.png" --md "$RES/overlap_${GPU}_${DATE}.md" --json "$RES/overlap_${GPU}_${DATE}.json"
  # Activation checkpointing chosen by the plan at world 1 with the GPU's budgets: predicted vs measured
  # peak, step time of each choice against every block and no block checkpointed (20-27 s on 2026-11-26/27).
  step ckpt-auto 35 "$PY" benchmarks/bench_ckpt_auto.py --device cuda --preset llama3-1b --vocab 0 --batch 2 \
    --seq 2048 --bf16 --points 3 --steps 3 --rounds 2 --md "$RES/ckpt_auto_${GPU}_${DATE}.md" \
    --png "$RES/ckpt_auto_${GPU}_${DATE}.png"
  # The cast and AdamW kernels alone (no torch) in ten launch shapes and as FusedAdamW calls them: what the
  # kernel-bench figures below lose outside the kernel (docs/kernels.md, "Benchmark").
  step launch-shapes 15 bash -c "set -o pipefail; nvcc -std=c++17 -O3 -arch=sm_90 -Icsrc -o /tmp/launch_shapes \
    benchmarks/cuda_launch_shapes.cu && /tmp/launch_shapes | tee '$RES/launch_shapes_${GPU}_${DATE}.txt'"
  # FusedAdamW's CUDA kernel against torch's AdamW (foreach, fused) and the copy bandwidth.
  step kernel-bench 20 "$PY" benchmarks/bench_optimizer.py --device cuda --numel 100000000 --rounds 5 \
    --md "$RES/optimizer_${GPU}_${DATE}.md"
  # torchtitan's own Trainer with yafsdp as its parallelize_fn (docs/frameworks.md, "torchtitan"): the llama3
  # debug model, varlen attention, 5 steps at world 1 under NCCL. Needs torchtitan==0.3.0 and its Trainer's
  # imports (tensorboard, torchdata, torch_checkpointing, einops) on the machine, and a torchtitan checkout's
  # tests/assets (its tokenizer and c4_test data) in TORCHTITAN_DIR: it fails saying so where they are missing.
  local tt_out
  tt_out=$(cd "$RES" 2>/dev/null && pwd || echo "$RES")  # absolute: the step runs in the checkout
  step torchtitan-trainer 30 bash -c "set -eo pipefail; test -d \"\${TORCHTITAN_DIR:-}/tests/assets/c4_test\" || {
    echo 'torchtitan-trainer: set TORCHTITAN_DIR to a torchtitan v0.3.0 checkout (its tests/assets)' >&2; exit 3; }
    cd \"\$TORCHTITAN_DIR\" && '$PY' -m torch.distributed.run --nproc-per-node 1 -m torchtitan.train \
    --module yafsdp.integrations.torchtitan --config llama3_debugmodel_varlen_attn --training.steps 5 \
    --training.seq_len 512 --training.local_batch_size 2 --dump_folder '$tt_out/torchtitan' 2>&1 \
    | tee '$tt_out/torchtitan_trainer_${GPU}_${DATE}.log'"
}

run_multigpu() {
  # NCCL across devices, world 4 (docs/testing.md, "GPU suite"): the quantized reduce-scatter with its node stage
  # in place and the replicas' quantized all-reduce; the engine with grad_quant (int8, fp8) and with
  # secondary_shard=2; HSDP 2 x 2's asynchronous save resumed; dp 2 x tp 2 (and on 8 GPUs replicate 2 x shard 2 x tp 2) against the TP model alone. Each test is skipped below the GPUs it needs.
  # The extension is built first where it is missing (its own machine: part1 normally has not run there), so
  # the fp8 records go through the CUDA kernels as in training.
  if [ "$DRY" = 0 ] && "$PY" -c "$HAVE_CUDA_EXT" >/dev/null 2>&1; then
    echo "=== build-if-missing: the CUDA extension is here" | tee -a "$LOG"
  else
    step build-if-missing 80 "${BUILD[@]}"
  fi
  # shellcheck disable=SC2086
  step multigpu-tests 300 "$PY" -m pytest -v -rfEs -p no:cacheprovider -m multigpu \
    --junitxml="$RES/gpu_tests_multigpu.xml" $MULTIGPU_TESTS
}

summary() {  # summary PART: <part>_summary.md with the command, the versions and each step's status
  local part=$1 f="$RES/${part}_summary.md"
  {
    echo "# gpu_suite.sh $part, $(date -u '+%F %H:%M UTC')"
    echo
    echo "Command: \`bash benchmarks/gpu_suite.sh $part\` (results in \`$RES\`; log \`$(basename "$LOG")\`)"
    echo
    echo '```'
    cat "$RES/versions.txt"
    echo '```'
    echo
    echo "| check | status | seconds |"
    echo "|---|---|---|"
    for s in "${STATUS[@]}"; do IFS='|' read -r n st t <<<"$s"; echo "| $n | $st | $t |"; done
    local xml="$RES/gpu_tests.xml"
    [ "$part" = multigpu ] && xml="$RES/gpu_tests_multigpu.xml"
    if [ -f "$xml" ] && { [ "$part" = part1 ] || [ "$part" = multigpu ]; }; then
      echo
      "$PY" - "$xml" <<'PYEOF'
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
rows = []
for tc in root.iter("testcase"):
    kids = {c.tag for c in tc}
    st = "FAILED" if kids & {"failure", "error"} else "skipped" if "skipped" in kids else "pass"
    rows.append(f"| {tc.get('classname')}::{tc.get('name')} | {st} | {float(tc.get('time') or 0):.1f} |")
print("| gpu test | status | seconds |\n|---|---|---|\n" + "\n".join(rows))
PYEOF
    fi
  } > "$f"
  echo "gpu_suite.sh: summary in $f"
}

run() {  # run PART
  local part=$1
  LOG=$RES/${part}.log
  PART_END=$((SECONDS + PART_LIMIT[$part]))
  STATUS=()
  if [ "$DRY" = 1 ]; then
    echo "=== part $part [limit ${PART_LIMIT[$part]} s]"
    step versions 20 "$PY" -c "$VERSIONS_PY"
    "run_$part"
    return 0
  fi
  echo "=== part $part [limit ${PART_LIMIT[$part]} s]: results in $RES" | tee -a "$LOG"
  export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  step versions 20 "$PY" -c "$VERSIONS_PY"
  sed -n '/^=== versions \[/,/^=== versions: /p' "$LOG" | sed '1d;$d' > "$RES/versions.txt"
  "run_$part"
  summary "$part"
}

if [ "$PART" = all ]; then run part1; run part2; else run "$PART"; fi

if [ "$DRY" = 1 ]; then exit 0; fi
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "gpu_suite.sh: failed: ${FAILED[*]} (logs and summaries in $RES)"
  exit 1
fi
echo "gpu_suite.sh: every check passed (logs and summaries in $RES)"
