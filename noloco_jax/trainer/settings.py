"""Typed run settings: the one place that turns an ``ml_collections.ConfigDict`` into values.

Everything below the CLI takes these frozen dataclasses (or plain keyword
arguments), never the ConfigDict. Their defaults are the rows of
``noloco_jax.defaults.FIELDS``, the one table of defaults (the config files build
on it too). ``from_config`` validates every field and raises ``ValueError`` naming
the field and what is allowed; a rule shared with the optimizer API (group size,
fragments, drop-out, ...) is the one function of the module that needs it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any, Callable

from noloco_jax import comm, defaults, quantize
from noloco_jax.data.sources import is_text_encoding
from noloco_jax.data.tokenizers import SP_RESERVED
from noloco_jax.errors import UserError, check_bool, check_choice, check_int, check_number, require
from noloco_jax.optim.fragments import check_fragments
from noloco_jax.optim.local_steps import check_delay, check_mixing, check_sync_every
from noloco_jax.optim.noloco import (check_dropout_prob, check_error_feedback, check_momentum,
                                     check_rate)
from noloco_jax.skippipe.training import check_path_length

METHODS = ("noloco", "diloco", "dp", "local")
ROUND_METHODS = ("noloco", "diloco")  # methods with outer rounds of outer.sync_every steps
BACKENDS = ("auto", "vmap", "shard_map")
DTYPES = ("float32", "bfloat16")
EXCHANGE_DTYPES = ("", "bfloat16", "float32", "int8", "float8_e4m3fn")  # outer.exchange_dtype
SLOW_DTYPES = ("", "float32")  # outer.slow_dtype: the params' own dtype, or master weights
FLOAT32_TINY = 2.0**-126  # the smallest normal float32 (np.finfo(np.float32).tiny)
MAX_ROUTING_POOL = 2**20  # routing_pool_size on vmap (the device mesh takes at most 1024)
MAX_SEED = 2**32 - 1  # seeds reach numpy and jax.random.key; larger ones overflow there
MAX_STEP = 2**31 - 1  # step counts meet the int32 step counter in compiled code
# Settings that may change when a run resumes; any other change is refused. log_every is
# not among them: it sets the fused chunks, and a resume with other chunks is not bit-identical.
RESUMABLE = frozenset(
    {"backend", "mesh.fsdp", "mesh.tensor", "eval_every", "checkpoint_every", "keep_checkpoints",
     "data.eval_windows", "data.data_dir", "profile_steps", "log.wandb", "log.wandb_project",
     "log.wandb_run_name", "allow_resize", "model.remat", "deterministic", "optim.micro_batches"}
)  # fmt: skip

_SECTIONS: dict[str, type] = {}  # section name -> its settings class, in GROUPS order


def _table_defaults(section: str) -> Callable[[type], type]:
    """A frozen dataclass whose fields default to the ``section`` rows of ``defaults.FIELDS``.

    The defaults are read from the table at each construction, so the table is their only
    source. A field without a row, or a row without a field, is a ``TypeError`` at import.
    """
    prefix = f"{section}." if section else ""

    def wrap(cls: type) -> type:
        names = list(cls.__annotations__)
        own = [n for n in names if section or n not in _SECTIONS]
        rows = [n[len(prefix):] for n, _, _ in defaults.FIELDS if n.rpartition(".")[0] == section]
        if sorted(own) != sorted(rows):
            raise TypeError(f"{cls.__name__} fields {sorted(own)} differ from the "
                            f"{section or 'top-level'} rows of defaults.FIELDS {sorted(rows)}.")
        for name in names:
            factory = (functools.partial(defaults.default, prefix + name) if name in own
                       else _SECTIONS[name])  # fmt: skip
            setattr(cls, name, dataclasses.field(default_factory=factory))
        out = dataclasses.dataclass(frozen=True)(cls)
        if section:
            _SECTIONS[section] = out
        return out

    return wrap


@_table_defaults("model")
class ModelSettings:
    preset: str
    dtype: str
    param_dtype: str
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    tie_embeddings: bool
    remat: bool
    init_from: str


@_table_defaults("data")
class DataSettings:
    source: str
    path: str
    tfds_name: str
    max_documents: int
    data_dir: str
    encoding: str
    tokenizer: str
    tokenizer_vocab_size: int
    tokenizer_path: str
    seq_len: int
    validation_fraction: float
    eval_windows: int


@_table_defaults("optim")
class OptimSettings:
    learning_rate: float
    warmup_steps: int
    min_lr_ratio: float
    b1: float
    b2: float
    eps: float
    weight_decay: float
    decay_norms: bool
    clip_norm: float
    micro_batches: int


@_table_defaults("outer")
class OuterSettings:
    sync_every: int
    learning_rate: float
    momentum: float
    gamma: float | None
    group_size: int
    nesterov: bool
    exchange_dtype: str
    slow_dtype: str
    error_feedback: bool
    fragments: int
    delay: int
    mixing: float
    seed: int


@_table_defaults("fault")
class FaultSettings:
    dropout_prob: float
    resync_absent: bool
    nonfinite_guard: bool
    inject_nan_step: int
    inject_nan_replica: int


@_table_defaults("skip")
class SkipSettings:
    num_stages: int
    path_length: int
    full_every: int
    swaps: bool


@_table_defaults("log")
class LogSettings:
    wandb: bool
    wandb_project: str
    wandb_run_name: str


@_table_defaults("mesh")
class MeshSettings:
    fsdp: int
    tensor: int


@_table_defaults("")
class TrainSettings:
    """A run's settings; each section's fields and defaults are the rows of ``defaults.FIELDS``."""

    seed: int
    method: str
    num_replicas: int
    backend: str
    num_stages: int
    routing: str
    routing_pool_size: int
    global_batch_size: int
    num_steps: int
    log_every: int
    eval_every: int
    checkpoint_every: int
    keep_checkpoints: int
    profile_steps: str
    allow_resize: bool
    deterministic: bool
    model: ModelSettings
    data: DataSettings
    optim: OptimSettings
    outer: OuterSettings
    fault: FaultSettings
    skip: SkipSettings
    log: LogSettings
    mesh: MeshSettings

    @property
    def batch_per_replica(self) -> int:
        return self.global_batch_size // self.num_replicas

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_seed(field: str, value: Any) -> None:
    check_int(field, value, 0, MAX_SEED, "2**32 - 1")


def _check_steps(field: str, value: Any, minimum: int = 1) -> None:
    check_int(field, value, minimum, MAX_STEP, "2**31 - 1 (the int32 step counter)")


def _check_known(values: dict, cls: type, prefix: str) -> None:
    """Refuses a key of ``values`` that is not a field of ``cls`` (``prefix``: "" or "model.")."""
    known = sorted(f.name for f in dataclasses.fields(cls))
    unknown = sorted(set(values) - set(known))
    if unknown:
        where = f"fields of config.{prefix[:-1]}" if prefix else "top-level fields"
        raise UserError(f"config.{prefix}{unknown[0]}: unknown field; valid {where} are {known}.")


def validate(s: TrainSettings) -> TrainSettings:
    """Checks every field; returns ``s`` or raises ``ValueError`` naming the field."""
    _check_bools(s)
    _validate_run(s)
    _validate_model(s)
    _validate_data(s)
    _validate_optim(s.optim, s.num_steps)
    _check_micro_batches(s)
    _validate_outer(s.outer, s.method, s.num_replicas)
    flat_rounds = s.num_stages == 1 and s.method in ROUND_METHODS  # fragments and delay need it
    require(s.outer.fragments == 1 or flat_rounds, "config.outer.fragments",
            "streaming fragments need method noloco or diloco and num_stages=1.")
    require(s.outer.delay == 0 or flat_rounds, "config.outer.delay", f"the overlapped exchange "
            f"needs method noloco or diloco and num_stages=1, got method={s.method!r}, "
            f"num_stages={s.num_stages}.")  # fmt: skip
    if s.method in ROUND_METHODS:
        check_log_and_sync_every(s)
        check_delay_windows(s)
    _validate_fault(s.fault, s.num_replicas)
    # (outer.error_feedback needs an 8-bit outer.exchange_dtype, which this refuses first.)
    for field, unused in (("fault.dropout_prob", s.fault.dropout_prob != 0),
                          ("outer.exchange_dtype", s.outer.exchange_dtype != ""),
                          ("outer.nesterov", s.outer.nesterov)):  # fmt: skip
        require(not unused or s.method in ROUND_METHODS, f"config.{field}",
                f"acts on the outer rounds of method noloco or diloco only, got "
                f"method={s.method!r}; leave it at its default.")  # fmt: skip
    require(s.outer.gamma is None or s.method == "noloco", "config.outer.gamma",
            f"acts on NoLoCo's groups only (DiLoCo has no gamma), got method={s.method!r}; "
            f"leave it None.")  # fmt: skip
    require(s.outer.delay > 0 or s.outer.mixing == defaults.default("outer.mixing"),
            "config.outer.mixing", f"acts on the overlapped exchange only (config.outer.delay "
            f"> 0), got delay=0; leave it at {defaults.default('outer.mixing')}.")  # fmt: skip
    require(s.num_stages == 1 or not quantize.is_codec(s.outer.exchange_dtype),
            "config.outer.exchange_dtype", f"an 8-bit exchange with pipeline stages "
            f"(num_stages={s.num_stages}) is not supported: on the stage mesh each stage "
            f"quantises its own weights, in the simulation the whole model does, so the two "
            f"would train differently; use '' or 'bfloat16'.")  # fmt: skip
    require(not s.fault.resync_absent or s.method == "diloco", "config.fault.resync_absent",
            f"applies to method 'diloco' only (a NoLoCo replica rejoins through its group), got "
            f"method={s.method!r}.")  # fmt: skip
    _validate_skip(s.skip, s.num_stages)
    parse_profile_steps(s.profile_steps)
    require(bool(s.log.wandb_project), "config.log.wandb_project", "must not be empty.")
    require(not (s.allow_resize and s.num_stages > 1), "config.allow_resize",
            "resizing runs with pipeline stages (num_stages > 1) is not supported.")
    return s


# Free text, which no other check reads (model.init_from=5 was accepted and failed later).
_TEXT_FIELDS = ("data.path", "data.tfds_name", "data.data_dir", "data.tokenizer_path",
                "model.init_from", "log.wandb_project", "log.wandb_run_name")


def _check_bools(s: TrainSettings) -> None:
    """Every ``bool`` field is True or False (not 0, 1 or "yes"), each free-text one str or path."""
    for prefix, obj in [("", s), *((f"{n}.", getattr(s, n)) for n in _SECTIONS)]:
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if f.type in (bool, "bool"):
                check_bool(f"config.{prefix}{f.name}", value)
            elif f"{prefix}{f.name}" in _TEXT_FIELDS:
                require(isinstance(value, (str, os.PathLike)), f"config.{prefix}{f.name}",
                        f"must be a string, got {value!r} ({type(value).__name__}).")


def _validate_run(s: TrainSettings) -> None:
    check_choice("config.method", s.method, METHODS)
    check_choice("config.backend", s.backend, BACKENDS)
    check_choice("config.routing", s.routing, ("random", "fixed"))
    for name in ("num_replicas", "global_batch_size", "keep_checkpoints", "num_stages"):
        check_int(f"config.{name}", getattr(s, name))
    # The pool is drawn row by row on the host: 10**9 rows took an hour and 64 GB, unannounced.
    check_int("config.routing_pool_size", s.routing_pool_size, 1, MAX_ROUTING_POOL,
              "2**20 = 1048576")  # more bijections than a run draws
    for name in ("num_steps", "log_every", "eval_every", "checkpoint_every"):
        _check_steps(f"config.{name}", getattr(s, name))
    _check_seed("config.seed", s.seed)
    for name in ("fsdp", "tensor"):
        check_int(f"config.mesh.{name}", getattr(s.mesh, name))
    require(s.mesh.fsdp * s.mesh.tensor == 1 or (s.num_stages == 1 and s.backend != "vmap"),
            "config.mesh", f"fsdp={s.mesh.fsdp} x tensor={s.mesh.tensor} splits a replica over "
            f"devices, which needs backend 'auto' or 'shard_map' and num_stages=1, got "
            f"backend={s.backend!r}, num_stages={s.num_stages}.")  # fmt: skip
    require(s.global_batch_size % s.num_replicas == 0, "config.global_batch_size",
            f"{s.global_batch_size} is not divisible by num_replicas={s.num_replicas}.")
    for name in ("eval_every", "checkpoint_every"):
        require(getattr(s, name) % s.log_every == 0, f"config.{name}",
                f"must be a multiple of log_every={s.log_every} (steps are fused in chunks of "
                f"log_every), got {getattr(s, name)}; change either.")  # fmt: skip


def guard_acts(s: TrainSettings) -> bool:
    """Whether the non-finite guard runs: it is on, with outer rounds and 2+ replicas."""
    return s.fault.nonfinite_guard and s.method in ROUND_METHODS and s.num_replicas > 1


def check_log_and_sync_every(s: TrainSettings) -> None:
    """The chunk rule: ``log_every`` and ``outer.sync_every`` divide one another.

    Each chunk then holds whole rounds or lies inside one. The message suggests a ``log_every``
    that also divides ``eval_every`` and ``checkpoint_every``, and a ``sync_every`` that stays
    a multiple of ``outer.fragments``.

    Raises:
      UserError (a ``ValueError``): naming both fields.
    """
    log, sync = s.log_every, s.outer.sync_every
    if log % sync == 0 or sync % log == 0:
        return
    common = math.gcd(sync, s.eval_every, s.checkpoint_every)
    new_log = _largest_divisor(common, at_most=log)
    unit = math.lcm(log, s.outer.fragments)
    new_sync = max(1, min(round(sync / unit), MAX_STEP // unit)) * unit
    other = f" or outer.sync_every={new_sync}" if new_sync <= MAX_STEP else ""
    raise UserError(
        f"config.log_every={log} and config.outer.sync_every={sync} must divide one another "
        f"(one a multiple of the other), e.g. log_every={new_log}{other}: the trainer compiles "
        f"one chunk of log_every inner steps and one sync step."
    )


def _largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of ``n`` not above ``at_most``, from the divisor pairs up to
    sqrt(n) (a scan of every number up to ``at_most`` took minutes for counts near 2**31)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return max(d for q in small for d in (q, n // q) if d <= at_most)


def check_delay_windows(s: TrainSettings, stop_at: int | None = None) -> None:
    """The window rule: no chunk boundary falls inside an overlap window.

    With ``outer.delay = tau`` a round's window is the steps from t - tau - 1 to t (t a multiple
    of the round period S = sync_every / fragments). A chunk (log, eval, checkpoint, the run's
    end, ``stop_at``) must not end at t - tau .. t - 1, so gcd(log_every, S) > tau.

    Raises:
      UserError (a ``ValueError``): naming the field, its value and what is allowed.
    """
    tau, period = s.outer.delay, s.outer.sync_every // s.outer.fragments
    if tau == 0:
        return
    unit = math.gcd(s.log_every, period)
    require(unit > tau, "config.log_every", f"{s.log_every} would end chunks (logs, evals, "
            f"checkpoints) inside overlap windows: with outer.delay={tau} and rounds every "
            f"{period} steps, gcd(log_every, {period}) = {unit} must be > {tau}, e.g. "
            f"log_every={period} (or a multiple).")  # fmt: skip
    for field, step in (("config.num_steps", s.num_steps), ("stop_at", stop_at)):
        if step is None or step % period < period - tau:
            continue
        end = step - step % period + period  # the merge that ends the window
        raise UserError(f"{field}={step} ends inside an overlap window: with outer.delay={tau} "
                        f"and rounds every {period} steps, {field.rpartition('.')[2]} mod "
                        f"{period} must not be in [{period - tau}, {period - 1}], e.g. "
                        f"{end - tau - 1} or {end}.")  # fmt: skip


def _validate_model(s: TrainSettings) -> None:
    from noloco_jax.models.presets import PRESETS, preset_names  # noqa: PLC0415

    check_choice("config.model.preset", s.model.preset, tuple(preset_names()))
    check_int("config.model.num_kv_heads", s.model.num_kv_heads, minimum=0)
    heads = PRESETS[s.model.preset]["num_heads"]
    require(bool(s.model.init_from) or heads % max(s.model.num_kv_heads, 1) == 0,
            "config.model.num_kv_heads", f"must be 0 (= num_heads) or a divisor of preset "
            f"{s.model.preset!r}'s num_heads={heads}, got {s.model.num_kv_heads}.")
    check_choice("config.model.dtype", s.model.dtype, DTYPES)
    check_choice("config.model.param_dtype", s.model.param_dtype, DTYPES)
    check_int("config.model.vocab_size", s.model.vocab_size, minimum=0)
    check_int("config.model.num_layers", s.model.num_layers, minimum=0)
    if s.model.init_from:  # the checkpoint's config.json decides: these were ignored silently
        for field, default in (("num_layers", 0), ("num_kv_heads", 0), ("tie_embeddings", False)):
            value = getattr(s.model, field)
            require(value == default, f"config.model.{field}",
                    f"comes from the checkpoint's config.json with config.model.init_from; "
                    f"leave it at {default!r} (got {value!r}).")


def _validate_data(s: TrainSettings) -> None:
    d = s.data
    check_choice("config.data.source", d.source, ("shakespeare", "files", "tfds", "tokens"))
    require(d.source != "files" or bool(d.path), "config.data.path",
            "must name a file, directory or glob when data.source='files'.")
    require(d.source != "tokens" or bool(d.path), "config.data.path",
            "must name a directory with train.npy and validation.npy when data.source='tokens'.")
    require(d.source != "tokens" or d.tokenizer != "sentencepiece", "config.data.tokenizer",
            "sentencepiece is trained on text; data.source='tokens' needs 'byte' or 'hf'.")
    require(d.source != "tfds" or bool(d.tfds_name), "config.data.tfds_name",
            "must name a TFDS dataset when data.source='tfds'.")
    require(d.source in ("files", "tokens") or not d.path, "config.data.path",
            f"applies to data.source='files' or 'tokens' only, got data.source={d.source!r} "
            f"(it would be ignored); add --config.data.source=files to train on it.")
    require(d.source == "tfds" or not d.tfds_name, "config.data.tfds_name",
            f"applies to data.source='tfds' only, got data.source={d.source!r} (it would be "
            f"ignored); add --config.data.source=tfds.")
    check_int("config.data.max_documents", d.max_documents, minimum=0)
    require(d.source == "tfds" or d.max_documents == 0, "config.data.max_documents",
            f"applies to data.source='tfds' only, got data.source={d.source!r}.")
    check_choice("config.data.tokenizer", d.tokenizer, ("byte", "sentencepiece", "hf"))
    require(d.tokenizer != "hf" or bool(d.tokenizer_path), "config.data.tokenizer_path",
            "must name a directory holding tokenizer.json when data.tokenizer='hf'.")
    require(d.tokenizer == "hf" or not d.tokenizer_path, "config.data.tokenizer_path",
            f"applies to data.tokenizer='hf' only, got data.tokenizer={d.tokenizer!r} (it would "
            f"be ignored); add --config.data.tokenizer=hf.")  # fmt: skip
    require(is_text_encoding(d.encoding), "config.data.encoding",
            f"must be a text encoding Python knows (e.g. 'utf-8', 'latin-1'), got "
            f"{d.encoding!r}.")  # fmt: skip
    for name, minimum in (("seq_len", 1), ("eval_windows", 1), ("tokenizer_vocab_size", 0)):
        check_int(f"config.data.{name}", getattr(d, name), minimum)
    require(d.tokenizer != "byte" or d.tokenizer_vocab_size in (0, 256),
            "config.data.tokenizer_vocab_size", f"the byte tokenizer has exactly 256 ids, got "
            f"{d.tokenizer_vocab_size}; leave it 0, or set config.data.tokenizer='sentencepiece' "
            f"for another size.")  # fmt: skip
    require(d.tokenizer != "hf" or d.tokenizer_vocab_size == 0, "config.data.tokenizer_vocab_size",
            f"the hf tokenizer's size comes from its tokenizer.json (it would be ignored); leave "
            f"it 0, got {d.tokenizer_vocab_size}.")  # fmt: skip
    require(d.tokenizer != "sentencepiece" or d.tokenizer_vocab_size > SP_RESERVED,
            "config.data.tokenizer_vocab_size", f"must be > {SP_RESERVED} with "
            f"config.data.tokenizer='sentencepiece' (256 byte pieces, unk and eos are reserved), "
            f"got {d.tokenizer_vocab_size}; e.g. 4096.")  # fmt: skip
    check_number("config.data.validation_fraction", d.validation_fraction, 0, 1, open_low=True,
                 open_high=True)  # fmt: skip
    for field in ("validation_fraction", "encoding"):  # ignored by the other sources
        value = getattr(d, field)
        require(d.source == "files" or value == defaults.default(f"data.{field}"),
                f"config.data.{field}", f"applies to data.source='files' only, got "
                f"data.source={d.source!r} (it would be ignored); leave it at its default.")


def parse_profile_steps(text: Any) -> tuple[int, int] | None:
    """``"A:B"`` -> (A, B) with 0 <= A < B; ``""`` -> None; else ``ValueError``."""
    if text == "":
        return None
    parts = text.split(":") if isinstance(text, str) else []
    try:
        a, b = (int(p) for p in parts)
    except ValueError:
        a = b = -1
    require(len(parts) == 2 and 0 <= a < b, "config.profile_steps",
            f"must be 'A:B' with integers 0 <= A < B (a trace of steps [A, B)), or '' for "
            f"none; got {text!r}.")  # fmt: skip
    return a, b


def packs_replica(method: str, exchange_dtype: str) -> bool:
    """Whether the exchange sends the whole replica as one flat message: an 8-bit format
    of NoLoCo or DiLoCo (its scale blocks span leaves). On a replica split over F x T
    devices, each of them then sends all of that message, not its 1/(F x T). DiLoCo's
    16-bit wire sends each leaf alone there (``comm.all_replica_mean``), so it splits."""
    return method in ROUND_METHODS and quantize.is_codec(exchange_dtype)


def warnings_for(s: TrainSettings) -> list[str]:
    """Valid but suspicious settings, one line each (the trainer prints them at start)."""
    out = _unsynced_warnings(s)
    pool, default_pool = s.routing_pool_size, defaults.default("routing_pool_size")
    if s.num_stages == 1 and (s.routing, pool) != (defaults.default("routing"), default_pool):
        out.append("config.routing / routing_pool_size are ignored without pipeline stages "
                   "(config.num_stages=1).")
    elif s.num_stages > 1 and s.routing == "random" and pool == 1:
        out.append("config.routing_pool_size=1: the pool holds only the identity, so "
                   "routing='random' is fixed routing.")
    elif s.num_stages > 1 and s.routing == "fixed" and pool != default_pool:
        out.append(f"config.routing_pool_size={pool} is ignored with routing='fixed': every "
                   f"stage boundary keeps the identity.")
    out += _skip_warnings(s.skip)
    named = (s.log.wandb_project != defaults.default("log.wandb_project"), s.log.wandb_run_name)
    if not s.log.wandb and any(named):
        out.append("config.log.wandb_project / wandb_run_name are ignored without "
                   "config.log.wandb=True (nothing is sent to Weights & Biases).")
    if s.method in ROUND_METHODS and s.outer.learning_rate == 0:
        out.append("config.outer.learning_rate=0: the slow weights never move and every sync "
                   "puts the replicas back on them, so the run learns nothing.")
    if packs_replica(s.method, s.outer.exchange_dtype) and s.mesh.fsdp * s.mesh.tensor > 1:
        out.append(f"config.outer.exchange_dtype={s.outer.exchange_dtype!r} with a split replica "
                   f"(config.mesh): this exchange packs the replica into one flat message, so "
                   f"each of its {s.mesh.fsdp * s.mesh.tensor} devices sends all of it, not "
                   f"1/(fsdp x tensor); bfloat16 keeps the split.")  # fmt: skip
    rows, fsdp = s.batch_per_replica // s.optim.micro_batches, s.mesh.fsdp
    if s.optim.micro_batches > 1 and rows % fsdp and s.batch_per_replica % fsdp == 0:
        out.append(f"config.optim.micro_batches={s.optim.micro_batches} leaves {rows} "
                   f"sequence(s) per slice, which mesh.fsdp={fsdp} does not divide: every device "
                   f"of a replica computes whole slices; choose micro_batches so that fsdp divides "
                   f"global_batch_size / num_replicas / micro_batches.")  # fmt: skip
    out += _unused_warnings(s)
    if not s.optim.decay_norms and s.optim.weight_decay == 0:
        out.append("config.optim.decay_norms=False does nothing without weight decay "
                   "(config.optim.weight_decay=0); set weight_decay > 0 for it to act.")
    if s.model.init_from and s.model.preset != defaults.default("model.preset"):
        out.append(f"config.model.preset={s.model.preset!r} is ignored with config.model."
                   f"init_from: the checkpoint's config.json gives the model's shape.")
    window = parse_profile_steps(s.profile_steps)
    if window is not None and window[0] >= s.num_steps:
        out.append(f"config.profile_steps={s.profile_steps!r} starts at or after num_steps="
                   f"{s.num_steps}: no trace will be written.")
    return out


def _skip_warnings(k: SkipSettings) -> list[str]:
    """Stage-skipping settings that do nothing, or leave stages untrained."""
    out = []
    if k.num_stages == 0 and (k.path_length or k.full_every):
        out.append("config.skip.path_length / full_every are ignored without "
                   "config.skip.num_stages (stage skipping is off).")
    if k.swaps and (k.num_stages == 0 or k.path_length < 3):
        out.append("config.skip.swaps=True does nothing: a swap needs stage skipping "
                   "(config.skip.num_stages) and two stages after stage 0 (path_length >= 3).")
    if k.num_stages and k.path_length == 1 and k.full_every == 0:
        rest = "stage 1 is" if k.num_stages == 2 else f"stages 1 to {k.num_stages - 1} are"
        out.append(f"config.skip.path_length=1 with full_every=0: every sequence runs stage 0 "
                   f"alone, so {rest} never trained (evaluation runs them at their initial "
                   f"weights). Raise path_length or set skip.full_every.")
    return out


def _unsynced_warnings(s: TrainSettings) -> list[str]:
    """Rounds that never come: fragment p syncs first at step (p + 1) H / P (P = 1: at H)."""
    h, p, steps = s.outer.sync_every, s.outer.fragments, s.num_steps
    if s.method not in ROUND_METHODS or h <= steps:
        return []
    if h // p > steps:
        period = (f"config.outer.sync_every={h}" if p == 1
                  else f"config.outer.sync_every / outer.fragments = {h // p}")  # fmt: skip
        return [f"{period} > num_steps={steps}: the replicas never sync in this run "
                f"(method={s.method!r} acts as 'local'); use sync_every <= num_steps."]
    synced = steps // (h // p)
    return [f"config.outer.sync_every={h} > num_steps={steps}: only {synced} of the {p} "
            f"fragments ever sync in this run (fragment k first at step (k + 1) x {h // p}); "
            f"the others stay local; use sync_every <= num_steps."]


# What only acts on the exchange between replicas: a single replica has no partner.
_EXCHANGE_FIELDS = ("outer.exchange_dtype", "outer.error_feedback", "outer.gamma",
                    "outer.group_size", "fault.dropout_prob", "fault.resync_absent")


def _changed_fields(s: TrainSettings, fields: Any) -> list[str]:
    """``config.<field>=<value>`` for each dotted ``section.name`` of ``fields`` off its default."""
    values = {f: getattr(getattr(s, f.split(".")[0]), f.split(".")[1]) for f in fields}
    return [f"config.{f}={v!r}" for f, v in values.items() if v != defaults.default(f)]


def _unused_warnings(s: TrainSettings) -> list[str]:
    """Settings the run never acts on (each was silent before): exchange settings of a lone
    replica, outer.* without outer rounds, a NaN drill past the last step, and master weights
    (``outer.slow_dtype``) as wide as the params, which is the run without them, bit for bit."""
    out, rounds = [], s.method in ROUND_METHODS
    lone = _changed_fields(s, _EXCHANGE_FIELDS) if rounds and s.num_replicas <= 1 else []
    if lone:
        out.append(f"{', '.join(lone)} ignored with num_replicas=1: a lone replica exchanges "
                   f"nothing (no partner, no drop-out, no 8-bit message); use num_replicas >= 2 "
                   f"to train with {'them' if len(lone) > 1 else 'it'}.")  # fmt: skip
    fields = [f"outer.{f.name}" for f in dataclasses.fields(s.outer)]
    roundless = [] if rounds else _changed_fields(s, fields)
    if roundless:
        out.append(f"{', '.join(roundless)} ignored with method={s.method!r}: it has no outer "
                   f"rounds (outer.* acts on 'noloco' and 'diloco' only).")
    step = s.fault.inject_nan_step
    if step >= s.num_steps:
        out.append(f"config.fault.inject_nan_step={step} >= num_steps={s.num_steps}: no NaN will "
                   f"be injected (steps are 0-based); use a step in [0, {s.num_steps - 1}].")
    if rounds and s.outer.slow_dtype == s.model.param_dtype:
        out.append(f"config.outer.slow_dtype={s.outer.slow_dtype!r} does nothing with "
                   f"config.model.param_dtype={s.model.param_dtype!r}: the slow weights are "
                   f"already that wide (master weights are for model.param_dtype='bfloat16').")
    return out


def _validate_skip(k: SkipSettings, pipeline_stages: int) -> None:
    check_int("config.skip.num_stages", k.num_stages, minimum=0)
    _check_steps("config.skip.full_every", k.full_every, minimum=0)
    if k.num_stages == 0:
        return
    check_path_length(k.path_length, k.num_stages, field="config.skip.path_length",
                      stages_field="config.skip.num_stages")  # fmt: skip
    require(pipeline_stages == 1, "config.skip.num_stages",
            "stage skipping and routed pipeline stages (num_stages > 1) cannot be combined.")


def _validate_fault(f: FaultSettings, num_replicas: int) -> None:
    check_dropout_prob(f.dropout_prob, "config.fault.dropout_prob")
    _check_steps("config.fault.inject_nan_step", f.inject_nan_step, minimum=-1)
    check_int("config.fault.inject_nan_replica", f.inject_nan_replica, 0, num_replicas - 1,
              f"num_replicas - 1 = {num_replicas - 1}")  # fmt: skip


def _validate_optim(o: OptimSettings, num_steps: int) -> None:
    check_number("config.optim.learning_rate", o.learning_rate, open_low=True)
    check_int("config.optim.warmup_steps", o.warmup_steps, minimum=0)
    require(o.warmup_steps < num_steps, "config.optim.warmup_steps",
            f"must be < num_steps={num_steps}, got {o.warmup_steps}.")
    check_number("config.optim.min_lr_ratio", o.min_lr_ratio, 0, 1)
    for name in ("b1", "b2"):
        check_number(f"config.optim.{name}", getattr(o, name), 0, 1, open_high=True)
    for name in ("eps", "weight_decay", "clip_norm"):
        check_number(f"config.optim.{name}", getattr(o, name))
    # With eps = 0 a parameter whose gradient is 0 (an unused embedding row) gets 0 / 0 = NaN.
    require(o.eps >= FLOAT32_TINY, "config.optim.eps", f"must be >= {FLOAT32_TINY:.3g} (Adam "
            f"divides by sqrt(v) + eps in float32, where a smaller eps is 0), got {o.eps!r}; the "
            f"usual value is 1e-8.")  # fmt: skip
    # A smaller rate is 0 in the float32 step: the run logged learning_rate 0.0, trained nothing.
    for name, allowed in (("learning_rate", ""), ("clip_norm", "0 (no clipping) or ")):
        _check_float32_normal(f"config.optim.{name}", getattr(o, name), allowed, "the step")
    # A zero floor leaves the late steps untrained; min_lr_ratio = 0 decays to 0 on purpose.
    floor = o.learning_rate * o.min_lr_ratio
    require(o.min_lr_ratio == 0 or floor >= FLOAT32_TINY, "config.optim.min_lr_ratio",
            f"config.optim.learning_rate * config.optim.min_lr_ratio must be 0 or >= "
            f"{FLOAT32_TINY:.3g} (the schedule decays to it in float32, where a smaller value "
            f"is 0), got {o.learning_rate!r} * {o.min_lr_ratio!r} = {floor!r}; raise either, or "
            f"set min_lr_ratio=0 to decay to 0.")  # fmt: skip
    # A zero first rate: jit on CPU folded it into every warmup step, all of them trained nothing.
    first = o.learning_rate / max(o.warmup_steps, 1)
    require(first >= FLOAT32_TINY, "config.optim.warmup_steps",
            f"config.optim.learning_rate / config.optim.warmup_steps (the first warmup step's "
            f"rate) must be >= {FLOAT32_TINY:.3g} (it is float32 in the step, where a smaller "
            f"value is 0), got {o.learning_rate!r} / {o.warmup_steps!r} = {first!r}; raise "
            f"learning_rate or lower warmup_steps.")  # fmt: skip


def _check_float32_normal(field: str, value: float, allowed: str, where: str) -> None:
    """``value`` is 0 or at least float32's smallest normal: it is float32 in ``where``, where
    a smaller positive value is 0. ``allowed`` names the 0 case in the message ("0 or ")."""
    require(value == 0 or value >= FLOAT32_TINY, field,
            f"must be {allowed}>= {FLOAT32_TINY:.3g} (it is float32 in {where}, where a smaller "
            f"value is 0), got {value!r}.")  # fmt: skip


def _check_micro_batches(s: TrainSettings) -> None:
    k = s.optim.micro_batches
    check_int("config.optim.micro_batches", k, minimum=1)
    require(s.batch_per_replica % k == 0, "config.optim.micro_batches",
            f"must divide each replica's batch, global_batch_size / num_replicas = "
            f"{s.batch_per_replica}, got {k}.")  # fmt: skip
    require(k == 1 or (s.num_stages == 1 and s.skip.num_stages == 0), "config.optim.micro_batches",
            f"gradient accumulation works with the plain model only (num_stages=1, "
            f"skip.num_stages=0), got num_stages={s.num_stages}, skip.num_stages="
            f"{s.skip.num_stages}; leave it at 1.")  # fmt: skip


def _validate_outer(o: OuterSettings, method: str, num_replicas: int) -> None:
    check_sync_every(o.sync_every, "config.outer.sync_every")
    _check_steps("config.outer.sync_every", o.sync_every)
    check_rate("config.outer.learning_rate", o.learning_rate)
    check_momentum("config.outer.momentum", o.momentum)
    if o.gamma is not None:
        check_rate("config.outer.gamma", o.gamma)
    for name in ("learning_rate", "gamma"):  # float32 in the sync step, as the inner rates
        value = getattr(o, name)
        if value is not None:
            _check_float32_normal(f"config.outer.{name}", value, "0 or ", "the sync step")
    check_choice("config.outer.exchange_dtype", o.exchange_dtype, EXCHANGE_DTYPES)
    check_choice("config.outer.slow_dtype", o.slow_dtype, SLOW_DTYPES)
    check_error_feedback(o.error_feedback, o.exchange_dtype, field="config.outer.error_feedback",
                         dtype_field="config.outer.exchange_dtype")  # fmt: skip
    check_fragments(o.fragments, o.sync_every, field="config.outer.fragments",
                    sync_field="config.outer.sync_every")  # fmt: skip
    check_delay(o.delay, o.sync_every, o.fragments, field="config.outer.delay",
                sync_field="config.outer.sync_every", fragments_field="config.outer.fragments")
    check_mixing(o.mixing, "config.outer.mixing")
    _check_seed("config.outer.seed", o.seed)
    if method == "noloco":  # a lone replica has no group: n alone (its warning says so)
        comm.check_group_size(num_replicas if num_replicas > 1 else None, o.group_size,
                              field="config.outer.group_size",
                              replicas_field="config.num_replicas")  # fmt: skip
    else:
        group = defaults.default("outer.group_size")
        require(o.group_size == group, "config.outer.group_size", f"acts on NoLoCo's groups "
                f"only, got method={method!r} (it would be ignored); leave it at {group}.")


def from_config(config: Any) -> TrainSettings:
    """Builds and validates ``TrainSettings`` from a ConfigDict or a nested dict.

    A field the config leaves out takes its default from ``defaults.FIELDS``.
    """
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    _check_known(d, TrainSettings, "")
    kwargs = {k: v for k, v in d.items() if k not in _SECTIONS}
    for name, cls in _SECTIONS.items():
        values = d.get(name) or {}
        values = values.to_dict() if hasattr(values, "to_dict") else values  # a ConfigDict
        require(isinstance(values, dict), f"config.{name}", f"must be a section (a dict of its "
                f"fields), got {values!r}.")  # fmt: skip
        _check_known(values, cls, f"{name}.")
        kwargs[name] = cls(**values)
    return validate(TrainSettings(**kwargs))


# Settings that name a local file or directory, compared as the real path they name (links
# resolved: os.getcwd() is the resolved folder, so "corpus" under a linked $PWD was another path).
_PATH_FIELDS = ("data.path", "data.tokenizer_path", "model.init_from")


def _dotted_pair(saved: dict, current: dict) -> tuple[dict, dict]:
    """Both settings as dotted dicts, paths resolved ("corpus/", "./corpus" and "~/corpus" are
    one corpus); a field the checkpoint predates counts as its default."""
    known = defaults.dotted(TrainSettings().to_dict())
    a, b = {**known, **defaults.dotted(saved)}, defaults.dotted(current)
    for d in (a, b):
        for key in _PATH_FIELDS:
            if isinstance(d.get(key), str) and d[key]:
                d[key] = os.path.realpath(os.path.expanduser(d[key]))
    return a, b


def _changes(a: dict, b: dict) -> dict[str, tuple[Any, Any]]:
    """The settings other than ``RESUMABLE`` that differ: dotted name -> (saved, current)."""
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b))
            if k not in RESUMABLE and a.get(k) != b.get(k)}  # fmt: skip


def _detail(changes: dict[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changes.items())


# Settings that shape a checkpoint's arrays, or the data a loaded run is analysed on.
_SHAPING = ("method", "num_replicas", "num_stages", "seed", "model.", "data.", "outer.fragments",
            "outer.delay", "outer.exchange_dtype", "outer.slow_dtype",
            "outer.error_feedback")  # fmt: skip


def check_loadable(saved: dict, current: dict) -> None:
    """Refuses to load a checkpoint for analysis with settings that shape its arrays or data
    (the schedule, rates and run length may differ: an extended run loads with its first
    config). A weight decay may change, but not to or from 0: it picks AdamW or Adam, whose
    states differ."""
    a, b = _dotted_pair(saved, current)
    changes = {k: v for k, v in _changes(a, b).items() if k.startswith(_SHAPING)}
    decay, norms = "optim.weight_decay", "optim.decay_norms"
    if (a[decay] > 0) != (b[decay] > 0):
        changes[decay] = (a[decay], b[decay])
    elif a[decay] > 0 and a[norms] != b[norms]:  # a masked decay is another state tree
        changes[norms] = (a[norms], b[norms])
    if changes:
        raise ValueError(f"cannot load the run: its checkpoint was written with other settings "
                         f"that shape its arrays or data ({_detail(changes)}); pass the run's own.")


def check_resume_compatible(saved: dict, current: dict) -> None:
    """Refuses to resume when settings that shape the run have changed.

    ``num_steps`` may grow when the checkpoint's ``optim.min_lr_ratio`` is 1 (warmup, then
    constant): that schedule does not depend on it, so the longer run equals one planned that
    long. A setting the checkpoint does not record (it predates the field) counts as its default.
    """
    a, b = _dotted_pair(saved, current)
    changes = _changes(a, b)
    if b["num_steps"] > a["num_steps"] and a.get("optim.min_lr_ratio") == 1:
        changes.pop("num_steps")
    if changes:
        hint = ""
        if "num_steps" in changes and b["num_steps"] < a["num_steps"]:
            hint = (" num_steps cannot be lowered on resume; to end early, stop the run (a "
                    "stop signal saves a checkpoint) and use that checkpoint.")
        elif "num_steps" in changes:
            hint = (" A run can be extended (num_steps raised) only when its learning-rate "
                    "schedule does not depend on num_steps: optim.min_lr_ratio=1 (warmup, then "
                    "constant); a cosine schedule would change the rate of the steps already "
                    "taken.")
        raise ValueError(
            f"cannot resume: the checkpoint was written with different settings "
            f"({_detail(changes)}). Resume with the original settings, or start a new run in "
            f"another --workdir.{hint}"
        )
