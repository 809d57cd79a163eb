"""Memory and traffic of a split replica, read from the trainer's compiled programs.

Programs are compiled from shapes alone (``noloco_jax.trainer.aot``: nothing is
allocated), so the numbers are the trainer's own: its topology, optimizer (Adam
inside NoLoCo) and its sync program. What is compared: the bytes one device
holds of the training state (params, Adam moments, slow weights and outer
momentum) with a replica whole on one device (F x T = 1) and split over F x T
devices. They must fall as 1 / (F x T) within 10 %. The NoLoCo sync's
cross-replica collective-permute bytes per device must fall the same way.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from noloco_jax import hlo, models
from noloco_jax.errors import UserError
from noloco_jax.trainer import aot
from noloco_jax.trainer import settings as st

VOCAB = 256  # mini at vocab 256: 10.0M params


def _settings(num_replicas, fsdp, tensor, **overrides):
    config = {"model": {"preset": "mini"}, "method": "noloco", "num_replicas": num_replicas,
              "backend": "shard_map", "global_batch_size": 8 * num_replicas, "log_every": 1,
              "data": {"seq_len": 128}, "mesh": {"fsdp": fsdp, "tensor": tensor}, **overrides}
    return st.from_config(config)


def _compiled(num_replicas, fsdp, tensor, exchange=""):
    """The sync program, compiled once per process for each split and exchange (the cache's
    key is the arguments as given: ``exchange`` is passed on so that a call leaving it out
    and one naming "" share one entry)."""
    return _compiled_once(num_replicas, fsdp, tensor, exchange)


@functools.lru_cache(maxsize=None)
def _compiled_once(num_replicas, fsdp, tensor, exchange):
    return aot.compile_program(_settings(num_replicas, fsdp, tensor,
                                         outer={"exchange_dtype": exchange}),
                               VOCAB, program="sync")  # fmt: skip


def _check_falls(whole, split, parts):
    for field in ("params", "optimizer", "outer"):
        a, b = getattr(whole, field), getattr(split, field)
        assert a > 0 and abs(b * parts / a - 1) <= 0.1, (field, parts, a, b)
    assert abs(split.state * parts / whole.state - 1) <= 0.1, (parts, whole.state, split.state)


def test_state_bytes_per_device_fall_with_the_split():
    """mini, N = 2, (fsdp 2, tensor 2) vs whole replicas: 1/4 of the state per device."""
    whole, split = aot.memory_of(_compiled(2, 1, 1)), aot.memory_of(_compiled(2, 2, 2))
    _check_falls(whole, split, 4)
    for m in (whole, split):  # the categories are the compiler's whole argument list
        assert m.state + m.tokens == m.argument
        # The state is updated in place (donated): all of it on whole replicas; on a split one
        # all but the RMSNorm scales (5 x 16,640 bytes on mini: their copies are not aliased).
        assert m.alias >= m.state - m.counters - 5 * 16_640
    # Adam holds two moments of every param; NoLoCo holds phi and its momentum.
    assert whole.optimizer == pytest.approx(2 * whole.params, rel=1e-3)
    assert whole.outer == pytest.approx(2 * whole.params, rel=1e-3)
    # Scratch (activations, gradients, gathered weights) falls too: each device runs its
    # share of the sequences. With every device of a replica running all of them, it fell
    # to 1/2.1 here (seen before sharding.shard_batch); now 1/3.45.
    assert split.temp < whole.temp / 3, (whole.temp, split.temp)


@pytest.mark.parametrize("exchange, itemsize", [("", 4), ("bfloat16", 2)])
def test_noloco_sync_sends_a_quarter_per_device_on_a_split_of_four(exchange, itemsize):
    """Per device, the cross-replica permute bytes of a sync fall as 1 / (F x T).

    A bfloat16 exchange fell to 1/1.1 only: its leaves travelled as flat vectors of words,
    which the compiler gathered whole inside the replica first.
    """
    sent = {}
    for split in ((1, 1), (2, 2)):
        compiled = _compiled(2, *split, exchange)
        crossing = hlo.crossing_bytes(hlo.collective_ops(compiled.as_text()),
                                      aot.device_replicas(compiled))  # fmt: skip
        assert set(crossing) == {"collective-permute"}, crossing  # nothing else crosses
        sent[split] = crossing["collective-permute"]
    _, params = jax.eval_shape(lambda: models.init_params(
        models.get_preset("mini", vocab_size=VOCAB), 0))  # fmt: skip
    replica_bytes = sum(x.size * itemsize for x in jax.tree.leaves(params))
    assert sent[(1, 1)] == pytest.approx(replica_bytes, rel=1e-3)  # phi once (gamma = beta)
    assert abs(sent[(2, 2)] * 4 / sent[(1, 1)] - 1) <= 0.1, sent


def _sync_bytes(method, exchange, fsdp, tensor):
    """Crossing bytes per device of the compiled sync, and the trainer's count per replica."""
    from noloco_jax.trainer import optimizer  # noqa: PLC0415

    _, params = jax.eval_shape(lambda: models.init_params(
        models.get_preset("mini", vocab_size=VOCAB), 0))  # fmt: skip
    s = _settings(2, fsdp, tensor, method=method, outer={"exchange_dtype": exchange,
                                                         "sync_every": 1})  # fmt: skip
    compiled = aot.compile_program(s, VOCAB, program="sync")
    crossing = hlo.crossing_bytes(hlo.collective_ops(compiled.as_text()),
                                  aot.device_replicas(compiled))  # fmt: skip
    counted = optimizer.bytes_sent(method, s.outer, params, num_replicas=2, steps=1,
                                   fault=s.fault, devices_per_replica=fsdp * tensor)
    return crossing, counted


def test_diloco_bfloat16_wire_sends_a_quarter_per_device_on_a_split_of_four():
    """DiLoCo's 16-bit wire packed all leaves into one flat vector for its all-to-all and
    all-gather; on a split of four the compiler gathered it, and every device sent the whole
    replica's message (19,996,804 bytes here, as on a whole replica). Leaf by leaf, each in
    its own shape, a device sends its quarter (5,005,444), and the trainer counts the
    replica's bytes once."""
    assert not st.packs_replica("diloco", "bfloat16")
    whole, counted = _sync_bytes("diloco", "bfloat16", 1, 1)
    split, counted_split = _sync_bytes("diloco", "bfloat16", 2, 2)
    assert counted_split == counted
    # Of an all-to-all's and all-gather's N shards (N = 2) the device's own stays; a
    # permute's operand leaves whole. The split all-gather carries the presence flags.
    assert sum(whole.values()) * 0.5 == counted, whole
    assert set(split) == {"collective-permute", "all-gather"} and split["all-gather"] == 8
    sent = split["collective-permute"] + split["all-gather"] * 0.5
    assert abs(sent * 4 / counted - 1) <= 0.01, (sent, counted)


@pytest.mark.parametrize("method, exchange", [("noloco", "int8"), ("diloco", "int8")])
def test_packed_exchanges_send_the_whole_replica_from_every_device_and_are_counted_so(
        method, exchange):  # fmt: skip
    """An 8-bit message packs the replica into one flat vector (its scale blocks span
    leaves), so on a split of four each device sends the whole replica's message. The
    trainer's ``bytes_sent_per_replica`` counted it once, a quarter of what the replica sent."""
    assert st.packs_replica(method, exchange)
    for fsdp, tensor in ((1, 1), (2, 2)):
        crossing, per_replica = _sync_bytes(method, exchange, fsdp, tensor)
        # A permute's operand leaves whole; of an all-to-all's and all-gather's N shards
        # (N = 2), the device's own stays (test_exchange8.py).
        sent = sum(crossing.values()) * (1 if method == "noloco" else 0.5)
        assert sent * fsdp * tensor == per_replica, (crossing, per_replica)


@pytest.mark.slow  # the trainer's own check (its guard sends presence flags) is in the default run
def test_noloco_with_presence_flags_on_a_split_replica_equals_the_simulation(monkeypatch):
    """Drop-outs make every message carry a presence flag; each leaf still travels alone."""
    import optax  # noqa: PLC0415

    from noloco_jax import local_steps, noloco_outer  # noqa: PLC0415
    from tests import test_sharded_replicas as sharded  # noqa: PLC0415

    monkeypatch.setitem(sharded.METHODS, "noloco_dropout", lambda n: local_steps(
        optax.sgd(0.1, momentum=0.9), noloco_outer(seed=1, dropout_prob=0.3), sharded.H))
    sharded._check("noloco_dropout", 2, {"fsdp": 2, "tensor": 2})


@pytest.mark.slow
def test_state_bytes_per_device_fall_as_one_over_the_split_up_to_eight():
    """mini, N = 1 (8 devices hold one replica at F x T = 8), F x T in {1, 2, 4, 8}."""
    whole = aot.step_memory(_settings(1, 1, 1), VOCAB)
    for fsdp, tensor in ((2, 1), (2, 2), (4, 2), (8, 1)):
        _check_falls(whole, aot.step_memory(_settings(1, fsdp, tensor), VOCAB), fsdp * tensor)


def test_remat_keeps_the_numbers_and_needs_less_scratch():
    """``LlamaConfig.remat``: equal loss and gradients, smaller compiled scratch memory."""
    cfg = models.get_preset("nano", vocab_size=64, max_seq_len=64)
    _, params = models.init_params(cfg, 0)
    tokens = np.random.default_rng(0).integers(0, 64, (8, 65), np.int32)
    out, temp = {}, {}
    for remat in (False, True):
        graphdef = jax.eval_shape(lambda r=remat: models.init_params(
            dataclasses.replace(cfg, remat=r), 0))[0]  # fmt: skip

        def loss(p, graphdef=graphdef):
            logits = models.apply(graphdef, p, tokens[:, :-1])
            return models.cross_entropy(logits, jnp.asarray(tokens[:, 1:])).mean()

        compiled = jax.jit(jax.value_and_grad(loss)).lower(params).compile()
        out[remat] = compiled(params)
        temp[remat] = compiled.memory_analysis().temp_size_in_bytes
    np.testing.assert_allclose(out[True][0], out[False][0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(out[True][1]), jax.tree.leaves(out[False][1])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert temp[True] < temp[False], temp


def test_remat_setting_must_be_a_bool():
    with pytest.raises(ValueError, match="config.model.remat"):
        st.from_config({"model": {"remat": "yes"}})


@pytest.mark.parametrize("overrides", [
    {"num_stages": 2},  # a (replica, stage) mesh: per_stage builds the optimizer per stage
    {"outer": {"delay": 2, "sync_every": 10}, "log_every": 10},  # the overlap window
], ids=["stages", "delay"])
def test_step_memory_compiles_every_program_the_trainer_runs(overrides):
    """Both raised before: the stage mesh called the optimizer factory with stage=..., and with
    a delay the programs were built without it (train_step refused their phases)."""
    s = st.from_config({"model": {"preset": "nano"}, "method": "noloco", "num_replicas": 2,
                        "backend": "shard_map", "global_batch_size": 8, "data": {"seq_len": 32},
                        "eval_every": 100, "checkpoint_every": 100, **overrides})  # fmt: skip
    inner = aot.step_memory(s, VOCAB, program="inner")
    sync = aot.step_memory(s, VOCAB, program="sync")
    assert inner.state == sync.state > 0  # one train state, held by both programs
    for m in (inner, sync):
        assert m.state + m.tokens == m.argument
    one_step = 8 // 2 * 33 * 4  # int32 tokens of a replica's step (each stage device has them)
    window = s.outer.delay + 1  # the sync program is the window: one token array per step
    assert sync.tokens == window * one_step
    # gcd(log_every, H): 25 by default; with the delay, 10 - (2 + 1) before the window starts
    longest = 10 - window if s.outer.delay else 25
    assert inner.tokens == longest * one_step  # the trainer's longest inner block


@pytest.mark.parametrize("delay", [0, 1])
def test_memory_of_counts_the_overlap_anchor_as_outer_state(delay):
    """With outer.delay the state holds an anchor (theta at the exchange, params-sized): it is
    outer state, not the inner optimizer's (it was counted as Adam moments)."""
    import optax  # noqa: PLC0415

    from noloco_jax.optim import local_steps  # noqa: PLC0415
    from noloco_jax.trainer.step import TrainState  # noqa: PLC0415

    params = {"w": jnp.zeros((2, 8, 16), jnp.float32)}  # 2 replicas of an 8 x 16 weight
    tx = local_steps(optax.adam(1e-3), optax.sgd(0.7, momentum=0.5), 4, delay=delay)
    opt_state = jax.vmap(tx.init)(params)
    state = TrainState(jnp.zeros([], jnp.int32), params, opt_state)
    tokens = jnp.zeros((2, 1, 1, 3), jnp.int32)
    m = aot.memory_of(jax.jit(lambda s, t: s, keep_unused=True).lower(state, tokens).compile())
    weights = 2 * 8 * 16 * 4
    assert m.params == weights
    assert m.optimizer == 2 * weights + 2 * 4  # Adam's moments and per-replica counts
    assert m.outer == (3 if delay else 2) * weights  # slow weights, momentum (, anchor)


def test_step_memory_refuses_a_vocab_size_the_settings_contradict():
    """The trainer refuses config.model.vocab_size=128 with a 256-id tokenizer; step_memory
    sized a 256-id model for it silently."""
    s = st.from_config({"model": {"preset": "nano", "vocab_size": 128}, "num_replicas": 1})
    with pytest.raises(ValueError, match=r"config\.model\.vocab_size=128 is smaller than the "
                                         r"'byte' tokenizer's vocabulary of 256"):  # fmt: skip
        aot.step_memory(s, 256)


def test_step_memory_sizes_a_padded_vocabulary():
    """config.model.vocab_size=384 above a 256-id tokenizer pads the tables: 2 x 128 x 64 more
    parameters (embedding and output head) than the unpadded model."""
    plain = st.from_config({"model": {"preset": "nano"}, "num_replicas": 1})
    padded = st.from_config({"model": {"preset": "nano", "vocab_size": 384}, "num_replicas": 1})
    grown = aot.step_memory(padded, 256).params - aot.step_memory(plain, 256).params
    assert grown == 2 * 128 * 64 * 4


def test_step_memory_refuses_an_init_from_vocabulary_the_tokenizer_contradicts(tmp_path):
    """config.model.vocab_size=256 equal to the tokenizer's, but init_from's config.json has
    512: the trainer refuses (hf_init); step_memory sized the 512-id model silently. An
    init_from vocabulary smaller than the tokenizer's is refused too."""
    import json  # noqa: PLC0415

    from noloco_jax.models import hf  # noqa: PLC0415

    cfg = models.get_preset("nano", vocab_size=512)
    (tmp_path / "config.json").write_text(json.dumps(hf.config_to_hf(cfg)))
    s = st.from_config({"model": {"init_from": str(tmp_path), "vocab_size": 256},
                        "num_replicas": 1})  # fmt: skip
    with pytest.raises(ValueError, match=r"config\.model\.vocab_size=256 differs from the "
                                         r"init_from model's 512; set it to 0"):  # fmt: skip
        aot.step_memory(s, 256)
    s = st.from_config({"model": {"init_from": str(tmp_path)}, "num_replicas": 1})
    with pytest.raises(ValueError, match=r"init_from=.* has a vocabulary of 512 ids but the "
                                         r"'byte' tokenizer has 1024"):  # fmt: skip
        aot.step_memory(s, 1024)


def test_step_memory_refuses_a_split_that_does_not_divide_the_model():
    """The trainer refuses mesh.tensor=3 on nano's 4 heads (sharding.check_divides);
    step_memory raised jax's IndivisibleError about a NamedSharding instead."""
    s = _settings(2, 1, 3, model={"preset": "nano"})
    with pytest.raises(UserError, match=r"mesh\.tensor=3 does not divide dim 2 of "
                                        r"\['blocks'\]\['attn'\]\['wk'\]"):
        aot.step_memory(s, VOCAB)


def test_a_split_of_an_init_from_vocabulary_names_no_padding(tmp_path):
    """mesh.tensor=2 on an init_from model of 301 ids said to pad it with
    config.model.vocab_size=302, which the trainer then refused (it must equal the
    checkpoint's table); the message now names only a divisor."""
    import json  # noqa: PLC0415

    from noloco_jax.models import hf  # noqa: PLC0415

    cfg = models.get_preset("nano", vocab_size=301)
    (tmp_path / "config.json").write_text(json.dumps(hf.config_to_hf(cfg)))
    s = _settings(2, 1, 2, model={"init_from": str(tmp_path)})
    with pytest.raises(UserError, match=r"\(the vocabulary, size 301\); choose a divisor of "
                                        r"301\.$"):  # fmt: skip
        aot.step_memory(s, VOCAB)
