"""Golden losses: short NoLoCo, DiLoCo, DP, pipelined and stage-skipping runs, bit for bit.

The committed values were made by this test with ``NOLOCO_WRITE_GOLDEN=1``; a refactor of the
trainer must reproduce them on XLA:CPU. A change that is meant to alter the numbers regenerates
the files and says why in its commit message. There are two tables, one per set of XLA flags:
``tests/golden/trainer_losses.json`` at XLA's default flags, the numbers users get (``-m slow``),
and ``tests/golden/trainer_losses_test_flags.json`` at the flags the rest of the suite compiles
with (``tests/conftest.py``: LLVM at level 0, the older fusion emitters, one codegen part),
which compile in about a fifth of the time. The default-flags table is the one the trainer's
refactor (issue 18) reproduced; run it with ``-m slow`` after a change to the trainer. The
test-flags table is the default suite's and the more sensitive of the two: between commits
e755733 and a8c7372 (six trainer commits that left every default-flags bit alone), at level 0
with the older emitters, five of the six runs' checksums and one run's perplexity moved, every
loss by under one ulp. At 5140821 (loops with a step count fixed at compile time) the
default-flags table's ``pipelined_mesh`` run was rewritten: its one-step blocks became
straight-line code, which XLA fuses differently on the stage mesh; its checksums moved in the
last bits, one logged loss by 4.9e-8 relative, the perplexities not at all. Every other run of
both tables stayed bit for bit.

What is bit for bit: the final checkpoint's per-array checksums (``checkpoint.fingerprint``:
every replica's params, slow weights, optimizer moments and outer momentum) and the
validation perplexities (pooled and averaged model). The logged per-replica train losses are
compared to one float32 ulp: a step's loss is a reduction over the batch whose result the
update never reads (the gradient of a mean does not depend on its sum), and XLA:CPU's order for
it moves with buffer alignment (what ran earlier in the process) and with the machine: seen
as one-ulp changes of some replicas' losses while every checksum and every perplexity
stayed identical. The trainer logs the mean over ``log_every`` steps in float64, so k losses
each within one ulp give a mean within one ulp.

The six runs of a table train in one subprocess with exactly that table's flags.
"""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from noloco_jax.trainer.checkpoint import Checkpointer
from noloco_jax.trainer.loop import train_and_evaluate
from noloco_jax.trainer.writers import read_jsonl
from tests.helpers import prepare_corpus
from tests.test_train import tiny_settings

GOLDEN_DIR = pathlib.Path(__file__).parent / "golden"
# Flag set -> its golden table. The subprocess gets literal flags: importing tests.conftest
# there would add the suite's flags to the default set.
TABLES = {"default_flags": "trainer_losses.json", "test_flags": "trainer_losses_test_flags.json"}

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


def _settings(name: str, corpus_dir: pathlib.Path, data_dir: pathlib.Path):
    return tiny_settings(corpus_dir, data_dir, num_steps=8, eval_every=8, checkpoint_every=8,
                         **RUNS[name])  # fmt: skip


def _train_all(corpus_dir: pathlib.Path, data_dir: pathlib.Path, out: pathlib.Path) -> None:
    """Trains every run of RUNS and writes its record to ``out/<name>.json``."""
    for name in sorted(RUNS):
        s = _settings(name, corpus_dir, data_dir)
        train_and_evaluate(s, out / name, progress=False)
        (out / f"{name}.json").write_text(json.dumps(_record(out / name, s.num_steps)))


def _xla_flags(flag_set: str) -> str:
    from tests.conftest import DEVICES_FLAG, FAST_COMPILE_FLAGS  # noqa: PLC0415

    fast = () if flag_set == "default_flags" else FAST_COMPILE_FLAGS
    return " ".join((DEVICES_FLAG, *fast))


@pytest.fixture(scope="module", params=[pytest.param("default_flags", marks=pytest.mark.slow),
                                        "test_flags"])  # fmt: skip
def flag_set(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def records(tmp_path_factory, corpus_dir, data_dir, flag_set) -> dict:
    out = tmp_path_factory.mktemp("golden")
    prepare_corpus(corpus_dir, data_dir)
    env = {**os.environ, "XLA_FLAGS": _xla_flags(flag_set), "JAX_NUMPY_RANK_PROMOTION": "raise"}
    done = subprocess.run([sys.executable, "-m", "tests.test_golden", str(corpus_dir),
                           str(data_dir), str(out)], env=env, cwd=GOLDEN_DIR.parents[1],
                          capture_output=True, text=True, timeout=1200)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return {name: json.loads((out / f"{name}.json").read_text()) for name in RUNS}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_golden_losses(name, flag_set, records):
    got, golden = records[name], GOLDEN_DIR / TABLES[flag_set]
    if os.environ.get("NOLOCO_WRITE_GOLDEN"):
        table = json.loads(golden.read_text()) if golden.exists() else {}
        table[name] = got
        golden.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    want = json.loads(golden.read_text())[name]
    assert got["checksums"] == want["checksums"]
    assert got["val_ppl"] == want["val_ppl"] and got["val_ppl_avg_model"] == want["val_ppl_avg_model"]
    assert got["train_loss_per_replica"].keys() == want["train_loss_per_replica"].keys()
    for step, losses in want["train_loss_per_replica"].items():  # one float32 ulp: 2^-23 relative
        np.testing.assert_allclose(got["train_loss_per_replica"][step], losses, rtol=2.0**-23)


def test_the_pipeline_on_the_stage_mesh_trains_like_the_simulation(records):
    """4 replicas x 2 stages on 8 devices against the vmap simulation, read from the records
    above (so the two runs train once): every replica's loss and the perplexities."""
    sim, mesh = records["pipelined_sim"], records["pipelined_mesh"]
    assert mesh["train_loss_per_replica"].keys() == sim["train_loss_per_replica"].keys()
    for step, losses in sim["train_loss_per_replica"].items():
        np.testing.assert_allclose(mesh["train_loss_per_replica"][step], losses, rtol=1e-5)
    for key in ("val_ppl", "val_ppl_avg_model"):
        assert mesh[key].keys() == sim[key].keys()
        np.testing.assert_allclose(list(mesh[key].values()), list(sim[key].values()), rtol=1e-5)

if __name__ == "__main__":  # the fixture's subprocess: CORPUS_DIR DATA_DIR OUT_DIR
    import gc

    from noloco_jax.train import GC_THRESHOLD

    gc.set_threshold(*GC_THRESHOLD)  # as the suite's and noloco-train's processes
    _train_all(*map(pathlib.Path, sys.argv[1:4]))
