"""Config files load, and bad settings are refused with errors naming the field."""

import importlib.util
import pathlib
import re

import jax
import numpy as np
import pytest

from noloco_jax import defaults
from noloco_jax.trainer import settings as settings_lib
from noloco_jax.trainer.optimizer import learning_rate_schedule

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG_FILES = sorted(
    p for p in (ROOT / "configs").glob("*.py") if p.stem not in ("__init__", "common", "paper")
)


def load_config(path: pathlib.Path, arg: str | None = None):
    spec = importlib.util.spec_from_file_location(f"_cfg_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg) if arg is not None else module.get_config()


NON_TRAINING = {"quadratic_theory", "exp_hdee"}  # configs not run by the trainer
TRAINING_FILES = [p for p in CONFIG_FILES if p.stem not in NON_TRAINING]


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.stem)
def test_every_config_loads(path):
    assert len(load_config(path)) > 0


@pytest.mark.parametrize("path", TRAINING_FILES, ids=lambda p: p.stem)
def test_every_training_config_validates(path):
    settings = settings_lib.from_config(load_config(path))
    assert settings.global_batch_size % settings.num_replicas == 0


@pytest.mark.parametrize("method", ["noloco", "diloco", "dp"])
def test_paper_configs_follow_the_paper(method):
    s = settings_lib.from_config(load_config(ROOT / "configs" / "paper_small.py", method))
    assert s.method == method and s.model.preset == "small"
    assert (s.optim.learning_rate, s.optim.warmup_steps, s.num_steps) == (6e-4, 1000, 25_000)
    assert s.global_batch_size * s.data.seq_len == 524_288 and s.optim.clip_norm == 1.0
    assert s.outer.learning_rate == 0.7
    if method == "diloco":
        assert (s.outer.sync_every, s.outer.momentum) == (100, 0.3)
    else:
        assert (s.outer.sync_every, s.outer.momentum) == (50, 0.5)
    medium = settings_lib.from_config(load_config(ROOT / "configs" / "paper_medium.py"))
    large = settings_lib.from_config(load_config(ROOT / "configs" / "paper_large.py"))
    assert medium.global_batch_size * 1024 == 1_048_576 and large.optim.learning_rate == 1.2e-4


@pytest.mark.parametrize("method", ["noloco", "diloco", "dp"])
def test_paper_large_runs_the_papers_16_replicas(method):
    """Table 2 runs the large model only at DP = 16 (the reference's 7b configs: dp_world_size
    16, batch_size 128); paper_large defaulted to 8 replicas of 256 sequences."""
    s = settings_lib.from_config(load_config(ROOT / "configs" / "paper_large.py", method))
    assert (s.num_replicas, s.batch_per_replica, s.data.seq_len) == (16, 128, 1024)


def _tiny(**overrides):
    cfg = load_config(ROOT / "configs" / "tiny_noloco.py")
    for dotted, value in overrides.items():
        node = cfg
        *path, leaf = dotted.split(".")
        for p in path:
            node = node[p]
        node[leaf] = value
    return cfg


@pytest.mark.parametrize(
    "overrides,field",
    [
        ({"method": "sgd"}, "config.method"),
        ({"backend": "pmap"}, "config.backend"),
        ({"global_batch_size": 60}, "config.global_batch_size"),
        ({"num_replicas": 0}, "config.num_replicas"),
        ({"num_replicas": 6, "global_batch_size": 60, "outer.group_size": 4}, "config.outer.group_size"),
        ({"outer.group_size": 1}, "config.outer.group_size"),
        ({"eval_every": 30}, "config.eval_every"),
        ({"model.dtype": "float16"}, "config.model.dtype"),
        ({"model.num_layers": -1}, "config.model.num_layers"),
        ({"data.source": "web"}, "config.data.source"),
        ({"data.source": "files"}, "config.data.path"),
        ({"data.source": "tfds"}, "config.data.tfds_name"),
        ({"data.source": "tfds", "data.tfds_name": "c4", "data.max_documents": -1},
         "config.data.max_documents"),
        ({"data.max_documents": 5}, "config.data.max_documents: applies to data.source='tfds'"),
        ({"data.path": "/my/corpus.txt"}, "config.data.path: applies to data.source='files'"),
        ({"model.init_from": "/hf", "model.num_kv_heads": 1}, "config.model.num_kv_heads: comes "
         "from the checkpoint's config.json"),  # it was ignored
        ({"model.init_from": "/hf", "model.tie_embeddings": True}, "config.model.tie_embeddings"),
        ({"data.tfds_name": "lm1b"}, "config.data.tfds_name: applies to data.source='tfds'"),
        ({"data.tokenizer": "tiktoken"}, "config.data.tokenizer"),
        ({"data.validation_fraction": 1.5}, "config.data.validation_fraction"),
        ({"data.encoding": "base64"}, "config.data.encoding"),  # a codec, not a text encoding
        ({"data.encoding": "zlib"}, "config.data.encoding"),
        ({"data.encoding": "latin-1"}, "config.data.encoding: applies to data.source='files'"),
        ({"data.tokenizer": "hf", "data.tokenizer_path": "/tok", "data.tokenizer_vocab_size": 512},
         "config.data.tokenizer_vocab_size: the hf tokenizer's size comes from"),
        ({"data.validation_fraction": 0.2}, "config.data.validation_fraction: applies to "
         "data.source='files'"),  # both were ignored for the other sources
        ({"data.tokenizer_path": "/tok"}, "config.data.tokenizer_path: applies to "
         "data.tokenizer='hf'"),  # the byte tokenizer trained and nothing said so
        ({"optim.learning_rate": -1.0}, "config.optim.learning_rate"),
        ({"optim.warmup_steps": 10_000}, "config.optim.warmup_steps"),
        ({"optim.b2": 1.0}, "config.optim.b2"),
        ({"outer.sync_every": 0}, "config.outer.sync_every"),
        ({"outer.momentum": -0.1}, "config.outer.momentum"),
        ({"outer.gamma": -0.5}, "config.outer.gamma"),
        ({"outer.exchange_dtype": "int4"}, "config.outer.exchange_dtype"),
        ({"outer.error_feedback": True}, "config.outer.error_feedback"),
        ({"outer.fragments": 0}, "config.outer.fragments"),
        ({"outer.fragments": 3}, "config.outer.fragments"),  # does not divide H = 50
        ({"outer.fragments": 2, "num_stages": 2}, "config.outer.fragments"),
        ({"outer.sync_every": 10}, "config.log_every=25 and config.outer.sync_every=10"),
        ({"method": "diloco", "outer.sync_every": 30}, "config.log_every=25 and config.outer"),
        ({"fault.dropout_prob": 1.0}, "config.fault.dropout_prob"),
        ({"fault.resync_absent": True}, "config.fault.resync_absent: applies to method"),
        # These were ignored silently (DiLoCo has no gamma, dp no outer momentum, and
        # mixing acts in a delay only):
        ({"method": "diloco", "outer.sync_every": 100, "outer.gamma": 0.3},
         "config.outer.gamma: acts on NoLoCo's groups only"),
        ({"method": "dp", "outer.nesterov": True}, "config.outer.nesterov: acts on the outer"),
        # NoLoCo's group size was ignored silently (and never checked) by the other methods
        # and by a lone NoLoCo replica:
        ({"method": "diloco", "outer.sync_every": 100, "outer.group_size": 4},
         "config.outer.group_size: acts on NoLoCo's groups only, got method='diloco'"),
        ({"method": "dp", "outer.group_size": -3}, "config.outer.group_size: acts on NoLoCo's"),
        ({"method": "local", "outer.group_size": 4}, "config.outer.group_size: acts on"),
        ({"num_replicas": 1, "outer.group_size": 0}, "config.outer.group_size: must be an "
         "integer >= 2, got 0"),
        ({"outer.mixing": 0.5}, "config.outer.mixing: acts on the overlapped exchange only"),
        ({"num_stages": 2, "outer.exchange_dtype": "int8"},
         "config.outer.exchange_dtype: an 8-bit exchange with pipeline stages"),
        ({"skip.num_stages": 2, "skip.path_length": 3}, "config.skip.path_length"),
        ({"optim.micro_batches": 0}, "config.optim.micro_batches"),
        ({"optim.micro_batches": 3}, "config.optim.micro_batches: must divide each replica's "
         "batch, global_batch_size / num_replicas = 4, got 3"),
        ({"optim.micro_batches": 2, "num_stages": 2}, "config.optim.micro_batches: gradient "
         "accumulation works with the plain model only"),
        ({"optim.micro_batches": 2, "skip.num_stages": 2, "skip.path_length": 1},
         "config.optim.micro_batches: gradient accumulation works with the plain model only"),
        ({"model.num_kv_heads": 3}, "config.model.num_kv_heads: must be 0"),
        ({"model.num_kv_heads": -1}, "config.model.num_kv_heads"),
    ],
)
def test_bad_settings_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        settings_lib.from_config(_tiny(**overrides))


@pytest.mark.parametrize("eps", [0.0, 1e-40, 1e-46])
def test_an_eps_that_is_zero_in_float32_is_refused(eps):
    """Adam's moments are float32: eps = 1e-40 (subnormal, flushed) or 1e-46 passed the
    eps > 0 check, was 0 there and made the unused embedding rows NaN on the first step."""
    with pytest.raises(ValueError, match=r"config\.optim\.eps: must be >= 1\.18e-38"):
        settings_lib.from_config(_tiny(**{"optim.eps": eps}))
    assert settings_lib.from_config(_tiny(**{"optim.eps": 2.0**-126})).optim.eps == 2.0**-126


@pytest.mark.parametrize("field, allowed", [("learning_rate", ""),
                                            ("clip_norm", r"0 \(no clipping\) or ")])
def test_a_rate_or_norm_that_is_zero_in_float32_is_refused(field, allowed):
    """optim.learning_rate = 1e-50 (or clip_norm = 1e-50) is 0 in the float32 step: the run
    logged learning_rate 0.0 and trained nothing, without a word."""
    for value in (1e-40, 1e-50):
        with pytest.raises(ValueError, match=rf"config\.optim\.{field}: must be {allowed}>= "
                                             r"1\.18e-38"):
            settings_lib.from_config(_tiny(**{f"optim.{field}": value}))
    ok = _tiny(**{f"optim.{field}": 2.0**-126, "optim.min_lr_ratio": 1.0,
                  "optim.warmup_steps": 0})
    assert getattr(settings_lib.from_config(ok).optim, field) == 2.0**-126


@pytest.mark.parametrize("lr, ratio", [(2.0**-126, 0.1), (2e-38, 0.5), (1e-30, 1e-9)])
def test_a_schedule_floor_that_is_zero_in_float32_is_refused(lr, ratio):
    """optim.learning_rate = 2e-38 with min_lr_ratio = 0.5 passed the learning_rate >= 1.18e-38
    check, but the cosine decayed it to 1e-38, subnormal and 0 in the float32 step: the late
    steps trained nothing, without a word."""
    with pytest.raises(ValueError, match=r"config\.optim\.min_lr_ratio: config\.optim\."
                                         r"learning_rate \* config\.optim\.min_lr_ratio must be "
                                         r"0 or >= 1\.18e-38"):
        settings_lib.from_config(_tiny(**{"optim.learning_rate": lr, "optim.min_lr_ratio": ratio}))
    for ok in (0.0, 1.0):  # decaying to 0 on purpose, or a constant rate after the warmup
        cfg = _tiny(**{"optim.learning_rate": lr, "optim.min_lr_ratio": ok,
                       "optim.warmup_steps": 0})
        assert settings_lib.from_config(cfg).optim.min_lr_ratio == ok
    low = settings_lib.from_config(_tiny(**{"optim.learning_rate": 2.0**-125,
                                            "optim.min_lr_ratio": 0.5,
                                            "optim.warmup_steps": 0}))  # fmt: skip
    assert low.optim.learning_rate * low.optim.min_lr_ratio == 2.0**-126


@pytest.mark.parametrize("lr, warmup", [(1e-37, 50), (2.0**-126, 10), (2.0**-120, 65)])
def test_a_first_warmup_rate_that_is_zero_in_float32_is_refused(lr, warmup):
    """optim.learning_rate = 1e-37 with min_lr_ratio = 1 and warmup_steps = 50 passed the rate
    and floor checks, but the warmup's first rate 1e-37 / 50 is subnormal, 0 in float32; under
    jit every warmup step got 0 and trained nothing, without a word."""
    with pytest.raises(ValueError, match=r"config\.optim\.warmup_steps: config\.optim\."
                                         r"learning_rate / config\.optim\.warmup_steps \(the "
                                         r"first warmup step's rate\) must be >= 1\.18e-38"):
        settings_lib.from_config(_tiny(**{"optim.learning_rate": lr, "optim.min_lr_ratio": 1.0,
                                          "optim.warmup_steps": warmup}))  # fmt: skip
    for ok in (0, 1):  # no warmup, or a warmup whose first rate is learning_rate itself
        cfg = _tiny(**{"optim.learning_rate": lr, "optim.min_lr_ratio": 1.0,
                       "optim.warmup_steps": ok})
        assert settings_lib.from_config(cfg).optim.warmup_steps == ok
    edge = settings_lib.from_config(_tiny(**{"optim.learning_rate": 2.0**-120,
                                             "optim.min_lr_ratio": 1.0,
                                             "optim.warmup_steps": 64}))  # fmt: skip
    schedule = jax.jit(learning_rate_schedule(edge.optim, edge.num_steps))
    assert float(schedule(0)) == 2.0**-126  # the smallest accepted first rate is not 0


@pytest.mark.parametrize("field", ["learning_rate", "gamma"])
def test_an_outer_rate_that_is_zero_in_float32_is_refused(field):
    """outer.learning_rate = 1e-40 passed (it is >= 0) and was 0 in the float32 sync step: the
    slow weights never moved, without the warning that outer.learning_rate = 0 gets."""
    with pytest.raises(ValueError, match=rf"config\.outer\.{field}: must be 0 or >= 1\.18e-38"):
        settings_lib.from_config(_tiny(**{f"outer.{field}": 1e-40}))
    for ok in (0.0, 2.0**-126):
        assert getattr(settings_lib.from_config(_tiny(**{f"outer.{field}": ok})).outer, field) == ok


@pytest.mark.parametrize("field", ["num_steps", "outer.sync_every", "fault.inject_nan_step",
                                   "skip.full_every", "log_every"])
def test_step_counts_past_int32_are_refused(field):
    """outer.sync_every or fault.inject_nan_step = 2**31 passed validation and the run stopped
    at its first compiled step with a JAX OverflowError traceback (the step counter is int32)."""
    with pytest.raises(ValueError, match=rf"config\.{re.escape(field)}: must be an integer in "
                       r"\[-?\d, 2\*\*31 - 1 \(the int32 step counter\)\], got 2147483648"):
        settings_lib.from_config(_tiny(**{field: 2**31}))
    sync = 25 * (2**31 // 25)  # the largest multiple of log_every=25 that fits
    top = settings_lib.from_config(_tiny(**{"outer.sync_every": sync,
                                            "fault.inject_nan_step": 2**31 - 1}))
    assert (top.outer.sync_every, top.fault.inject_nan_step) == (sync, 2**31 - 1)


def test_the_group_size_of_a_lone_noloco_replica_is_warned():
    s = settings_lib.from_config(_tiny(num_replicas=1, **{"outer.group_size": 4}))
    assert settings_lib.warnings_for(s) == [
        "config.outer.group_size=4 ignored with num_replicas=1: a lone replica exchanges nothing "
        "(no partner, no drop-out, no 8-bit message); use num_replicas >= 2 to train with it."]


@pytest.mark.parametrize("method", ["dp", "local"])
def test_outer_settings_without_outer_rounds_are_warned(method):
    """dp and local never read outer.*: a "dp with momentum 0.9" run was plain dp, silently."""
    s = settings_lib.from_config(_tiny(method=method, **{"outer.momentum": 0.9}))
    assert [w for w in settings_lib.warnings_for(s) if "no outer rounds" in w] == [
        f"config.outer.momentum=0.9 ignored with method={method!r}: "
        f"it has no outer rounds (outer.* acts on 'noloco' and 'diloco' only)."]
    for rounds in ("noloco", "diloco"):  # they read them: nothing to say
        assert not any("no outer rounds" in w for w in settings_lib.warnings_for(
            settings_lib.from_config(_tiny(method=rounds, **{"outer.momentum": 0.9}))))


def test_a_preset_given_with_init_from_is_warned():
    """The checkpoint's config.json gives the shape: preset='small' was dropped silently."""
    warned = "config.model.preset='small' is ignored with config.model.init_from"
    s = settings_lib.from_config(_tiny(**{"model.init_from": "/hf", "model.preset": "small"}))
    assert any(warned in w for w in settings_lib.warnings_for(s))
    for overrides in ({"model.init_from": "/hf"}, {"model.preset": "small"}):
        s = settings_lib.from_config(_tiny(**overrides))
        assert not any("is ignored with config.model.init_from" in w
                       for w in settings_lib.warnings_for(s))


def test_a_pool_size_with_fixed_routing_is_warned():
    """routing='fixed' keeps the identity at every boundary: the pool size did nothing, silently."""
    warned = "config.routing_pool_size=7 is ignored with routing='fixed'"
    fixed = settings_lib.from_config(_tiny(num_stages=2, routing="fixed", routing_pool_size=7))
    assert any(warned in w for w in settings_lib.warnings_for(fixed))
    for overrides in ({"routing": "fixed"}, {"routing_pool_size": 7}):
        staged = settings_lib.from_config(_tiny(num_stages=2, **overrides))
        assert not any("is ignored with routing='fixed'" in w
                       for w in settings_lib.warnings_for(staged))


@pytest.mark.parametrize("overrides", [{"routing": "fixed"}, {"routing_pool_size": 7}])
def test_routing_without_pipeline_stages_is_warned(overrides):
    warned = "config.routing / routing_pool_size are ignored without pipeline stages"
    lone = settings_lib.warnings_for(settings_lib.from_config(_tiny(**overrides)))
    staged = settings_lib.warnings_for(settings_lib.from_config(_tiny(num_stages=2, **overrides)))
    assert any(warned in w for w in lone) and not any(warned in w for w in staged)
    assert not any(warned in w for w in settings_lib.warnings_for(
        settings_lib.from_config(_tiny())))  # the defaults: nothing to say


@pytest.mark.parametrize("table,field", [("skip", "swaps"), ("model", "tie_embeddings"),
                                         ("outer", "nesterov"), ("outer", "error_feedback")])
def test_a_bool_field_given_as_text_in_a_plain_dict_is_refused(table, field):
    """A ConfigDict keeps a field's type, a plain dict does not: "false" turned swaps on."""
    plain = {"model": {"preset": "nano"}, "skip": {"num_stages": 2, "path_length": 2}}
    plain.setdefault(table, {})[field] = "false"
    with pytest.raises(ValueError, match=rf"config\.{table}\.{field}: "):
        settings_lib.from_config(plain)


@pytest.mark.parametrize("table,field", [("model", "init_from"), ("data", "data_dir"),
                                         ("data", "path"), ("log", "wandb_project"),
                                         ("log", "wandb_run_name")])  # fmt: skip
def test_a_text_field_given_as_a_number_in_a_plain_dict_is_refused(table, field):
    """from_config, which "validates every field", accepted model.init_from=5 and the like
    from a plain dict (a ConfigDict keeps the string type; the CLI was safe)."""
    plain = {"model": {"preset": "nano"}, "data": {"source": "files", "path": "corpus"}}
    plain.setdefault(table, {})[field] = 5
    with pytest.raises(ValueError, match=rf"config\.{table}\.{field}: must be a string, got 5"):
        settings_lib.from_config(plain)


@pytest.mark.parametrize("field,value,match", [
    ("momentum", np.float64(1.5), r"must be in \[0, 1\)"),
    ("learning_rate", np.float64("nan"), "must be a finite number"),
    ("gamma", np.float64(-1.0), "must be a finite number"),
])  # fmt: skip
def test_an_outer_rate_given_as_a_numpy_scalar_is_checked(field, value, match):
    """np.float64 is a float (a ConfigDict takes it, e.g. from np.linspace); it was taken for an
    array on the device and not checked: momentum 1.5 or a NaN rate trained."""
    with pytest.raises(ValueError, match=rf"config\.outer\.{field}: {match}"):
        settings_lib.from_config(_tiny(**{f"outer.{field}": value}))


@pytest.mark.parametrize("log,sync,method", [(25, 50, "noloco"), (50, 25, "diloco"),
                                              (4, 4, "noloco"), (2, 3, "dp"), (2, 3, "local")])
def test_log_every_and_sync_every_must_divide_one_another(log, sync, method):
    """Methods with rounds need one of the two to divide the other; others ignore sync_every."""
    ok = _tiny(method=method, log_every=log, eval_every=100, checkpoint_every=100,
               **{"outer.sync_every": sync})
    assert settings_lib.from_config(ok).outer.sync_every == sync
    bad = _tiny(log_every=2, eval_every=4, checkpoint_every=8, **{"outer.sync_every": 3})
    with pytest.raises(ValueError, match=r"config\.log_every=2 and config\.outer\.sync_every=3 "
                                         r"must divide one another \(one a multiple of the "
                                         r"other\), e\.g\. log_every=1 or outer\.sync_every=4"):
        settings_lib.from_config(bad)
    # The suggested log_every keeps eval_every and checkpoint_every its multiples.
    with pytest.raises(ValueError, match=r"e\.g\. log_every=6 or outer\.sync_every=16"):
        settings_lib.from_config(_tiny(log_every=8, eval_every=24, checkpoint_every=48,
                                       **{"outer.sync_every": 18}))


def test_the_divide_one_another_hint_is_quick_and_within_the_step_limit():
    """The suggested log_every came from a scan of every number up to log_every (a minute for
    log_every near 10**9), and the suggested sync_every could pass the int32 limit the settings
    refuse (log_every=4, sync_every=2**31 - 2 suggested 2**31)."""
    big = dict(log_every=1_500_000_000, eval_every=1_500_000_000, checkpoint_every=1_500_000_000,
               num_steps=1_500_000_000)  # fmt: skip
    with pytest.raises(ValueError, match=r"e\.g\. log_every=500000000 or outer\.sync_every="
                                         r"1500000000:"):
        settings_lib.from_config(_tiny(**big, **{"outer.sync_every": 10**9}))
    big = dict(log_every=4, eval_every=4 * 10**8, checkpoint_every=4 * 10**8, num_steps=4 * 10**8)
    with pytest.raises(ValueError, match=r"e\.g\. log_every=2 or outer\.sync_every=2147483644:"):
        settings_lib.from_config(_tiny(**big, **{"outer.sync_every": 2**31 - 2}))


def test_num_layers_changes_the_depth_and_zero_keeps_the_preset():
    """model.num_layers = 4 deepens nano (2 blocks) at the same width; 0 keeps the preset."""
    from noloco_jax.trainer.build import model_config as _model_config  # noqa: PLC0415

    deep = settings_lib.from_config(_tiny(**{"model.preset": "nano", "model.num_layers": 4}))
    plain = settings_lib.from_config(_tiny(**{"model.preset": "nano"}))
    assert (_model_config(deep, 256).num_layers, _model_config(plain, 256).num_layers) == (4, 2)
    assert _model_config(deep, 256).hidden_size == _model_config(plain, 256).hidden_size


def test_defaults_come_from_the_one_table(monkeypatch):
    """A default changed in noloco_jax.defaults.FIELDS is what the settings (and configs) get."""
    rows = [(n, 7 if n == "outer.sync_every" else d, m) for n, d, m in defaults.FIELDS]
    monkeypatch.setattr(defaults, "FIELDS", tuple(rows))
    assert settings_lib.TrainSettings().outer.sync_every == 7
    assert settings_lib.OuterSettings(momentum=0.1).sync_every == 7
    partial = {"log_every": 7, "eval_every": 7, "checkpoint_every": 7, "outer": {"momentum": 0.1}}
    assert settings_lib.from_config(partial).outer.sync_every == 7
    assert defaults.get_config().outer.sync_every == 7


def test_a_settings_field_needs_a_row_of_the_table():
    with pytest.raises(TypeError, match=r"OuterSettings fields .*'typo'.* differ"):

        @settings_lib._table_defaults("outer")
        class OuterSettings:  # noqa: F841
            typo: int
    assert settings_lib.from_config({}) == settings_lib.TrainSettings()


def test_unknown_fields_are_refused():
    with pytest.raises(ValueError, match="unknown field"):
        settings_lib.from_config({"num_replica": 8})
    with pytest.raises(ValueError, match="unknown field"):
        settings_lib.from_config({"model": {"presett": "tiny"}})


@pytest.mark.parametrize("section,value", [("optim", 5), ("model", "tiny"),
                                           ("optim", [("learning_rate", 1.0)])])
def test_a_section_that_is_not_a_dict_is_refused(section, value):
    """A TypeError (or a list of pairs taken as the section) before."""
    with pytest.raises(ValueError, match=rf"config\.{section}: must be a section"):
        settings_lib.from_config({section: value})


def test_resume_compatibility():
    base = settings_lib.TrainSettings().to_dict()
    settings_lib.check_resume_compatible(base, {**base, "eval_every": 50})  # allowed
    with pytest.raises(ValueError, match=r"num_replicas: 8 -> 4"):
        settings_lib.check_resume_compatible(base, {**base, "num_replicas": 4})
    changed = {**base, "outer": {**base["outer"], "group_size": 4}}
    with pytest.raises(ValueError, match=r"outer\.group_size"):
        settings_lib.check_resume_compatible(base, changed)


@pytest.mark.parametrize("path", TRAINING_FILES, ids=lambda p: p.stem)
def test_every_config_builds_model_and_optimizer_abstractly(path):
    import jax

    from noloco_jax import models
    from noloco_jax.trainer.optimizer import build_optimizer

    s = settings_lib.from_config(load_config(path))
    cfg = models.get_preset(s.model.preset, vocab_size=256, dtype=s.model.dtype)
    _, params = jax.eval_shape(lambda: models.init_params(cfg, 0))
    tx = build_optimizer(s.method, s.optim, s.outer, num_steps=s.num_steps,
                         num_replicas=s.num_replicas)
    opt_state = jax.eval_shape(tx.init, params)
    assert models.count_params(params) == models.param_count(cfg)
    assert len(jax.tree.leaves(opt_state)) > len(jax.tree.leaves(params))


def test_the_exchange_dtype_help_names_every_value_the_settings_accept():
    """--help's meaning of outer.exchange_dtype lists what the settings accept ("float32" was
    accepted but not listed) and says that DiLoCo sends 16-bit params as float32 with "" (it
    said "the params' dtype": a bfloat16 DiLoCo run logged a float32 ring's bytes)."""
    meaning = {name: m for name, _, m in defaults.FIELDS}["outer.exchange_dtype"]
    for value in settings_lib.EXCHANGE_DTYPES:
        assert f'"{value}"' in meaning, value
    assert "DiLoCo: 16-bit params travel as float32" in meaning


@pytest.mark.parametrize("field,value", [
    ("data.path", "/corpus"), ("data.tfds_name", "c4"), ("data.max_documents", 5),
    ("data.encoding", "latin-1"), ("data.validation_fraction", 0.2),
    ("data.tokenizer_path", "/tok"),
])
def test_the_help_of_a_field_of_one_source_names_that_source(field, value):
    """A data field refused outside one source (or tokenizer) says so in its --help meaning:
    data.validation_fraction read as a fraction of any corpus's documents and data.encoding as
    that of any local text, yet both are refused unless data.source="files"."""
    with pytest.raises(ValueError, match=re.escape(f"config.{field}: applies to")) as err:
        settings_lib.from_config(_tiny(**{field: value}))
    key, *values = re.search(r"applies to data\.(\w+)=((?:'\w+'(?: or )?)+) only",
                             str(err.value)).groups()  # fmt: skip
    names = re.findall(r"'(\w+)'", values[0])
    meaning = {name: m for name, _, m in defaults.FIELDS}[field]
    assert f'{key}="{names[0]}"' in meaning, (field, meaning)
    for name in names[1:]:
        assert f'"{name}"' in meaning, (field, name, meaning)


def test_the_help_of_routing_pool_size_names_the_device_mesh_cap():
    """--help gave routing_pool_size no upper bound, but random routing on the (replica, stage)
    device mesh refuses a pool above build.MAX_MESH_ROUTING_POOL."""
    from noloco_jax.trainer import build  # noqa: PLC0415

    cap = build.MAX_MESH_ROUTING_POOL
    s = settings_lib.from_config(_tiny(num_stages=2, backend="shard_map",
                                       routing_pool_size=cap + 1))  # fmt: skip
    with pytest.raises(ValueError, match=rf"^config\.routing_pool_size: must be in \[1, {cap}\]"):
        build._check_mesh_pool(s)
    meaning = {name: m for name, _, m in defaults.FIELDS}["routing_pool_size"]
    assert f"device mesh takes at most {cap} (vmap: 2**20)" in meaning, meaning
    # vmap took any size: 10**9 rows were drawn one by one on the host (an hour, 64 GB).
    assert settings_lib.from_config(_tiny(routing_pool_size=2**20)).routing_pool_size == 2**20
    with pytest.raises(ValueError, match=r"^config\.routing_pool_size: must be an integer in "
                                         r"\[1, 2\*\*20 = 1048576\], got 1000000000"):
        settings_lib.from_config(_tiny(routing_pool_size=10**9))


@pytest.mark.parametrize("tokenizer,good,bad", [
    ("byte", (0, 256), (255, 257)), ("sentencepiece", (259,), (0, 258)), ("hf", (0,), (512,)),
])
def test_tokenizer_vocab_size_bounds_are_those_of_the_readme(tokenizer, good, bad):
    """README's bad-input row listed the byte and sentencepiece bounds of
    data.tokenizer_vocab_size but not that the hf tokenizer refuses any but 0."""
    extra = {"data.tokenizer_path": "/tok"} if tokenizer == "hf" else {}
    for size in good:
        settings_lib.from_config(_tiny(**{"data.tokenizer": tokenizer, **extra,
                                          "data.tokenizer_vocab_size": size}))  # fmt: skip
    for size in bad:
        with pytest.raises(ValueError, match=r"^config\.data\.tokenizer_vocab_size: "):
            settings_lib.from_config(_tiny(**{"data.tokenizer": tokenizer, **extra,
                                              "data.tokenizer_vocab_size": size}))  # fmt: skip
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    row = next(line for line in readme.splitlines() if "a `data.tokenizer_vocab_size` the" in line)
    assert f"{tokenizer}: " in row, row


def test_the_readme_names_the_configs_that_keep_one_checkpoint():
    """README said only the tiny configs keep one checkpoint and "the others keep 2", but
    exp_table2.py (and exp_routing.py, exp_skippipe.py built on it) keep one too."""
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    for path in TRAINING_FILES:
        keep = load_config(path).keep_checkpoints
        family = "paper" if path.stem.startswith("paper") else path.stem.split("_")[0]
        named = {"tiny": "The tiny configs", "exp": "experiment configs (`exp_*.py`)",
                 "paper": "paper configs keep 2"}[family]  # fmt: skip
        assert named in readme, (path.stem, named)
        assert keep == (2 if family == "paper" else 1), (path.stem, keep)


def test_the_never_sync_warning_counts_the_rounds_of_streaming_fragments():
    """Fragment p syncs first at step (p + 1) H / P: with H = 8, P = 2 and 4 steps, fragment 0
    syncs (bytes are sent), but the warning said the replicas never sync (acts as 'local')."""
    def warnings(h, p):
        return settings_lib.warnings_for(settings_lib.from_config(_tiny(
            num_steps=4, log_every=2, eval_every=4, checkpoint_every=4,
            **{"optim.warmup_steps": 1, "outer.sync_every": h, "outer.fragments": p})))
    assert warnings(8, 2) == [
        "config.outer.sync_every=8 > num_steps=4: only 1 of the 2 fragments ever sync in this run "
        "(fragment k first at step (k + 1) x 4); the others stay local; use sync_every <= "
        "num_steps."]
    assert warnings(16, 2) == [
        "config.outer.sync_every / outer.fragments = 8 > num_steps=4: the replicas never sync "
        "in this run (method='noloco' acts as 'local'); use sync_every <= num_steps."]
    assert warnings(8, 1)[0].endswith("the replicas never sync in this run (method='noloco' "
                                      "acts as 'local'); use sync_every <= num_steps.")
    assert warnings(4, 2) == []


def test_a_nan_drill_past_the_last_step_is_warned():
    """fault.inject_nan_step >= num_steps never fires: the drill's run started silently."""
    def warned(step):
        s = settings_lib.from_config(_tiny(**{"fault.inject_nan_step": step}))
        return [w for w in settings_lib.warnings_for(s) if "inject_nan_step" in w]
    num_steps = settings_lib.from_config(_tiny()).num_steps
    assert warned(num_steps) == [
        f"config.fault.inject_nan_step={num_steps} >= num_steps={num_steps}: no NaN will be "
        f"injected (steps are 0-based); use a step in [0, {num_steps - 1}]."]
    assert warned(num_steps - 1) == warned(-1) == []  # the last step fires; -1 is off


def test_inner_adam_of_bf16_params_keeps_its_moments_in_float32():
    """In bfloat16, b2 * nu with b2 = 0.999 rounds back to nu: after a burst of large gradients
    nu never decayed, and later steps came out 0.38 of float32 Adam's."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from noloco_jax.trainer.optimizer import inner_optimizer  # noqa: PLC0415

    tx = inner_optimizer(settings_lib.OptimSettings(), num_steps=10_000)
    step = jax.jit(tx.update)

    def last_update(dtype):
        params = {"w": jnp.zeros((2,), dtype)}
        state = tx.init(params)
        for g in [1.0] * 10 + [0.01] * 300:
            updates, state = step({"w": jnp.full((2,), g, dtype)}, state, params)
        return float(updates["w"][0])

    np.testing.assert_allclose(last_update(jnp.bfloat16), last_update(jnp.float32), rtol=2**-8)


@pytest.mark.parametrize("decay_norms", [True, False])
def test_decay_norms_false_keeps_the_norm_scales_out_of_the_weight_decay(decay_norms):
    """optim.decay_norms=False masks AdamW's decay off the RMSNorm scales only; one step on a
    zero gradient moves just the decayed leaves, by lr * weight_decay * the leaf."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from noloco_jax import models  # noqa: PLC0415
    from noloco_jax.trainer.optimizer import inner_optimizer  # noqa: PLC0415

    _, params = models.init_params(models.get_preset("nano", vocab_size=64), 0)
    o = settings_lib.OptimSettings(learning_rate=0.5, warmup_steps=0, weight_decay=0.1,
                                   decay_norms=decay_norms)  # fmt: skip
    tx = inner_optimizer(o, num_steps=10)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zeros, tx.init(params), params)
    found = jax.tree_util.tree_flatten_with_path(updates)[0]
    assert sum("scale" in jax.tree_util.keystr(path) for path, _ in found) == 3  # 2 + final
    for (path, u), p in zip(found, jax.tree.leaves(params), strict=True):
        decayed = decay_norms or "scale" not in jax.tree_util.keystr(path)
        np.testing.assert_allclose(u, -0.5 * 0.1 * p if decayed else 0 * p, rtol=1e-6, atol=0)
    warned = "config.optim.decay_norms=False does nothing without weight decay"
    off = settings_lib.from_config(_tiny(**{"optim.decay_norms": False}))
    assert any(warned in w for w in settings_lib.warnings_for(off))


@pytest.mark.parametrize("value", ["bfloat16", "float16", "fp32", "f32"])
def test_outer_slow_dtype_accepts_only_the_params_dtype_or_float32(value):
    with pytest.raises(ValueError, match=r"config\.outer\.slow_dtype: must be one of \['', "
                                         r"'float32'\], got '" + value + "'"):
        settings_lib.from_config(_tiny(**{"outer.slow_dtype": value}))


@pytest.mark.parametrize("method", ["dp", "local"])
def test_outer_slow_dtype_without_outer_rounds_is_warned(method):
    s = settings_lib.from_config(_tiny(method=method, **{"outer.slow_dtype": "float32"}))
    assert settings_lib.warnings_for(s) == [
        f"config.outer.slow_dtype='float32' ignored with method={method!r}: it has no outer "
        f"rounds (outer.* acts on 'noloco' and 'diloco' only)."]


def test_outer_slow_dtype_float32_of_float32_params_is_warned():
    def warned(param_dtype):
        return settings_lib.warnings_for(settings_lib.from_config(_tiny(**{
            "outer.slow_dtype": "float32", "model.param_dtype": param_dtype})))

    assert warned("float32") == [
        "config.outer.slow_dtype='float32' does nothing with config.model.param_dtype="
        "'float32': the slow weights are already that wide (master weights are for "
        "model.param_dtype='bfloat16')."]
    assert warned("bfloat16") == []


def _master_weights_sync(method: str, exchange: str, params0: dict) -> tuple[str, float]:
    """(compiled HLO of one sync on 4 shard_map replicas with float32 slow weights, the bytes
    the trainer counts for it)."""
    import jax  # noqa: PLC0415

    from noloco_jax import hlo, replicas  # noqa: PLC0415
    from noloco_jax.trainer.optimizer import build_optimizer, bytes_sent  # noqa: PLC0415

    n, h = 4, 2
    outer = settings_lib.OuterSettings(sync_every=h, slow_dtype="float32",
                                       exchange_dtype=exchange)  # fmt: skip
    fault = settings_lib.FaultSettings(nonfinite_guard=False)
    tx = build_optimizer(method, settings_lib.OptimSettings(warmup_steps=0), outer,
                         num_steps=10, num_replicas=n, fault=fault)  # fmt: skip
    reps = replicas.make_replicas(n, backend="shard_map")
    params = reps.put(replicas.replicate(params0, n))
    state = reps.put(replicas.replicate(tx.init(params0), n))

    def sync(params, state):
        return tx.update(params, state, params, sync_step=True)

    text = hlo.compiled_text(jax.jit(reps.map(sync)), params, state)
    return text, bytes_sent(method, outer, params0, num_replicas=n, steps=h, fault=fault)


@pytest.mark.parametrize("exchange", ["", "bfloat16"])
def test_bytes_sent_counts_what_a_master_weights_sync_sends(exchange):
    """NoLoCo's "" exchange sends what the outer step holds: with float32 slow weights, theta
    travels as float32 (twice bf16's bytes), which the trainer counts; "bfloat16" sends
    theta at its own width. Checked against the compiled sync's collective-permute bytes."""
    import jax.numpy as jnp  # noqa: PLC0415

    from noloco_jax import hlo  # noqa: PLC0415

    params0 = {"w": jnp.ones((64, 8), jnp.bfloat16), "b": jnp.ones((8,), jnp.bfloat16)}
    text, counted = _master_weights_sync("noloco", exchange, params0)
    per_branch = hlo.bytes_by_computation(text, "collective-permute")  # one per matching
    assert set(per_branch.values()) == {counted} == {520 * (4 if exchange == "" else 2)}


def test_bytes_sent_counts_a_diloco_float32_wire_on_master_weights_as_its_all_reduce():
    """DiLoCo's float32 wire on float32 slow weights is the plain all-reduce (nothing to
    narrow); it was counted as the padded all-to-all + all-gather of a bf16 tree."""
    import jax.numpy as jnp  # noqa: PLC0415

    from noloco_jax import hlo  # noqa: PLC0415

    n = 4
    params0 = {"w": jnp.ones((64, 8), jnp.bfloat16), "b": jnp.ones((7,), jnp.bfloat16)}
    text, counted = _master_weights_sync("diloco", "float32", params0)
    ops = hlo.collective_ops(text)
    assert [(op.kind, op.bytes) for op in ops] == [("all-reduce", 519 * 4)]  # no padding
    assert counted == 2 * (n - 1) / n * 519 * 4  # a ring all-reduce of the float32 phi
