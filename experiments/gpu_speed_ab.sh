#!/bin/bash
# Speed of this checkout against an older commit on one GPU, each in its own process, in the
# order new, old, new (the second new run shows the run-to-run drift). From the repo root:
#   git archive b1bcfc9 | (mkdir -p _old && tar -x -C _old)   # the old tree, beside the checkout
#   OUT=DIR bash experiments/gpu_speed_ab.sh
# OLD (default _old) is the old tree; a .whl folder of wheels the GPU image lacks (ml-collections,
# tensorboardX), if there, is installed first. experiments.bench.gpu writes bench_gpu.json for
# each run (copied to DIR as gpu_new1/gpu_old/gpu_new2.json), and experiments.bench.throughput at
# a GPU-sized step (paper-small, 8 x 1024 tokens, bf16) runs between the old and the second new.
set -u
: "${OUT:?set OUT to a folder for the results}"
export PYTHONUNBUFFERED=1
ROOT=$PWD; OLD=$(cd "${OLD:-_old}" && pwd); L=$OUT/log.txt; R=$(mktemp -d); SITE=$R/site
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl || exit 3
fi
python3 -c "import jax, flax; print(jax.__version__, flax.__version__, jax.devices())" >> "$L" 2>&1
step() { name=$1; lim=$2; shift 2; s=$SECONDS; echo "== $name start t=$s" >> "$L"
  timeout "$lim" "$@" >> "$L" 2>&1; echo "== $name rc=$? took $((SECONDS - s)) s" >> "$L"; }
new() { cd "$ROOT" && step "$1" 200 env PYTHONPATH="$SITE:$ROOT" python3 -m experiments.bench.gpu --out_dir="$R/$1"
  cp "$R/$1/bench_gpu.json" "$OUT/gpu_$1.json"; }
new new1
# b1bcfc9's gpu.py is a script with argparse flags; later ones run as a module.
if [ -f "$OLD/experiments/bench/__init__.py" ]; then
  cd "$OLD" && step old 200 env PYTHONPATH="$SITE:$OLD" python3 -m experiments.bench.gpu --out_dir="$R/old"
else
  cd "$OLD" && step old 200 env PYTHONPATH="$SITE:$OLD" python3 experiments/bench/gpu.py --out-dir="$R/old"
fi
cp "$R/old/bench_gpu.json" "$OUT/gpu_old.json"
cd "$ROOT" && step thr 140 env PYTHONPATH="$SITE:$ROOT" python3 -m experiments.bench.throughput \
  --case small,8,1024,10,7 --dtype bfloat16 --out_dir="$R/thr"
cp "$R"/thr/*.json "$OUT/"
new new2
echo "== done t=$SECONDS" >> "$L"
