#!/usr/bin/env bash
# The GPU machine's check of a change to the kernels: build, every test (GPU
# ones included), compute-sanitizer on a small case, the kernel benchmark and
# the default inference job. Logs and CSVs go to $OUT (or ./results).
#
#   bash scripts/gpu_check.sh            # tests, sanitizers, benchmarks (about 8-10 minutes on an H100)
#   bash scripts/gpu_check.sh tests      # build, tests and sanitizers only
#   bash scripts/gpu_check.sh bench      # kernel benchmark and inference only
#   bash scripts/gpu_check.sh hostfree   # captured / compiled GT inference and training
#                                        # against pyg eager and compiled (about 6 minutes)
#
# Needs the structures of ../shared/data; on a copy of the tree without them,
# put them in .data/ (GT_FUSED3S_DATA may point elsewhere).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD GT_FUSED3S_BUILD_DIR=${GT_FUSED3S_BUILD_DIR:-/tmp/gt_fused3s_build}
what=${1:-all}
status=0

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, torch_geometric; print('torch', torch.__version__, 'pyg', torch_geometric.__version__)"
python3 -c "from gt_fused3s._build import load_extension; load_extension(); print('extension built')" || exit 1

if [ "$what" = hostfree ]; then
  python3 -m gt_fused3s.cli infer --config configs/study.yaml --datasets zinc molhiv --hidden 64 \
    --backends fused3s pyg --csv "$OUT/infer_batched.csv" --no-progress 2>&1 | tee "$OUT/infer_batched.txt" || status=1
  for cfg in train train-zinc1024; do
    python3 -m gt_fused3s.cli train --config "configs/$cfg.yaml" --csv "$OUT/$cfg.csv" --no-progress 2>&1 \
      | tee "$OUT/$cfg.txt" || status=1
  done
  exit $status
fi
if [ "$what" != bench ]; then
  python3 -m pytest -q -rfEs 2>&1 | tee "$OUT/tests.txt" | tail -3 || status=1
  S='from gt_fused3s.bench.kernel import sanitize_case; sanitize_case()'
  for tool in memcheck racecheck; do
    echo "compute-sanitizer --tool $tool (sanitize_case)"
    compute-sanitizer --tool "$tool" python3 -c "$S" 2>&1 | tee "$OUT/sanitizer_$tool.txt" | tail -2
  done
fi
if [ "$what" != tests ]; then
  python3 scripts/bench_kernel.py --out "$OUT/bench.csv" 2>&1 | tee "$OUT/bench_log.txt" \
    | grep -v '^\[graph\]\|^\[.*\] fused3s' || status=1
  python3 -m gt_fused3s.cli infer --config configs/default.yaml --csv "$OUT/infer_default.csv" \
    --backends fused3s pyg reference dense \
    --no-progress 2>&1 | tee "$OUT/infer_default.txt" || status=1
fi
exit $status
