"""Elastic replica count: resume N -> N/2 (merge) and N -> 2N (clone) behind allow_resize."""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pydoc_data.topics import topics

from noloco_jax.trainer import settings as settings_lib
from noloco_jax.trainer.loop import train_and_evaluate
from noloco_jax.trainer.resize import resize_state
from noloco_jax.trainer.writers import read_jsonl


def test_resize_state_merges_and_clones_by_replica_axis():
    tree = {
        "w": jnp.arange(8.0).reshape(4, 2),  # per replica (float)
        "step": jnp.asarray(7, jnp.int32),  # shared counter (no replica axis)
        "local_opt_state": {"count": jnp.asarray([3, 3, 3, 3], jnp.int32)},  # per replica int
    }
    merged = resize_state(tree, 2)
    np.testing.assert_array_equal(merged["w"], [[1.0, 2.0], [5.0, 6.0]])  # pairs averaged
    assert int(merged["step"]) == 7 and merged["local_opt_state"]["count"].tolist() == [3, 3]
    # A replica the guard reset counts from 0 again: the merge keeps the longer history (it
    # took the first replica's, so merged moments got a restarted bias correction).
    reset = {**tree, "local_opt_state": {"count": jnp.asarray([0, 3, 3, 1], jnp.int32)}}
    assert resize_state(reset, 2)["local_opt_state"]["count"].tolist() == [3, 3]
    keys = {"key": jnp.asarray([[1, 9], [2, 3], [5, 0], [4, 4]], jnp.uint32)}  # not counters
    assert resize_state(keys, 2)["key"].tolist() == [[1, 9], [5, 0]]  # a real key, not a max
    cloned = resize_state(tree, 8)
    np.testing.assert_array_equal(cloned["w"], np.repeat(np.asarray(tree["w"]), 2, axis=0))
    assert int(cloned["step"]) == 7 and cloned["local_opt_state"]["count"].shape == (8,)
    # The replica mean of every float leaf is unchanged either way.
    for out in (merged, cloned):
        np.testing.assert_allclose(out["w"].mean(0), tree["w"].mean(0))


def test_a_merge_leaves_out_a_broken_replicas_values():
    """A checkpoint may hold a replica with NaN fast weights and moments (the guard resets it
    at its next sync): the merge spread the NaN to its partner, which lost its progress."""
    w = jnp.arange(8.0).reshape(4, 2).at[1].set(jnp.nan).at[3, 0].set(jnp.inf)
    nan_all = jnp.full((4, 1), jnp.nan)
    merged = resize_state({"w": w, "broken": nan_all, "bf16": w.astype(jnp.bfloat16)}, 2)
    np.testing.assert_array_equal(merged["w"], [[0.0, 1.0], [4.0, 6.0]])  # finite ones only
    np.testing.assert_array_equal(merged["bf16"], np.asarray([[0.0, 1.0], [4.0, 6.0]]))
    assert np.isnan(merged["broken"]).all()  # none finite: stays non-finite (the guard's case)


def test_resize_keeps_the_total_of_the_guards_reset_counts():
    import optax  # noqa: PLC0415

    from noloco_jax import local_steps, noloco_outer, replicas  # noqa: PLC0415

    reps = replicas.make_replicas(4, backend="vmap")
    tx = local_steps(optax.adam(1e-3), noloco_outer(), 2, nonfinite_guard=True)
    state = reps.init(tx, jnp.zeros((4, 3)))
    state = state._replace(nonfinite_resets=jnp.asarray([1.0, 0.0, 2.0, 3.0]))
    assert resize_state(state, 2).nonfinite_resets.tolist() == [1.0, 5.0]  # was the mean
    cloned = resize_state(state, 8).nonfinite_resets.tolist()
    assert cloned == [1.0, 0.0, 0.0, 0.0, 2.0, 0.0, 3.0, 0.0]  # was each count twice


def _most_bytes_on_a_device(tree):
    held = {}
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return max(held.values())


@pytest.mark.parametrize("old_n, old_fsdp, new_n, new_fsdp", [(4, 1, 8, 1), (3, 1, 6, 1),
                                                              (2, 4, 4, 2), (4, 2, 2, 4)])
def test_a_resize_reads_the_checkpoint_spread_over_the_devices(tmp_path, old_n, old_fsdp, new_n,
                                                               new_fsdp):  # fmt: skip
    """No device reads more of the old checkpoint than its share (it was all read onto the
    first device; then each device read whole replicas even with mesh.fsdp)."""
    from noloco_jax import replicas  # noqa: PLC0415
    from noloco_jax.trainer.checkpoint import Checkpointer  # noqa: PLC0415
    from noloco_jax.trainer.resize import restore_resized  # noqa: PLC0415

    def layout(n, fsdp):
        return replicas.make_replicas(n, backend="shard_map", mesh_shape={"fsdp": fsdp})

    old = {"lm_head": jnp.arange(old_n * 64 * 32.0).reshape(old_n, 64, 32),
           "step": jnp.asarray(3, jnp.int32)}  # fmt: skip
    ckpt = Checkpointer(tmp_path)
    ckpt.save(3, layout(old_n, old_fsdp).put(old), {})
    ckpt.wait()
    reps = layout(new_n, new_fsdp)
    template = reps.put({"lm_head": jnp.zeros((new_n, 64, 32)), "step": jnp.asarray(0, jnp.int32)})
    read = []
    real = ckpt.restore
    ckpt.restore = lambda step, abstract: (lambda got: read.append(got[0]) or got)(real(step,
                                                                                       abstract))
    new = restore_resized(ckpt, 3, template, old_n, reps)
    ckpt.close()
    resized = old["lm_head"]
    if new_n > old_n:
        resized = np.repeat(np.asarray(resized), new_n // old_n, axis=0)
    else:
        resized = np.asarray(resized).reshape(new_n, -1, 64, 32).mean(1)
    np.testing.assert_array_equal(new["lm_head"], resized)
    assert new["lm_head"].sharding == template["lm_head"].sharding and int(new["step"]) == 3
    # At most a device's share of the new state, or (a merge) of the old checkpoint.
    even = old["lm_head"].nbytes // jax.device_count() + 4  # + the shared step
    assert _most_bytes_on_a_device(read[0]) <= max(_most_bytes_on_a_device(template), even)


def _settings(tmp, **over):
    corpus = tmp / "corpus"
    if not corpus.exists():
        corpus.mkdir()
        for i, (name, text) in enumerate(sorted(topics.items())[:30]):
            (corpus / f"{i:02d}_{name}.txt").write_text(text, encoding="utf-8")
    base = {
        "method": "noloco", "num_replicas": 4, "backend": "vmap", "global_batch_size": 8,
        "num_steps": 12, "log_every": 2, "eval_every": 4, "checkpoint_every": 4,
        "model": {"preset": "nano"}, "optim": {"warmup_steps": 1}, "outer": {"sync_every": 2},
        "data": {"source": "files", "path": str(corpus), "data_dir": str(tmp / "data"),
                 "seq_len": 32, "eval_windows": 8},
    }  # fmt: skip
    base.update(over)
    return settings_lib.from_config(base)


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """N = 4 trained to step 8 (checkpoint and evaluation there), then interrupted."""
    tmp = tmp_path_factory.mktemp("resize")
    train_and_evaluate(_settings(tmp), tmp / "run", stop_at=8, progress=False)
    return tmp


def _resume(base, tmp_path, n, **over):
    workdir = tmp_path / f"n{n}"
    shutil.copytree(base / "run", workdir)
    s = _settings(base, num_replicas=n, allow_resize=True, **over)
    last = train_and_evaluate(s, workdir, progress=False)
    evals = [r for r in read_jsonl(workdir / "metrics.jsonl", "eval") if r["step"] == 8]
    events = read_jsonl(workdir / "metrics.jsonl", "event")
    return last, evals, events


# Measured: merging 4 -> 2 at step 8 lowers the pooled validation loss by 0.0021 nats
# (4.21350 -> 4.21136); the bound allows 0.02 nats either way. Cloning leaves it unchanged
# (measured difference 0: the same replicas, twice).
MERGE_BOUND = 0.02


def test_merge_to_half_the_replicas(base_run, tmp_path):
    last, (before, after), events = _resume(base_run, tmp_path, 2)
    assert [e["event"] for e in events] == ["resize"]
    # Both evals share step 8; the one after the merge says so (plots keep a step's last record)
    assert after["resized_from"] == 4 and "resized_from" not in before
    assert len(after["distance_to_mean_per_replica"]) == 2
    assert abs(after["val_loss"] - before["val_loss"]) < MERGE_BOUND, (before, after)
    # Pairs are averaged, so the all-replica average model is unchanged.
    assert after["val_ppl_avg_model"] == pytest.approx(before["val_ppl_avg_model"], rel=1e-5)
    assert last["step"] == 12 and np.isfinite(last["train_loss"])
    assert len(last["train_loss_per_replica"]) == 2
    # The finished run asked to resize again: nothing resized, nothing written.
    workdir = tmp_path / "n2"
    before_files = (workdir / "metrics.jsonl").read_text()
    again = train_and_evaluate(_settings(base_run, num_replicas=4, allow_resize=True), workdir,
                               progress=False)  # fmt: skip
    assert again["step"] == 12 and (workdir / "metrics.jsonl").read_text() == before_files


# A clone keeps each replica's batch of 2 sequences: 16 in all, the settings (and programs) of
# test_clone_to_twice_the_replicas, and another global batch than the run's 8.
CLONE = {"num_replicas": 8, "global_batch_size": 16}


def test_counts_go_on_across_a_resize_with_another_batch(base_run, tmp_path):
    shutil.copytree(base_run / "run", tmp_path / "run")
    s = _settings(base_run, **CLONE, allow_resize=True, checkpoint_every=2)
    stopped = train_and_evaluate(s, tmp_path / "run", stop_at=10, progress=False)
    evals = read_jsonl(tmp_path / "run" / "metrics.jsonl", "eval")
    assert (stopped["step"], stopped["eval_step"]) == (10, evals[-1]["step"])  # says which eval
    assert stopped["val_ppl"] == evals[-1]["val_ppl"]
    train_and_evaluate(s, tmp_path / "run", progress=False)  # a plain resume at step 10
    seen = {r["step"]: r["tokens_seen"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl",
                                                             "train")}  # fmt: skip
    assert seen[8] == 8 * 8 * 32 and seen[12] == seen[8] + 4 * 16 * 32  # 8 then 16 sequences
    sent = [r["bytes_sent_per_replica"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl",
                                                           "train")]  # fmt: skip
    assert sent == sorted(sent)


def test_clone_to_twice_the_replicas(base_run, tmp_path):
    last, (before, after), _ = _resume(base_run, tmp_path, 8, global_batch_size=16)
    assert after["val_loss"] == pytest.approx(before["val_loss"], rel=1e-5)
    assert after["val_ppl_avg_model"] == pytest.approx(before["val_ppl_avg_model"], rel=1e-5)
    d = after["distance_to_mean_per_replica"]
    assert len(d) == 8 and d[0::2] == pytest.approx(d[1::2])  # clones side by side
    assert last["step"] == 12 and np.isfinite(last["train_loss"])


def test_resize_needs_the_flag_and_a_divisor(base_run, tmp_path):
    shutil.copytree(base_run / "run", tmp_path / "run")
    with pytest.raises(ValueError, match=r"num_replicas: 4 -> 2.*allow_resize=True"):
        train_and_evaluate(_settings(base_run, num_replicas=2), tmp_path / "run", progress=False)
    with pytest.raises(ValueError, match="needs one count to divide the other"):
        s = _settings(base_run, num_replicas=6, global_batch_size=12, allow_resize=True)
        train_and_evaluate(s, tmp_path / "run", progress=False)
    with pytest.raises(ValueError, match="cannot resume.*seed"):  # other changes still refused
        s = _settings(base_run, num_replicas=2, allow_resize=True, seed=3)
        train_and_evaluate(s, tmp_path / "run", progress=False)
    with pytest.raises(ValueError, match=r"cannot resume.*outer.group_size: 2 -> 4"):
        s = _settings(base_run, outer={"sync_every": 2, "group_size": 4})  # same N: refused
        train_and_evaluate(s, tmp_path / "run", progress=False)


def test_a_resize_may_change_the_group_size(tmp_path):
    """N = 4 in groups of 4 could never go to N = 2: n must divide N, and could not change."""
    groups = {"sync_every": 2, "group_size": 4}
    train_and_evaluate(_settings(tmp_path, outer=groups), tmp_path / "run", stop_at=4,
                       progress=False)  # fmt: skip
    s = _settings(tmp_path, num_replicas=2, allow_resize=True)
    last = train_and_evaluate(s, tmp_path / "run", stop_at=8, progress=False)
    assert last["step"] == 8 and np.isfinite(last["train_loss"])


def test_a_checkpoint_without_counts_is_counted_with_its_own_group_size(tmp_path):
    """Checkpoints that predate the saved counts: their bytes came from the new run's
    outer.group_size (a resize from groups of 4 to groups of 2 halved them)."""
    import types  # noqa: PLC0415

    from noloco_jax.trainer import loop, optimizer  # noqa: PLC0415

    old = _settings(tmp_path, outer={"sync_every": 2, "group_size": 4})
    new = _settings(tmp_path, num_replicas=2, allow_resize=True)
    params = {"w": jnp.zeros((64, 64))}
    run = types.SimpleNamespace(settings=new, params0=params)
    step, tokens, sent = loop._counted_at({"settings": old.to_dict()}, 8, run)
    want = optimizer.bytes_sent("noloco", old.outer, params, num_replicas=4, steps=8,
                                fault=old.fault)  # fmt: skip
    assert (step, tokens, sent) == (8, 8 * 8 * 32, want)
    assert want != optimizer.bytes_sent("noloco", new.outer, params, num_replicas=4, steps=8,
                                        fault=new.fault)  # fmt: skip


def test_resize_with_pipeline_stages_is_refused(tmp_path):
    with pytest.raises(ValueError, match="config.allow_resize: resizing runs with pipeline"):
        _settings(tmp_path, allow_resize=True, num_stages=2)
    with pytest.raises(ValueError, match="config.allow_resize: must be True or False"):
        _settings(tmp_path, allow_resize="yes")


def test_checkpoint_without_the_new_fields_still_resumes(tmp_path):
    """A checkpoint written before a settings field existed counts as having its default."""
    from noloco_jax.trainer.settings import check_resume_compatible  # noqa: PLC0415

    current = _settings(tmp_path).to_dict()
    old = {k: v for k, v in current.items() if k not in ("log", "profile_steps", "allow_resize")}
    old["model"] = {k: v for k, v in current["model"].items()
                    if k not in ("init_from", "num_kv_heads", "tie_embeddings")}  # fmt: skip
    check_resume_compatible(old, current)  # no error
    changed = _settings(tmp_path, model={"preset": "nano", "num_kv_heads": 2}).to_dict()
    with pytest.raises(ValueError, match=r"model.num_kv_heads: 0 -> 2"):
        check_resume_compatible(old, changed)
