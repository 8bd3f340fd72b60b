#!/usr/bin/env bash
# Issues 27 and 36's GPU checks and figures in one run of about seven minutes, for a machine with a CUDA GPU and torch
# but without partialvfl installed (it runs from this checkout: PYTHONPATH=src) and without network access.
#
#   bash benchmarks/gpu_check.sh                    # on the GPU machine, from the repository root
#   bash benchmarks/gpu_check.sh --device cpu       # the dry run on a CPU: tiny sizes, the same steps
#
# Steps, each under `timeout` and within a total budget (GPU_CHECK_BUDGET seconds, default 450; a step that would
# start with too little left is skipped and says so), the issue's figures first:
#   1. the device tests, the accelerator tests, the concurrent-parties tests and the contract test on each device
#      (tests/test_devices.py, test_accelerator.py, test_gpus.py, test_concurrent_parties.py, test_contract.py -k
#      each_device);
#   2. operators per step, and the profiler's kernels per step, kernel time, GPU busy fraction and the host's waits
#      (syncs) beside the wall time (engine.py --only ops: FALSE-VFL-I's stage-1 step on the cpu-grid configuration,
#      the paper configuration's stage-1 and stage-2 steps), with the parties of a round answering concurrently (the
#      default on a GPU) and then one by one (--concurrent off);
#   3. the same for older checkouts' src/ (the before of a before/after on one GPU): BASELINE_SRC (one directory)
#      or every .baseline/*/src (ignored folders: `mkdir -p .baseline/389d8f5 && git archive 389d8f5 src | tar -x
#      -C .baseline/389d8f5`), in name order;
#   4. whole epochs of the FashionMNIST paper configuration (ResNet-18 parties): a fit of 3 stage-1 epochs and 1
#      stage-2 epoch, every epoch timed, the 150 + 200-epoch fit extrapolated from them, and the short fit's test
#      accuracy on 1,000 test images (engine.py --only paper-epochs), in fp32 and in bf16;
#   5. LASER-VFL's epoch (and the official code's beside it when LASER_OFFICIAL names a checkout of
#      github.com/Valdeira/LASER-VFL, by default .laser-official/, an ignored folder);
#   6. --precision bf16: step 2's figures at bf16.
# The end of the log repeats the headline figures in one table (benchmarks/gpu_summary.py): the issue's table (wall
# time, GPU kernels, kernel time and busy fraction per step) for each code measured, whole-epoch times, the paper fit
# extrapolated, fp32 against bf16 (time and accuracy), LASER-VFL against the official code.
#
# Everything printed also goes to $OUT/gpu.log, each JSON to $OUT/json/ (packed into $OUT/json.tgz at the end: a
# machine that returns few files). FashionMNIST is read from
# PARTIALVFL_FASHION_MNIST_DIR, /usr/share/datasets/fashion-mnist or .fashion-mnist/ (an ignored folder holding the
# four .gz files, for a machine without network); where none has it (or with --synthetic), the script writes
# SYNTHETIC files of the real shapes (60,000 + 10,000 random 28 x 28 images, 10 classes) and says so: step times do
# not depend on the pixel values, accuracies would mean nothing (none is quoted).
# Needs: python3 with torch, numpy, pandas, pyarrow, scikit-learn, tqdm, safetensors, grpcio, pytest (pytest-xdist
# and pytest-timeout if present). Not needed: cryptography, rbcl (no gRPC deployment runs here), ruff.
set -u -o pipefail

DEVICE=cuda
SYNTHETIC=0
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --synthetic) SYNTHETIC=1; shift ;;
    -h|--help) sed -n '2,36p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (use --device cpu|cuda, --synthetic)" >&2; exit 2 ;;
  esac
done
[ -f src/partialvfl/__init__.py ] || { echo "gpu_check.sh: run it from the repository root" >&2; exit 2; }

PY="${PYTHON:-python3}"
OUT="${OUT:-$(mktemp -d)}"
JSON="$OUT/json"
mkdir -p "$OUT" "$JSON"
WORK="$(mktemp -d)"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export TORCHINDUCTOR_CACHE_DIR="$WORK/inductor"   # empty: a --compile step below is a cold compile
export MPLBACKEND=Agg
exec > >(tee -a "$OUT/gpu.log") 2>&1
TEE_PID=$!
# at the end: the temporary folder goes, and the log is complete on disk before the script returns
trap 'rm -rf "$WORK"; tar -czf "$OUT/json.tgz" -C "$OUT" json && rm -rf "$JSON"; exec 1>&- 2>&-; wait "$TEE_PID" 2>/dev/null' EXIT

BUDGET="${GPU_CHECK_BUDGET:-450}"
START=$SECONDS
if [ "$DEVICE" = cpu ]; then  # the dry run: small sizes, and a CPU's pace (limits x 4; GPU_CHECK_BUDGET to change)
  DRY=1; QUICK=(--quick); REPEATS=2; SCALE=4; BUDGET="${GPU_CHECK_BUDGET:-1500}"
  # ResNet-18 parties at batch 1,024 are minutes per step on a CPU: the code path only, on a few images
  PAPER=(--paper-batch 32); EPOCHS=(--paper-batch 64 --paper-train 256 --paper-epochs 2 1 --paper-test 64)
  OPS_STEPS=2
else
  DRY=0; QUICK=(); REPEATS=3; SCALE=1; PAPER=(); EPOCHS=(--paper-epochs 3 1 --paper-test 1000); OPS_STEPS=5
fi
FAILED=()

# step NAME LIMIT_S COMMAND...: run COMMAND under `timeout`, at most LIMIT_S and what is left of the budget
step() {
  local name="$1" limit=$(($2 * SCALE)); shift 2
  local left=$((BUDGET - (SECONDS - START)))
  if [ "$left" -lt 25 ]; then
    echo "=== SKIPPED $name: ${left} s of the ${BUDGET} s budget left"; FAILED+=("$name (skipped)"); return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "=== $name (limit ${limit} s; $(date -u +%H:%M:%S) UTC; $((SECONDS - START)) s into the run)"
  echo "+ $*"
  local t0=$SECONDS rc=0
  timeout --kill-after=5 "$limit" "$@" || rc=$?
  echo "=== $name: exit $rc after $((SECONDS - t0)) s$([ "$rc" = 124 ] && echo ' (TIMED OUT)')"
  [ "$rc" = 0 ] || FAILED+=("$name (exit $rc)")
}

echo "=== gpu_check.sh --device $DEVICE: $(date -u) on $(uname -n); commit $(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo '?')"
step "environment" 30 "$PY" - "$DEVICE" <<'EOF'
import importlib, os, platform, sys
import torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| cpus", os.cpu_count(), "|", platform.processor() or platform.machine())
for name in ("numpy", "pandas", "pyarrow", "sklearn", "tqdm", "safetensors", "grpc", "pytest", "xdist",
             "pytest_timeout", "scipy", "cryptography", "rbcl"):
    try:
        m = importlib.import_module(name)
        print(f"  {name} {getattr(m, '__version__', '')}")
    except Exception as e:  # noqa: BLE001
        print(f"  {name}: MISSING ({type(e).__name__})")
if sys.argv[1] != "cpu":
    if not torch.cuda.is_available():
        sys.exit("torch sees no CUDA GPU: nothing to check here (use --device cpu for the dry run)")
    p = torch.cuda.get_device_properties(0)
    print(f"GPU {p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs, capability {p.major}.{p.minor}")
import partialvfl
print("partialvfl from", os.path.dirname(partialvfl.__file__))
EOF
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv

# FashionMNIST: the real files if this machine has them, else synthetic ones of the real shapes
FM="${PARTIALVFL_FASHION_MNIST_DIR:-/usr/share/datasets/fashion-mnist}"
[ ! -f "$FM/train-images-idx3-ubyte.gz" ] && [ -f .fashion-mnist/train-images-idx3-ubyte.gz ] && FM="$PWD/.fashion-mnist"
if [ "$SYNTHETIC" = 1 ] || [ ! -f "$FM/train-images-idx3-ubyte.gz" ]; then
  FM="$WORK/fashion-mnist-synthetic"
  echo "=== FashionMNIST: not on this machine (or --synthetic): writing SYNTHETIC files of the real shapes to $FM"
  echo "    (random uint8 images 60,000 + 10,000 x 28 x 28, labels 0-9, seed 0): timings are valid, accuracies not"
  "$PY" - "$FM" <<'EOF' || { echo "could not write the synthetic FashionMNIST"; exit 1; }
import gzip, struct, sys
from pathlib import Path
import numpy as np
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
rng = np.random.default_rng(0)
for split, n in (("train", 60000), ("t10k", 10000)):
    images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, size=n, dtype=np.uint8)
    for kind, arr in (("images-idx3", images), ("labels-idx1", labels)):
        header = struct.pack(">4B", 0, 0, 0x08, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape)
        with gzip.open(out / f"{split}-{kind}-ubyte.gz", "wb", compresslevel=1) as f:
            f.write(header + arr.tobytes())
print("written:", sorted(p.name for p in out.iterdir()))
EOF
  DATA_NOTE="SYNTHETIC FashionMNIST (random images of the real shapes)"
else
  DATA_NOTE="FashionMNIST from $FM"
fi
export PARTIALVFL_FASHION_MNIST_DIR="$FM"
echo "=== data: $DATA_NOTE"

# wheels in .whl/ (an ignored folder: packages this machine lacks, e.g. cryptography for the tests, fetched elsewhere
# with `pip download --only-binary=:all: --platform ... -d .whl NAME`) are installed into a temporary folder first
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:$WORK/site" && echo "=== installed from .whl/: $(cd .whl && ls | tr '\n' ' ')"
fi

# 1. tests: the device tests (their CUDA cases run where torch sees a GPU) and the contract on each device
XDIST=()
[ "$DRY" = 0 ] && "$PY" -c "import xdist" 2>/dev/null && XDIST=(-n 8)  # (a dry run: one process, a CPU is shared)
if [ "$DRY" = 1 ]; then  # the dry run: the CUDA cases and the accelerator tests (CUDA cases skip on a CPU)
  step "tests (cuda cases, accelerator, concurrent parties)" 120 "$PY" -m pytest -q -p no:cacheprovider -rfs \
    "${XDIST[@]}" tests/test_devices.py tests/test_contract.py tests/test_accelerator.py \
    tests/test_concurrent_parties.py -k "cuda or test_accelerator or concurrent"
else
  step "tests (device tests, accelerator, concurrent parties, contract on each device)" 100 "$PY" -m pytest -q \
    -p no:cacheprovider -rfs "${XDIST[@]}" tests/test_devices.py tests/test_accelerator.py tests/test_gpus.py \
    tests/test_concurrent_parties.py tests/test_contract.py -k "not test_contract or each_device"
fi

# 2. operators per step, and on a GPU the profiler's kernels, kernel time, busy fraction and host waits beside the
# wall time: the parties of a round concurrently (the default on a GPU), then one by one
step "ops and profile (parties concurrent)" 100 "$PY" benchmarks/engine.py --device "$DEVICE" "${QUICK[@]}" \
  --only ops --ops-steps "$OPS_STEPS" "${PAPER[@]}" --concurrent on --json "$JSON/ops-$DEVICE.json"
step "ops and profile (parties one by one)" 100 "$PY" benchmarks/engine.py --device "$DEVICE" "${QUICK[@]}" \
  --only ops --ops-steps "$OPS_STEPS" "${PAPER[@]}" --concurrent off --json "$JSON/ops-seq-$DEVICE.json"

# 3. step 2's figures for older code (the before of a before/after on this machine), where it is here
BASES=()
if [ -n "${BASELINE_SRC:-}" ]; then BASES=("$BASELINE_SRC"); else
  for d in .baseline/*/src .baseline/src; do [ -f "$d/partialvfl/__init__.py" ] && BASES+=("$d"); done
fi
[ ${#BASES[@]} = 0 ] && echo "=== no baseline checkout (BASELINE_SRC or .baseline/*/src): this code's figures only"
FIRST_BASE="${BASES[0]:-}"
if [ -n "$FIRST_BASE" ]; then  # the first baseline now; the others at the end, as time allows
  NAME="$(basename "$(dirname "$FIRST_BASE")")"
  step "ops and profile, baseline code $FIRST_BASE" 100 env PYTHONPATH="$(cd "$FIRST_BASE" && pwd)" "$PY" \
    benchmarks/engine.py --device "$DEVICE" "${QUICK[@]}" --only ops --ops-steps "$OPS_STEPS" "${PAPER[@]}" \
    --json "$JSON/ops-baseline-$NAME-$DEVICE.json"
fi

# 4. whole epochs of the paper configuration (a fit through the training loop), the paper fit extrapolated beside,
# the short fit's test accuracy; fp32, then bf16 (bf16 convolutions on a CPU without native bf16 are slow: the
# dry run's bf16 fit runs at batch 16)
step "paper-epochs fp32 (whole epochs)" 150 "$PY" benchmarks/engine.py --device "$DEVICE" --only paper-epochs \
  "${EPOCHS[@]}" --json "$JSON/paper-epochs-$DEVICE.json"
if [ "$DRY" = 1 ]; then BF16_EPOCHS=(--paper-batch 16 --paper-train 64 --paper-epochs 2 1 --paper-test 32); else
  BF16_EPOCHS=("${EPOCHS[@]}"); fi
step "paper-epochs bf16 (whole epochs)" 130 "$PY" benchmarks/engine.py --device "$DEVICE" --only paper-epochs \
  "${BF16_EPOCHS[@]}" --precision bf16 --json "$JSON/paper-epochs-bf16-$DEVICE.json"

# 5. LASER-VFL's epoch, ours and the official code's
LASER=()
[ -z "${LASER_OFFICIAL:-}" ] && [ -f .laser-official/methods/laser.py ] && LASER_OFFICIAL=.laser-official
if [ -n "${LASER_OFFICIAL:-}" ] && [ -f "$LASER_OFFICIAL/methods/laser.py" ]; then
  LASER=(--laser-official "$LASER_OFFICIAL")
else
  echo "=== no checkout of Valdeira/LASER-VFL (LASER_OFFICIAL or .laser-official/): ours only, no official epoch"
fi
step "engine: LASER-VFL epoch" $((${#LASER[@]} ? 75 : 45)) "$PY" benchmarks/engine.py --device "$DEVICE" \
  "${QUICK[@]}" --only laser --repeats "$REPEATS" "${LASER[@]}" --json "$JSON/engine-$DEVICE.json"

# 6. bf16: step 2's figures at --precision bf16 (the dry run's paper steps at batch 2)
if [ "$DRY" = 1 ]; then BF16=(--paper-batch 2); else BF16=(); fi
step "ops and profile, bf16" 80 "$PY" benchmarks/engine.py --device "$DEVICE" "${QUICK[@]}" --only ops \
  --ops-steps "$OPS_STEPS" "${BF16[@]}" --precision bf16 --json "$JSON/ops-bf16-$DEVICE.json"

# 7. as time allows: the other baselines
for BASE in "${BASES[@]:1}"; do
  NAME="$(basename "$(dirname "$BASE")")"
  step "ops and profile, baseline code $BASE" 100 env PYTHONPATH="$(cd "$BASE" && pwd)" "$PY" benchmarks/engine.py \
    --device "$DEVICE" "${QUICK[@]}" --only ops --ops-steps "$OPS_STEPS" "${PAPER[@]}" \
    --json "$JSON/ops-baseline-$NAME-$DEVICE.json"
done

# the headline figures in one table (from the JSON files above; a missing file: the step failed or was skipped)
"$PY" benchmarks/gpu_summary.py "$JSON" "$DEVICE" || echo "=== (no summary: exit $?)"

echo "=== done in $((SECONDS - START)) s ($DATA_NOTE); files in $JSON (packed into json.tgz): $(cd "$JSON" && ls | tr '\n' ' ')"
if [ ${#FAILED[@]} -gt 0 ]; then
  printf '=== NOT OK: %s\n' "${FAILED[@]}"
  exit 1
fi
echo "=== all steps OK"
