#!/usr/bin/env bash
# The float guard (issue 33): run the float-sensitive tests (marked `float_sensitive`) a second time as if on
# another processor, so that a test which holds only on the processor it was written on fails here.
#   - the instruction set one level below this CPU's for ATen's kernels (AVX-512 -> AVX2, AVX2 -> default),
#     oneDNN capped at SSE4.1, MKL on its "compatible" code path (a row of a product then rounds by its position);
#   - tests/float_guard/sitecustomize.py: every matrix product moved by 1-4 ulps fixed by its shape (what MKL does
#     on an AVX-512 Intel CPU and no switch reproduces on an AVX2 one; that file says why).
# Usage: bash scripts/float_guard.sh [pytest args]   (the float_sensitive tests; add -m "" to run any other test,
#        or every test, under the guard: scripts/float_guard.sh -m "" tests/test_x.py)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
native=$("$PY" -c 'import torch; print(torch.backends.cpu.get_cpu_capability())')
case "$native" in
  AVX512*) lower=avx2 ;;
  *) lower=default ;;
esac
echo "float guard: ATen $native -> $lower, MKL_CBWR=COMPATIBLE, ONEDNN_MAX_CPU_ISA=SSE41, shape-dependent ulps in every matrix product"
export ATEN_CPU_CAPABILITY=$lower MKL_CBWR=COMPATIBLE ONEDNN_MAX_CPU_ISA=SSE41 PARTIALVFL_FLOAT_GUARD=1
export PYTHONPATH="$PWD/tests/float_guard${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m pytest -q -p no:cacheprovider -m float_sensitive "$@"
