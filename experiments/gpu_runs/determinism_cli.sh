#!/bin/bash
# config.deterministic through noloco-train (no XLA_FLAGS given): two default runs and one with it off.
# Setup (comment added after the run): _gpu46/ in the repo root holds train.npy and validation.npy
# (the token files of gpu_main_command_h100.md) and, for the A/B, old/ = `git archive 937422e
# noloco_jax configs`; .whl/ the wheels the GPU image lacks. Results: experiments/results/gpu_determinism_h100.md
set -u
ROOT=$PWD; G=$ROOT/_gpu46; SITE=/tmp/site; O=${OUT:-/tmp/out46c}; mkdir -p $O; L=$O/log.txt
PY=${PY:-python3}; STEPS=${STEPS:-300}; LIM=${LIM:-80}
python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE .whl/*.whl >> $L 2>&1
Q="--config=configs/tiny_dp.py --config.data.source=tokens --config.data.path=$G --noprogress --config.num_steps=$STEPS --config.log_every=25 --config.eval_every=$STEPS --config.checkpoint_every=$STEPS --config.model.preset=${PRESET:-mini} --config.global_batch_size=${GB:-128}"
BF="--config.model.param_dtype=bfloat16 --config.model.dtype=bfloat16"
run() { name=$1; flags=$2; shift 2; s=$SECONDS; rm -rf /tmp/w_$name
  timeout $LIM env PYTHONPATH=$SITE:$ROOT $PY -m noloco_jax.train $Q "$@" --workdir=/tmp/w_$name > /tmp/$name.log 2>&1
  echo "== $name rc=$? $((SECONDS-s)) s" >> $L; cp /tmp/w_$name/metrics.jsonl $O/$name.jsonl 2>/dev/null; }

run f32_det1 "" ; run f32_det2 "" ; run f32_nodet "" --config.deterministic=False
$PY - "$O" >> $L 2>&1 <<'PY'
import json, sys, glob, statistics, os
for f in sorted(glob.glob(sys.argv[1] + "/*.jsonl")):
    rows = [json.loads(l) for l in open(f)]
    tps = [r["tokens_per_sec"] for r in rows if "tokens_per_sec" in r and r.get("step", 0) > 100]
    ev = [r for r in rows if "val_ppl" in r]
    tl = [r["train_loss"] for r in rows if "train_loss" in r]
    print(os.path.basename(f), "median tok/s %.0f" % statistics.median(tps), "train_loss", tl[:2], tl[-1],
          "val_ppl %.6f" % ev[-1]["val_ppl"])
PY
cat $L
