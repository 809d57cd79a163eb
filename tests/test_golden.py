"""Golden losses: short NoLoCo, DiLoCo, DP, pipelined and stage-skipping runs, bit for bit.

The committed values (``tests/golden/trainer_losses.json``) were made by this test with
``NOLOCO_WRITE_GOLDEN=1``; a refactor of the trainer must reproduce them on XLA:CPU. A change
that is meant to alter the numbers regenerates the file and says why in its commit message.

What is bit for bit: the final checkpoint's per-array checksums (``checkpoint.fingerprint``:
every replica's params, slow weights, optimizer moments and outer momentum) and the
validation perplexities (pooled and averaged model). The logged per-replica train losses are
compared to one float32 ulp: a step's loss is a reduction over the batch whose result the
update never reads (the gradient of a mean does not depend on its sum), and XLA:CPU's order for
it moves with buffer alignment (what ran earlier in the process) and with the machine: seen
as one-ulp changes of some replicas' losses while every checksum and every perplexity
stayed identical. The trainer logs the mean over ``log_every`` steps in float64, so k losses
each within one ulp give a mean within one ulp.
"""

import json
import os
import pathlib

import numpy as np
import pytest

from noloco_jax.trainer.checkpoint import Checkpointer
from noloco_jax.trainer.loop import train_and_evaluate
from noloco_jax.trainer.writers import read_jsonl
from tests.test_train import tiny_settings

GOLDEN = pathlib.Path(__file__).parent / "golden" / "trainer_losses.json"

# Each run satisfies "log_every and sync_every divide one another" both ways round.
RUNS = {
    "noloco": dict(method="noloco", log_every=2, outer={"sync_every": 4}),
    "diloco": dict(method="diloco", log_every=4, outer={"sync_every": 2}),
    "dp": dict(method="dp", log_every=2),
    "pipelined_sim": dict(method="noloco", num_stages=2, log_every=2, outer={"sync_every": 4}),
    "pipelined_mesh": dict(method="noloco", num_stages=2, backend="shard_map", log_every=2,
                           outer={"sync_every": 4}),
    "skipping": dict(method="noloco", log_every=2, outer={"sync_every": 4},
                     skip={"num_stages": 2, "path_length": 1, "full_every": 4}),
}


def _record(workdir: pathlib.Path, step: int) -> dict:
    train = read_jsonl(workdir / "metrics.jsonl", "train")
    evals = read_jsonl(workdir / "metrics.jsonl", "eval")
    return {
        "checksums": Checkpointer(workdir / "checkpoints").read_meta(step)["checksums"],
        "train_loss_per_replica": {str(r["step"]): r["train_loss_per_replica"] for r in train},
        "val_ppl": {str(r["step"]): r["val_ppl"] for r in evals},
        "val_ppl_avg_model": {str(r["step"]): r["val_ppl_avg_model"] for r in evals},
    }


@pytest.mark.parametrize("name", sorted(RUNS))
def test_golden_losses(name, tmp_path, corpus_dir, data_dir):
    s = tiny_settings(corpus_dir, data_dir, num_steps=8, eval_every=8, checkpoint_every=8,
                      **RUNS[name])  # fmt: skip
    train_and_evaluate(s, tmp_path, progress=False)
    got = _record(tmp_path, s.num_steps)
    if os.environ.get("NOLOCO_WRITE_GOLDEN"):
        table = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
        table[name] = got
        GOLDEN.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    want = json.loads(GOLDEN.read_text())[name]
    assert got["checksums"] == want["checksums"]
    assert got["val_ppl"] == want["val_ppl"] and got["val_ppl_avg_model"] == want["val_ppl_avg_model"]
    assert got["train_loss_per_replica"].keys() == want["train_loss_per_replica"].keys()
    for step, losses in want["train_loss_per_replica"].items():  # one float32 ulp: 2^-23 relative
        np.testing.assert_allclose(got["train_loss_per_replica"][step], losses, rtol=2.0**-23)
