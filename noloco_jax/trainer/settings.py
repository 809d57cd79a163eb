"""Typed run settings: the one place that turns an ``ml_collections.ConfigDict`` into values.

Everything below the CLI takes these frozen dataclasses (or plain keyword
arguments), never the ConfigDict. ``from_config`` validates every field and
raises ``ValueError`` naming the field and what is allowed.
"""

from __future__ import annotations

import codecs
import dataclasses
import math
import os
from typing import Any

METHODS = ("noloco", "diloco", "dp", "local")
BACKENDS = ("auto", "vmap", "shard_map")
DTYPES = ("float32", "bfloat16")
MAX_SEED = 2**32 - 1  # seeds reach numpy and jax.random.key; larger ones overflow there
# Settings that may change when a run resumes; any other change is refused. log_every is
# not among them: it sets the fused chunks, and a resume with other chunks is not bit-identical.
RESUMABLE = frozenset(
    {"backend", "eval_every", "checkpoint_every", "keep_checkpoints",
     "data.eval_windows", "data.data_dir", "profile_steps", "log.wandb", "log.wandb_project",
     "log.wandb_run_name", "allow_resize"}
)  # fmt: skip


# The dataclasses' defaults are those of configs/common.py (FIELDS, the one table of defaults and
# meanings), for library callers; tests/test_cli.py checks that they agree.


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    preset: str = "tiny"
    dtype: str = "float32"
    param_dtype: str = "float32"
    vocab_size: int = 0  # 0: take the tokenizer's
    init_from: str = ""  # a Hugging Face Llama directory: its shape and weights
    num_kv_heads: int = 0  # 0: as many as num_heads; fewer: grouped-query attention
    tie_embeddings: bool = False


@dataclasses.dataclass(frozen=True)
class DataSettings:
    source: str = "shakespeare"
    path: str = ""
    tfds_name: str = ""
    data_dir: str = ""
    tokenizer: str = "byte"
    tokenizer_vocab_size: int = 0
    tokenizer_path: str = ""  # tokenizer="hf": the directory holding tokenizer.json
    seq_len: int = 64
    validation_fraction: float = 0.1
    eval_windows: int = 64
    encoding: str = "utf-8"


@dataclasses.dataclass(frozen=True)
class OptimSettings:
    learning_rate: float = 3e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip_norm: float = 1.0


@dataclasses.dataclass(frozen=True)
class OuterSettings:
    sync_every: int = 50
    learning_rate: float = 0.7
    momentum: float = 0.5
    gamma: float | None = None
    group_size: int = 2
    nesterov: bool = False
    exchange_dtype: str = ""
    error_feedback: bool = False
    fragments: int = 1
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class FaultSettings:
    dropout_prob: float = 0.0
    nonfinite_guard: bool = True
    inject_nan_step: int = -1
    inject_nan_replica: int = 0


@dataclasses.dataclass(frozen=True)
class SkipSettings:
    num_stages: int = 0  # 0: no stage skipping
    path_length: int = 0
    full_every: int = 0
    swaps: bool = False


@dataclasses.dataclass(frozen=True)
class LogSettings:
    wandb: bool = False  # also log to Weights & Biases (WANDB_MODE=offline works)
    wandb_project: str = "noloco_jax"
    wandb_run_name: str = ""


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    seed: int = 0
    method: str = "noloco"
    num_replicas: int = 8
    backend: str = "auto"
    num_stages: int = 1
    routing: str = "random"
    routing_pool_size: int = 64
    global_batch_size: int = 32
    num_steps: int = 500
    log_every: int = 25
    eval_every: int = 100
    checkpoint_every: int = 200
    keep_checkpoints: int = 2
    profile_steps: str = ""  # "A:B": a jax.profiler trace of steps [A, B) in workdir/profile
    allow_resize: bool = False  # resume a checkpoint of another num_replicas (merge / clone)
    model: ModelSettings = ModelSettings()
    data: DataSettings = DataSettings()
    optim: OptimSettings = OptimSettings()
    outer: OuterSettings = OuterSettings()
    fault: FaultSettings = FaultSettings()
    skip: SkipSettings = SkipSettings()
    log: LogSettings = LogSettings()

    @property
    def batch_per_replica(self) -> int:
        return self.global_batch_size // self.num_replicas

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _require(cond: bool, field: str, message: str) -> None:
    if not cond:
        raise ValueError(f"config.{field}: {message}")


def _positive_int(value: Any, field: str, minimum: int = 1) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
    _require(ok, field, f"must be an integer >= {minimum}, got {value!r}.")


def _nonneg(value: Any, field: str) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
    _require(ok and math.isfinite(value), field, f"must be a finite number >= 0, got {value!r}.")


def _seed(value: Any, field: str) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_SEED
    _require(ok, field, f"must be an integer in [0, 2**32 - 1], got {value!r}.")


def _choice(value: Any, field: str, allowed: tuple[str, ...]) -> None:
    _require(value in allowed, field, f"must be one of {list(allowed)}, got {value!r}.")


def _section(cls: type, values: Any, prefix: str) -> Any:
    values = dict(values or {})
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    _require(not unknown, f"{prefix}{unknown[0] if unknown else ''}", f"unknown field; "
             f"valid fields of config.{prefix.rstrip('.') or 'root'} are {sorted(known)}.")
    return cls(**values)


def validate(s: TrainSettings) -> TrainSettings:
    """Checks every field; returns ``s`` or raises ``ValueError`` naming the field."""
    _choice(s.method, "method", METHODS)
    _choice(s.backend, "backend", BACKENDS)
    _choice(s.routing, "routing", ("random", "fixed"))
    for name in ("num_replicas", "global_batch_size", "num_steps", "log_every", "eval_every",
                 "checkpoint_every", "keep_checkpoints", "num_stages", "routing_pool_size"):
        _positive_int(getattr(s, name), name)
    _seed(s.seed, "seed")
    _require(
        s.global_batch_size % s.num_replicas == 0,
        "global_batch_size",
        f"{s.global_batch_size} is not divisible by num_replicas={s.num_replicas}.",
    )
    for name in ("eval_every", "checkpoint_every"):
        _require(
            getattr(s, name) % s.log_every == 0,
            name,
            f"must be a multiple of log_every={s.log_every} (steps are fused in chunks of "
            f"log_every), got {getattr(s, name)}.",
        )
    _choice(s.model.dtype, "model.dtype", DTYPES)
    _choice(s.model.param_dtype, "model.param_dtype", DTYPES)
    _positive_int(s.model.vocab_size, "model.vocab_size", minimum=0)
    _choice(s.data.source, "data.source", ("shakespeare", "files", "tfds", "tokens"))
    _require(s.data.source != "files" or bool(s.data.path), "data.path",
             "must name a file, directory or glob when data.source='files'.")
    _require(s.data.source != "tokens" or bool(s.data.path), "data.path",
             "must name a directory with train.npy and validation.npy when data.source='tokens'.")
    _require(s.data.source != "tokens" or s.data.tokenizer != "sentencepiece", "data.tokenizer",
             "sentencepiece is trained on text; data.source='tokens' needs 'byte' or 'hf'.")
    _require(s.data.source != "tfds" or bool(s.data.tfds_name), "data.tfds_name",
             "must name a TFDS dataset when data.source='tfds'.")
    _choice(s.data.tokenizer, "data.tokenizer", ("byte", "sentencepiece", "hf"))
    _require(s.data.tokenizer != "hf" or bool(s.data.tokenizer_path), "data.tokenizer_path",
             "must name a directory holding tokenizer.json when data.tokenizer='hf'.")
    _require(_is_codec(s.data.encoding), "data.encoding",
             f"must be a text encoding Python knows (e.g. 'utf-8', 'latin-1'), got "
             f"{s.data.encoding!r}.")
    _positive_int(s.data.seq_len, "data.seq_len")
    _positive_int(s.data.eval_windows, "data.eval_windows")
    _positive_int(s.data.tokenizer_vocab_size, "data.tokenizer_vocab_size", minimum=0)
    _require(0 < s.data.validation_fraction < 1, "data.validation_fraction",
             f"must be in (0, 1), got {s.data.validation_fraction!r}.")
    _validate_optim(s.optim, s.num_steps)
    _validate_outer(s.outer, s.method, s.num_replicas)
    _require(s.outer.fragments == 1 or (s.num_stages == 1 and s.method in ("noloco", "diloco")),
             "outer.fragments", "streaming fragments need method noloco or diloco and "
             "num_stages=1.")  # fmt: skip
    _validate_fault(s.fault, s.num_replicas)
    _validate_skip(s.skip, s.num_stages)
    parse_profile_steps(s.profile_steps)
    _require(isinstance(s.log.wandb, bool), "log.wandb", f"must be True or False, got "
             f"{s.log.wandb!r}.")  # fmt: skip
    _require(bool(s.log.wandb_project), "log.wandb_project", "must not be empty.")
    _require(isinstance(s.allow_resize, bool), "allow_resize",
             f"must be True or False, got {s.allow_resize!r}.")
    _require(not (s.allow_resize and s.num_stages > 1), "allow_resize",
             "resizing runs with pipeline stages (num_stages > 1) is not supported.")
    return s


def parse_profile_steps(text: Any) -> tuple[int, int] | None:
    """``"A:B"`` -> (A, B) with 0 <= A < B; ``""`` -> None; else ``ValueError``."""
    if text == "":
        return None
    parts = text.split(":") if isinstance(text, str) else []
    try:
        a, b = (int(p) for p in parts)
    except ValueError:
        a = b = -1
    _require(len(parts) == 2 and 0 <= a < b, "profile_steps",
             f"must be 'A:B' with integers 0 <= A < B (a trace of steps [A, B)), or '' for "
             f"none; got {text!r}.")  # fmt: skip
    return a, b


def warnings_for(s: TrainSettings) -> list[str]:
    """Valid but suspicious settings, one line each (the trainer prints them at start)."""
    out = []
    if s.method in ("noloco", "diloco") and s.outer.sync_every > s.num_steps:
        out.append(f"config.outer.sync_every={s.outer.sync_every} > num_steps={s.num_steps}: the "
                   f"replicas never sync in this run (method={s.method!r} acts as 'local'); use "
                   f"sync_every <= num_steps.")
    return out


def _is_codec(name: Any) -> bool:
    try:
        return isinstance(name, str) and bool(codecs.lookup(name))
    except LookupError:
        return False


def _validate_skip(k: SkipSettings, pipeline_stages: int) -> None:
    _positive_int(k.num_stages, "skip.num_stages", minimum=0)
    _positive_int(k.full_every, "skip.full_every", minimum=0)
    if k.num_stages == 0:
        return
    ok = isinstance(k.path_length, int) and 1 <= k.path_length <= k.num_stages
    _require(ok, "skip.path_length",
             f"must be in [1, skip.num_stages={k.num_stages}], got {k.path_length!r}.")
    _require(pipeline_stages == 1, "skip.num_stages",
             "stage skipping and routed pipeline stages (num_stages > 1) cannot be combined.")


def _validate_fault(f: FaultSettings, num_replicas: int) -> None:
    ok = isinstance(f.dropout_prob, (int, float)) and 0 <= f.dropout_prob < 1
    _require(ok, "fault.dropout_prob", f"must be in [0, 1), got {f.dropout_prob!r}.")
    _require(isinstance(f.nonfinite_guard, bool), "fault.nonfinite_guard",
             f"must be True or False, got {f.nonfinite_guard!r}.")
    _positive_int(f.inject_nan_step, "fault.inject_nan_step", minimum=-1)
    ok = isinstance(f.inject_nan_replica, int) and 0 <= f.inject_nan_replica < num_replicas
    _require(ok, "fault.inject_nan_replica",
             f"must be in [0, num_replicas={num_replicas}), got {f.inject_nan_replica!r}.")


def _validate_optim(o: OptimSettings, num_steps: int) -> None:
    _require(
        isinstance(o.learning_rate, (int, float)) and 0 < o.learning_rate < math.inf,
        "optim.learning_rate", f"must be a finite number > 0, got {o.learning_rate!r}.",
    )
    _positive_int(o.warmup_steps, "optim.warmup_steps", minimum=0)
    _require(o.warmup_steps < num_steps, "optim.warmup_steps",
             f"must be < num_steps={num_steps}, got {o.warmup_steps}.")
    _require(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio",
             f"must be in [0, 1], got {o.min_lr_ratio!r}.")
    for name in ("b1", "b2"):
        value = getattr(o, name)
        _require(0 <= value < 1, f"optim.{name}", f"must be in [0, 1), got {value!r}.")
    for name in ("eps", "weight_decay", "clip_norm"):
        _nonneg(getattr(o, name), f"optim.{name}")
    # Adam divides by sqrt(v) + eps: with eps = 0 a parameter whose gradient is 0
    # (an unused embedding row) gets 0 / 0 = NaN on the first step.
    _require(o.eps > 0, "optim.eps", f"must be > 0 (Adam divides by sqrt(v) + eps), got "
             f"{o.eps!r}; the usual value is 1e-8.")


def _validate_outer(o: OuterSettings, method: str, num_replicas: int) -> None:
    _positive_int(o.sync_every, "outer.sync_every")
    _nonneg(o.learning_rate, "outer.learning_rate")
    _nonneg(o.momentum, "outer.momentum")
    if o.gamma is not None:
        _nonneg(o.gamma, "outer.gamma")
    _choice(o.exchange_dtype, "outer.exchange_dtype",
            ("", "bfloat16", "float32", "int8", "float8_e4m3fn"))  # fmt: skip
    _require(not o.error_feedback or o.exchange_dtype in ("int8", "float8_e4m3fn"),
             "outer.error_feedback", "needs an 8-bit outer.exchange_dtype (int8 or "
             f"float8_e4m3fn), got {o.exchange_dtype!r}.")  # fmt: skip
    _positive_int(o.fragments, "outer.fragments")
    _require(o.sync_every % o.fragments == 0, "outer.fragments",
             f"{o.fragments} must divide outer.sync_every={o.sync_every} (fragment p syncs "
             "at steps t with t mod H = (p + 1) H / P).")  # fmt: skip
    _seed(o.seed, "outer.seed")
    if method == "noloco" and num_replicas > 1:
        _positive_int(o.group_size, "outer.group_size", minimum=2)
        _require(
            num_replicas % o.group_size == 0,
            "outer.group_size",
            f"{o.group_size} must divide num_replicas={num_replicas}.",
        )


def from_config(config: Any) -> TrainSettings:
    """Builds and validates ``TrainSettings`` from a ConfigDict (or a nested dict)."""
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    sections = {
        "model": ModelSettings,
        "data": DataSettings,
        "optim": OptimSettings,
        "outer": OuterSettings,
        "fault": FaultSettings,
        "skip": SkipSettings,
        "log": LogSettings,
    }
    kwargs = {k: v for k, v in d.items() if k not in sections}
    known = {f.name for f in dataclasses.fields(TrainSettings)} - set(sections)
    unknown = sorted(set(kwargs) - known)
    _require(not unknown, unknown[0] if unknown else "", f"unknown field; valid top-level "
             f"fields are {sorted(known | set(sections))}.")
    for name, cls in sections.items():
        kwargs[name] = _section(cls, d.get(name), f"{name}.")
    return validate(TrainSettings(**kwargs))


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _can_extend(saved: dict, current: dict) -> bool:
    """A longer run whose learning rate is the same at every step already taken.

    With ``optim.min_lr_ratio == 1`` the schedule is warmup then constant, so it
    does not depend on ``num_steps``: the extended run continues at the peak rate
    and equals one planned that long from the start. A cosine schedule would
    change its rate for the steps already taken, so extending it is refused.
    """
    return current["num_steps"] > saved["num_steps"] and saved.get("optim.min_lr_ratio") == 1


def check_resume_compatible(saved: dict, current: dict) -> None:
    """Refuses to resume when settings that shape the run have changed.

    ``num_steps`` may grow when the schedule allows it (``_can_extend``). A setting the
    checkpoint does not record (it predates the field) counts as its default.
    """
    defaults = _flatten(TrainSettings().to_dict())  # fields added since the checkpoint
    a = {**defaults, **_flatten(saved)}
    b = _flatten(current)
    for d in (a, b):  # "corpus/" and "corpus" name the same corpus
        if d.get("data.path"):
            d["data.path"] = os.path.normpath(d["data.path"])
    changed = sorted(k for k in set(a) | set(b) if k not in RESUMABLE and a.get(k) != b.get(k))
    if "num_steps" in changed and _can_extend(a, b):
        changed.remove("num_steps")
    if changed:
        detail = ", ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in changed)
        hint = ""
        if "num_steps" in changed:
            hint = (" A run can be extended (num_steps raised) only when its learning-rate "
                    "schedule does not depend on num_steps: optim.min_lr_ratio=1 (warmup, then "
                    "constant); a cosine schedule would change the rate of the steps already "
                    "taken.")
        raise ValueError(
            f"cannot resume: the checkpoint was written with different settings ({detail}). "
            f"Resume with the original settings, or start a new run in another --workdir.{hint}"
        )
