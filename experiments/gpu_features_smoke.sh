#!/bin/bash
# Every method and the main features (and a padded vocabulary), 100 steps each of the tiny model, from the repo root:
#   TOK=DIR bash experiments/gpu_features_smoke.sh
# DIR holds train.npy and validation.npy (token streams, data.source=tokens; see
# experiments/results/gpu_main_command_h100.md). PY (default .venv/bin/python) runs the trainer,
# LIMIT (default 60) caps each run in seconds (a GPU needs about 20 s; allow minutes on a CPU),
# LOGS (default /tmp/gpusmoke) gets one log per run; workdirs go to /tmp/w_<run>. ONLY (names
# separated by spaces, e.g. ONLY="bf16 dp") runs just those.
: "${TOK:?set TOK to a folder with train.npy and validation.npy}"
PY=${PY:-.venv/bin/python}; O=${LOGS:-/tmp/gpusmoke}; mkdir -p "$O"
export PYTHONUNBUFFERED=1
Q="--config.data.source=tokens --config.data.path=$TOK --noprogress --config.num_steps=100 --config.eval_every=50 --config.checkpoint_every=100 --config.optim.warmup_steps=10 --config.log_every=25"
run() { name=$1; shift; [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $name "* ]] || return 0
  s=$(date +%s); rm -rf /tmp/w_$name
  timeout "${LIMIT:-60}" $PY -m noloco_jax.train "$1" $Q --workdir=/tmp/w_$name "${@:2}" > $O/$name.log 2>&1; rc=$?
  echo "$name rc=$rc $(( $(date +%s)-s ))s $(grep -E '^step    100' $O/$name.log | cut -c1-110)"; [ $rc = 0 ] || tail -3 $O/$name.log; }
run noloco_int8_delay_frag --config=configs/tiny_noloco.py --config.outer.sync_every=50 --config.outer.exchange_dtype=int8 --config.outer.delay=2 --config.outer.fragments=2
run pipeline --config=configs/tiny_noloco.py --config.outer.sync_every=25 --config.num_stages=2
run bf16 --config=configs/tiny_noloco.py --config.outer.sync_every=25 --config.model.param_dtype=bfloat16 --config.model.dtype=bfloat16
run skipping --config=configs/exp_skippipe.py --config.skip.path_length=3 --config.model.preset=tiny
run diloco --config=configs/tiny_diloco.py --config.outer.sync_every=25
run dp --config=configs/tiny_dp.py
run padded_vocab --config=configs/tiny_noloco.py --config.outer.sync_every=25 --config.model.vocab_size=384
