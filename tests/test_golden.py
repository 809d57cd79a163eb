"""Golden losses: short NoLoCo, DiLoCo, DP, pipelined and stage-skipping runs, bit for bit.

The committed values (``tests/golden/trainer_losses.json``) were made by this test with
``NOLOCO_WRITE_GOLDEN=1``; a refactor of the trainer must reproduce them exactly on the same
machine (XLA:CPU). A change that is meant to alter the numbers regenerates the file and says
why in its commit message.
"""

import json
import os
import pathlib

import numpy as np
import pytest

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


def _record(workdir: pathlib.Path) -> dict:
    train = read_jsonl(workdir / "metrics.jsonl", "train")
    evals = read_jsonl(workdir / "metrics.jsonl", "eval")
    return {
        "train_loss_per_replica": {str(r["step"]): r["train_loss_per_replica"] for r in train},
        "val_ppl": {str(r["step"]): r["val_ppl"] for r in evals},
        "val_ppl_avg_model": {str(r["step"]): r["val_ppl_avg_model"] for r in evals},
    }


@pytest.mark.parametrize("name", sorted(RUNS))
def test_golden_losses(name, tmp_path, corpus_dir, data_dir):
    s = tiny_settings(corpus_dir, data_dir, num_steps=8, eval_every=8, checkpoint_every=8,
                      **RUNS[name])  # fmt: skip
    train_and_evaluate(s, tmp_path, progress=False)
    got = _record(tmp_path)
    if os.environ.get("NOLOCO_WRITE_GOLDEN"):
        table = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
        table[name] = got
        GOLDEN.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    want = json.loads(GOLDEN.read_text())[name]
    if not name.startswith("pipelined"):
        assert got == want
        return
    # Open problem: the pipelined runs' logged losses move by one float32 ulp with what ran
    # before in the same process (seen at steps 4, 6 and 8; validation ppl stays exact), so
    # they are compared to one ulp (rtol 2.4e-7), the rest bit for bit.
    assert got["val_ppl"] == want["val_ppl"] and got["val_ppl_avg_model"] == want["val_ppl_avg_model"]
    for step, losses in want["train_loss_per_replica"].items():
        np.testing.assert_allclose(got["train_loss_per_replica"][step], losses, rtol=2.4e-7)
