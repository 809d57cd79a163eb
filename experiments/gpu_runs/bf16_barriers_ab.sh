#!/bin/bash
# bf16-weight training speed, this tree vs 937422e (before the bf16 rounding barriers), new/old/new.
# Setup (comment added after the run): _gpu46/ in the repo root holds train.npy and validation.npy
# (the token files of gpu_main_command_h100.md) and, for the A/B, old/ = `git archive 937422e
# noloco_jax configs`; .whl/ the wheels the GPU image lacks. Results: experiments/results/gpu_determinism_h100.md
set -u
ROOT=$PWD; G=$ROOT/_gpu46; SITE=/tmp/site; O=${OUT:-/tmp/out46}; mkdir -p $O; L=$O/log.txt
PY=${PY:-python3}; STEPS=${STEPS:-300}; LIM=${LIM:-100}
python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE .whl/*.whl >> $L 2>&1
$PY -c "import jax, flax; print(jax.__version__, flax.__version__, jax.devices())" >> $L 2>&1
Q="--config.data.source=tokens --config.data.path=$G --noprogress --config.num_steps=$STEPS --config.log_every=25 --config.eval_every=$STEPS --config.checkpoint_every=$STEPS --config.model.param_dtype=bfloat16 --config.model.dtype=bfloat16 --config.model.preset=${PRESET:-mini} --config.global_batch_size=${GB:-128}"
run() { tree=$1; name=$2; shift 2; cd $tree; s=$SECONDS; rm -rf /tmp/w_$name
  timeout $LIM env PYTHONPATH=$SITE:$tree $PY -m noloco_jax.train "$@" $Q --workdir=/tmp/w_$name > /tmp/$name.log 2>&1
  echo "== $name rc=$? $((SECONDS-s)) s" >> $L; tail -2 /tmp/$name.log | cut -c1-200 >> $L
  cp /tmp/w_$name/metrics.jsonl $O/$name.jsonl 2>/dev/null; cd $ROOT; }
for cfg in dp noloco; do
  C="--config=configs/tiny_$cfg.py"; [ $cfg = noloco ] && C="$C --config.outer.sync_every=25"
  run $ROOT ${cfg}_new1 $C; run $G/old ${cfg}_old $C; run $ROOT ${cfg}_new2 $C
done
$PY - "$O" >> $L 2>&1 <<'PY'
import json, sys, glob, statistics, os
for f in sorted(glob.glob(sys.argv[1] + "/*.jsonl")):
    rows = [json.loads(l) for l in open(f)]
    tps = [r["tokens_per_sec"] for r in rows if "tokens_per_sec" in r and r.get("step", 0) > 100]
    ev = [r for r in rows if "val_ppl" in r]
    print(os.path.basename(f), "median tok/s %.0f" % statistics.median(tps) if tps else "-", "n=%d" % len(tps),
          "val_ppl %.4f avg %.4f" % (ev[-1]["val_ppl"], ev[-1]["val_ppl_avg_model"]) if ev else "")
PY
cat $L
