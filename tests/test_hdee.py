"""HDEE in miniature: domains, tiers, equal compute, independent experts, ensemble rules."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from noloco_jax import models
from noloco_jax.hdee import domains as dom
from noloco_jax.hdee import experts as ex
from noloco_jax.hdee import evaluate as ev

LOCAL = ("python_code", "python_docs", "arithmetic", "markov_b3")  # no download needed
CFG = models.get_preset("nano", vocab_size=256, max_seq_len=64, hidden_size=32, num_heads=2)
WIDTHS = {"S": 64, "M": 128, "L": 192}


def test_domains_are_deterministic_distinct_and_split_80_10_10():
    a = dom.make_domains(LOCAL, ("markov_b12", "json_records"), num_chars=5000)
    b = dom.make_domains(LOCAL, ("markov_b12", "json_records"), num_chars=5000)
    assert a == b
    assert [d.held_out for d in a] == [False] * 4 + [True] * 2
    texts = [d.train for d in a]
    assert len(set(texts)) == len(texts)
    for d in a:
        total = len(d.train) + len(d.dev) + len(d.test)
        assert total == 5000 and len(d.train) == 4000 and len(d.dev) == 500


SYNTHETIC = ("markov_b6", "csv_records", "log_lines", "dna", "sorting")


def test_default_domains_give_the_count_test_power_and_new_sources_are_sound():
    from noloco_jax.experiments import stats

    names = dom.TRAINING_DOMAINS + dom.HELD_OUT_DOMAINS
    assert len(set(names)) == len(names) and set(names) <= set(dom.SOURCES)
    assert len(dom.TRAINING_DOMAINS) % 3 == 0  # equal difficulty thirds
    assert stats.binomial_power(len(names), 2 / 3, 20 / 21, 0.05)["power"] >= 0.8
    a = dom.make_domains(SYNTHETIC + ("python_tests", "pydoc_html"), (), num_chars=3000)
    b = dom.make_domains(SYNTHETIC + ("python_tests", "pydoc_html"), (), num_chars=3000)
    assert a == b and len({d.train for d in a}) == len(a)
    assert all(len(d.train) + len(d.dev) + len(d.test) == 3000 for d in a)
    lines = dom.sorting_text(2000).splitlines()[:-1]  # the last line may be cut
    for line in lines:
        xs, ys = line.removeprefix("sort ").split(" -> ")
        assert sorted(map(int, xs.split())) == list(map(int, ys.split()))
    html = dom.pydoc_html_text(200_000)
    assert "<stdlib>" in html  # no machine path in the text
    assert "IS_CHARACTER_JUNK at 0x&gt;" in html  # a default value, its address blanked
    assert not re.search(r"at( |&nbsp;)0x[0-9a-f]", html)  # the same text in every process
    genes = [x for x in dom.dna_text(5000).splitlines() if not x.startswith(">")]
    assert set("".join(genes)) == set("ACGT") and genes[0].startswith("ATG")


def test_a_python_without_its_test_suite_is_refused_not_an_empty_domain(tmp_path, monkeypatch):
    """Debian's python3 and the python Docker images ship no <stdlib>/test/."""
    import sysconfig  # noqa: PLC0415

    (tmp_path / "os.py").write_text("x = 1\n")
    paths = sysconfig.get_paths()
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {**paths, "stdlib": str(tmp_path)})
    with pytest.raises(RuntimeError, match=r"test/test_\*\.py files hold 0 characters"):
        dom.make_domains(("python_tests",), (), num_chars=3000)
    with pytest.raises(RuntimeError, match="fewer than num_chars=3000"):
        dom.make_domains(("python_code",), (), num_chars=3000)


def test_shakespeare_groups_come_from_the_named_plays():
    plays = {t: f"<{t}>" for t in dom.COMEDIES + dom.TRAGEDIES + dom.HISTORIES + dom.POEMS}
    text = dom.shakespeare_group(plays, dom.HISTORIES, 10_000)
    assert "<henry_v>" in text and "<hamlet>" not in text
    assert not set(dom.COMEDIES) & set(dom.TRAGEDIES) | set(dom.HISTORIES) & set(dom.POEMS)
    with pytest.raises(ValueError, match="plays: the corpus lacks"):
        dom.shakespeare_group({}, dom.HISTORIES, 100)


def test_measured_difficulty_orders_the_synthetic_sources_and_the_tiers():
    easy, hard = dom.markov_text(20_000, 2), dom.markov_text(20_000, 12)
    assert dom.difficulty_bits_per_byte(easy) < dom.difficulty_bits_per_byte(hard)
    diff = {"a": 1.0, "b": 3.0, "c": 2.0, "d": 5.0, "e": 4.0, "f": 0.5}
    tiers = dom.assign_tiers(diff)
    assert tiers == {"f": "easy", "a": "easy", "c": "medium", "b": "medium", "e": "hard",
                     "d": "hard"}  # fmt: skip
    rank = {"easy": 0, "medium": 1, "hard": 2}
    for x in diff:
        for y in diff:
            if diff[x] < diff[y]:
                assert rank[tiers[x]] <= rank[tiers[y]]


def test_the_three_ensembles_cost_the_same_compute():
    tiers = {"a": "easy", "b": "easy", "c": "medium", "d": "medium", "e": "hard", "f": "hard"}
    configs = {s: ex.size_config(CFG, s, WIDTHS) for s in WIDTHS}
    costs = {k: ex.compute(ex.plan_ensemble(k, tiers, 150, 75), configs) for k in ex.ENSEMBLES}
    m = models.param_count(configs["M"], non_embedding=True)
    assert costs == {k: 6 * 150 * m for k in ex.ENSEMBLES}
    steps = {p.tier: p.steps for p in ex.plan_ensemble("M_Ho-I_He", tiers, 150, 75)}
    assert steps == {"easy": 75, "medium": 150, "hard": 225}
    sizes = {p.tier: p.size for p in ex.plan_ensemble("M_He-I_Ho", tiers, 150, 75)}
    assert sizes == {"easy": "S", "medium": "M", "hard": "L"}
    # With more hard than easy domains the heterogeneous ensembles would cost more compute
    # than the homogeneous one (the accounting is computed, not assumed): refused.
    lopsided = {**tiers, "g": "hard"}
    unequal = [ex.ExpertPlan(d, t, "M", 150 + {"easy": -75, "medium": 0, "hard": 75}[t])
               for d, t in lopsided.items()]  # what M_Ho-I_He planned before
    assert ex.compute(unequal, configs) > ex.compute(
        ex.plan_ensemble("M_Ho-I_Ho", lopsided, 150, 75), configs)
    for kind in ("M_Ho-I_He", "M_He-I_Ho"):
        with pytest.raises(ValueError, match="only with as many easy as hard domains, got 2 "
                                             "easy and 3 hard of 7"):  # fmt: skip
            ex.plan_ensemble(kind, lopsided, 150, 75)


@pytest.mark.parametrize("steps", [-1, 0, 1.5, True])
def test_an_expert_plan_needs_a_step_count_of_at_least_one(steps):
    """ExpertPlan(steps=-1) was accepted and compute() counted it as negative compute."""
    with pytest.raises(ValueError, match=rf"^steps: must be an integer >= 1, got {steps!r}"):
        ex.ExpertPlan("a", "easy", "M", steps)
    assert ex.ExpertPlan("a", "easy", "M", 1).steps == 1


def _group(streams, steps, seed=0):
    graphdef, params = models.init_params(CFG, 0)
    stacked = jax.tree.map(lambda x: jnp.stack([x] * len(streams)), params)
    return ex.train_group(graphdef, stacked, streams, steps, batch=2, seq_len=16,
                          learning_rate=1e-2, seed=seed, warmup=1)  # fmt: skip


def _one_model():
    graphdef, params = models.init_params(CFG, 0)
    return graphdef, jax.tree.map(lambda x: x[None], params)


def _expert(params, i):
    return [np.asarray(x[i]) for x in jax.tree.leaves(params)]


def test_experts_in_one_group_train_independently_and_stop_at_their_budget():
    rng = np.random.default_rng(0)
    s0, s1, s2 = (rng.integers(1, 256, 400) for _ in range(3))
    # Equal budgets: the two experts are replicas of one program; expert 1's data never
    # reaches expert 0.
    p_a, loss_a = _group([s0, s1], [3, 3])
    p_b, _ = _group([s0, s2], [3, 3])
    for x, y in zip(_expert(p_a, 0), _expert(p_b, 0)):
        np.testing.assert_array_equal(x, y)
    assert any(not np.array_equal(x, y) for x, y in zip(_expert(p_a, 1), _expert(p_b, 1)))
    assert np.isfinite(loss_a).all()
    # Other budgets: expert 0 takes its own 3 steps whatever expert 1's budget and data.
    p_c, loss_c = _group([s0, s1], [3, 5])
    p_d, loss_d = _group([s0, s2], [3, 4])
    for x, y in zip(_expert(p_c, 0), _expert(p_d, 0)):
        np.testing.assert_array_equal(x, y)
    assert loss_c[0] == loss_d[0] and np.isfinite(loss_c).all()
    # Expert 0 trains longer here: it must differ. (Expert 1's budget is not compared; at 3
    # the two programs are the one-expert ones of 3 and 5 steps compiled above.)
    p_e, _ = _group([s0, s1], [5, 3])
    assert any(not np.array_equal(x, y) for x, y in zip(_expert(p_c, 0), _expert(p_e, 0)))


def test_one_expert_ensemble_is_that_expert_and_weights_are_normalised():
    graphdef, params = models.init_params(CFG, 1)
    windows = jnp.asarray(np.random.default_rng(1).integers(1, 256, (3, 17)), jnp.int32)
    one = jax.tree.map(lambda x: x[None], params)
    lp = ex.token_logprobs(graphdef, one, windows)
    full = ex.token_logprobs(graphdef, one, windows, full=True)
    assert lp.shape == (1, 3, 16) and full.shape == (1, 3, 16, 256)
    with pytest.raises(ValueError, match="^full: must be True or False"):  # "no": the full one
        ex.token_logprobs(graphdef, one, windows, full="no")
    np.testing.assert_allclose(jnp.exp(full).sum(-1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(
        jnp.take_along_axis(full, windows[None, :, 1:, None], axis=-1)[..., 0], lp, atol=1e-6)
    own = float(jnp.exp(-lp.mean()))
    ppl = ev.rule_perplexities(full, windows[:, 1:], lp)
    assert set(ppl) == set(ev.RULES)
    assert all(abs(v - own) < 1e-4 * own for v in ppl.values())
    two = jnp.concatenate([lp, lp - 1.0])  # the second expert is uniformly worse
    w0, w1 = ev.posterior_weight_on(two, 0), ev.posterior_weight_on(two, 1)
    assert abs(w0 + w1 - 1) < 1e-6 and w0 > 0.99
    for bad in (2, 7, -1, 0.0, True):  # a JAX index would clamp 2 and 7 to expert 1
        with pytest.raises(ValueError, match=r"^expert must be an integer in \[0, 2\)"):
            ev.posterior_weight_on(two, bad)


def test_rules_on_two_tiny_experts_differ_and_posterior_finds_the_domain_expert():
    # Expert 0 is trained on a repetitive stream; expert 1 is the untrained model.
    stream = np.tile(np.arange(1, 9), 60)
    graphdef, params = models.init_params(CFG, 0)
    trained, _ = ex.train_group(graphdef, jax.tree.map(lambda x: x[None], params), [stream], [30],
                                batch=4, seq_len=16, learning_rate=1e-2, seed=0, warmup=1)
    both = jax.tree.map(lambda a, b: jnp.stack([a[0], b]), trained, params)
    windows = jnp.asarray(np.stack([stream[i: i + 17] for i in (0, 40, 80)]), jnp.int32)
    full = ex.token_logprobs(graphdef, both, windows, full=True)
    lp = ex.token_logprobs(graphdef, both, windows)
    ppl = ev.rule_perplexities(full, windows[:, 1:], lp)
    expert = float(jnp.exp(-lp[0].mean()))
    assert ppl["posterior"] < ppl["uniform"] and ppl["dev_prior"] <= ppl["posterior"] * 1.001
    assert ppl["dev_prior"] < 1.5 * expert  # the dev prior puts almost all weight on expert 0
    assert ev.posterior_weight_on(lp, 0) > 0.9


def test_ngram_reference_model_measures_difficulty():
    rng = np.random.default_rng(0)
    easy, hard = dom.markov_text(30_000, 2), dom.markov_text(30_000, 12)
    e, h = (dom.ngram_bits_per_byte(t[:25_000], t[25_000:], order=1) for t in (easy, hard))
    assert abs(e - 1.0) < 0.05 and abs(h - np.log2(12)) < 0.1  # order 1 = the true order
    e3, h3 = (dom.ngram_bits_per_byte(t[:25_000], t[25_000:]) for t in (easy, hard))
    assert e3 < h3  # longer contexts overfit a little, but keep the order
    assert dom.ngram_bits_per_byte("ab" * 500, "ab" * 50) < 0.05
    noise = "".join(map(chr, rng.integers(97, 97 + 16, 20_000)))
    assert abs(dom.ngram_bits_per_byte(noise, noise[:2000], order=0) - 4.0) < 0.05
    diff = {d.name: dom.ngram_bits_per_byte(d.train, d.dev)
            for d in dom.make_domains(LOCAL, (), num_chars=20_000)}  # fmt: skip
    tiers = dom.assign_tiers(diff)
    assert tiers["markov_b3"] == "easy"  # entropy log2(3) = 1.58 bits, lowest by construction


def test_windows_cover_every_start_including_the_last():
    # randint's high is exclusive: the window ending at the stream's last token was never drawn,
    # and a stream of exactly seq_len + 1 tokens (one window) was refused.
    stream, seq_len = np.arange(12), 8  # starts 0..3
    w = ex._draw_windows(stream, jax.random.key(0), steps=50, batch=4, seq_len=seq_len)
    assert sorted(set(w[..., 0].ravel().tolist())) == [0, 1, 2, 3]
    assert (w[..., -1] == w[..., 0] + seq_len).all()
    one = ex._draw_windows(np.arange(9), jax.random.key(0), steps=2, batch=2, seq_len=seq_len)
    assert (one == np.arange(9)).all()


@pytest.mark.parametrize("call,match", [
    (lambda: dom.make_domains(("nope",), ()), "domains: unknown"),
    (lambda: dom.make_domains(("arithmetic",), ("arithmetic",)), "both trained and held out"),
    (lambda: dom.make_domains(("arithmetic",), (), num_chars=10), "num_chars"),
    (lambda: dom.make_domains(("arithmetic", "markov_b3", "arithmetic"), ()),
     r"domains: \['arithmetic'\] named more than once"),
    (lambda: dom.make_domains(("arithmetic",), ("dna", "dna")), r"\['dna'\] named more than once"),
    (lambda: dom.markov_text(10, 0), "branching"),
    (lambda: dom.assign_tiers({"a": 1.0}), "at least 3"),
    (lambda: dom.ngram_bits_per_byte("ab", "ab", order=9), "order"),
    (lambda: dom.ngram_bits_per_byte("", "ab"), "non-empty"),
    (lambda: ev.rule_perplexities(jnp.zeros((1, 2, 3, 4)), jnp.zeros((2, 4), int),
                                  jnp.zeros((1, 2, 3))), "targets_WxT"),
    (lambda: ev.rule_perplexities(jnp.zeros((1, 2, 3, 4)), jnp.zeros((2, 3), int),
                                  jnp.zeros((2, 2, 3))), "logp_dev_KxWxT"),
    # No windows (a split shorter than seq_len + 1): NaN for every rule, or a prior_K error.
    (lambda: ev.rule_perplexities(jnp.zeros((1, 0, 3, 4)), jnp.zeros((0, 3), int),
                                  jnp.zeros((1, 2, 3))), "logp_test_KxWxTxV must hold W >= 1"),
    (lambda: ev.rule_perplexities(jnp.zeros((1, 2, 3, 4)), jnp.zeros((2, 3), int),
                                  jnp.zeros((1, 0, 3))), r"logp_dev_KxWxT must be \[K=1, W >= 1"),
    (lambda: ex.plan_ensemble("big", {"a": "easy"}, 10, 2), "kind"),
    (lambda: ex.plan_ensemble("M_Ho-I_He", {"a": "easy"}, 10, 10), "delta"),
    # A bool or float delta or steps was planned (True as 1, 2.5 as fractional step budgets).
    (lambda: ex.plan_ensemble("M_Ho-I_He", {"a": "easy"}, 10, True), "delta: must be an integer"),
    (lambda: ex.plan_ensemble("M_Ho-I_He", {"a": "easy"}, 10, 2.5), "delta: must be an integer"),
    (lambda: ex.plan_ensemble("M_Ho-I_He", {"a": "easy"}, 10.0, 2), "steps: must be an integer"),
    (lambda: ex.plan_ensemble("M_Ho-I_Ho", {"a": "easy"}, 0, 0), "steps: must be an integer >= 1"),
    (lambda: ex.size_config(CFG, "XL", WIDTHS), "size"),
    (lambda: _group([np.arange(100)], [0]), "steps_K"),
    (lambda: _group([np.arange(10)], [1]), "streams"),
    # Ids outside the vocabulary trained silently (negative ids wrap; larger ones give NaN).
    (lambda: _group([np.arange(100), -np.arange(100)], [1, 1]),
     r"streams\[1\] must hold token ids in \[0, 256\).*from -99 to 0"),
    (lambda: _group([np.arange(200, 300)], [1]), r"streams\[0\] must hold token ids in \[0, 256\)"),
    # A model the stack lacks was a clamped copy of the last one; NaN difficulties misordered
    # the tiers; an unknown tier was a KeyError; a float budget was truncated.
    (lambda: ex.train_group(*_one_model(), [np.arange(100)] * 2, [2, 2], batch=2, seq_len=8,
                            learning_rate=1e-2, seed=0), r"params_K must stack 2 models"),
    (lambda: _group([np.arange(100)], [2.7]), "steps_K"),
    (lambda: ex.train_group(*_one_model(), [], [], batch=2, seq_len=8, learning_rate=1e-2,
                            seed=0), "streams must hold at least one"),
    (lambda: ex.train_group(*_one_model(), [np.arange(100)], [2], batch=0, seq_len=8,
                            learning_rate=1e-2, seed=0), "batch"),
    (lambda: ex.train_group(*_one_model(), [np.arange(100)], [2], batch=2, seq_len=8,
                            learning_rate=float("nan"), seed=0), "learning_rate"),
    (lambda: dom.assign_tiers({"a": 1.0, "b": float("nan"), "c": 0.5}), "difficulty must be finite"),
    (lambda: ex.plan_ensemble("M_Ho-I_Ho", {"a": "extreme"}, 10, 2), "tiers must map"),
])  # fmt: skip
def test_bad_input_names_the_field(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_hdee_experiment_vocab_size_0_takes_the_tokenizers():
    """experiments/hdee.py passed model.vocab_size straight to the preset: 0 (the trainer's
    'take the tokenizer's') died in LlamaConfig; a padded (larger) table is kept."""
    import ml_collections  # noqa: PLC0415

    from experiments.hdee import base_config  # noqa: PLC0415

    def config(vocab):
        return ml_collections.ConfigDict({"model": {"preset": "nano", "vocab_size": vocab},
                                          "seq_len": 32})  # fmt: skip

    assert base_config(config(0), 256).vocab_size == 256
    assert base_config(config(384), 256).vocab_size == 384
    with pytest.raises(ValueError, match=r"config\.model\.vocab_size=100 is smaller than the "
                                         r"byte tokenizer's vocabulary of 256"):  # fmt: skip
        base_config(config(100), 256)
