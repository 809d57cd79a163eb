"""From settings to a runnable run: data, model, topology and the compiled programs.

``build_run(settings)`` prepares the data and the model's shapes, picks where the replicas
run (``topology``), jits the run's two programs and its evaluator, and checks that the
state fits, allocating nothing. A process keeps the programs of its last ``KEEP_COMPILED``
runs, keyed on what they read, so a resume or a notebook cell run again compiles nothing new.
The loop (``trainer.loop``) runs what this module builds.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import functools
import hashlib
import math
import os
import pathlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from noloco_jax import data as data_lib
from noloco_jax import defaults, errors
from noloco_jax import models, replicas, sharding
from noloco_jax import pipeline as pl
from noloco_jax.data.token_files import open_token_dir
from noloco_jax.optim.fragments import by_layer_blocks
from noloco_jax.pipeline.routed import STAGE
from noloco_jax.pipeline.stages import check_stages
from noloco_jax.skippipe.training import SkipConfig
from noloco_jax.trainer import aot, grads, memory
from noloco_jax.trainer import optimizer as optim_lib
from noloco_jax.trainer.evaluate import make_evaluator
from noloco_jax.trainer.settings import ROUND_METHODS, TrainSettings
from noloco_jax.trainer.state import first_state, model_init
from noloco_jax.trainer.step import TrainState, make_program, make_window_program

__all__ = ["DataBundle", "KEEP_COMPILED", "Run", "abstract_model", "build_run", "check_memory",
           "make_programs", "model_config", "nan_drill", "prepare_data", "prepare_model",
           "schedule", "stage_mesh", "topology"]


@dataclasses.dataclass(frozen=True)
class DataBundle:
    """What the loop needs from the data layer."""

    tokenizer: Any
    batcher: Any
    eval_windows: np.ndarray  # [W, T + 1]
    train_tokens: int


def prepare_data(s: TrainSettings) -> DataBundle:
    """Corpus -> tokenizer -> token streams -> per-replica batcher and eval windows."""
    data_dir = (pathlib.Path(s.data.data_dir).expanduser() if s.data.data_dir
                else data_lib.default_data_dir())  # fmt: skip
    errors.check_utf8_path("config.data.data_dir", data_dir)  # was array_record's TypeError
    try:
        tokenizer, train, val = _token_streams(s, data_dir)
    except OSError as err:  # a read-only or full data dir: was a PermissionError traceback
        if not _refused_write(err, data_dir):
            raise
        where = f": {err.filename}" if err.filename is not None else ""
        raise errors.UserError(
            f"config.data.data_dir: cannot write under {str(data_dir)!r} ({err.strerror}"
            f"{where}); the first run on a corpus prepares it there. Point "
            f"config.data.data_dir (or $NOLOCO_DATA_DIR) to a writable directory with free "
            f"space.") from err  # fmt: skip
    try:
        batcher = data_lib.ReplicaBatcher(
            train,
            num_replicas=s.num_replicas,
            batch_size=s.batch_per_replica,
            seq_len=s.data.seq_len,
            seed=s.seed,
        )
    except ValueError as err:  # too few windows: the split may hold the text back
        raise errors.UserError(f"{err}{_split_hint(s, 'lower')}") from err
    windows = data_lib.eval_windows(val, seq_len=s.data.seq_len, max_windows=s.data.eval_windows)
    if len(windows) == 0:
        raise ValueError(
            f"the validation split has fewer than seq_len + 1 = {s.data.seq_len + 1} tokens; "
            f"use a larger corpus, more validation data or a shorter config.data.seq_len."
            f"{_split_hint(s, 'raise')}"
        )
    return DataBundle(tokenizer, batcher, windows, int(len(train)))


def _split_hint(s: TrainSettings, change: str) -> str:
    """With local files, the share held out for validation may be what starves a split."""
    if s.data.source != "files":
        return ""
    return (f" config.data.validation_fraction={s.data.validation_fraction!r} sets the split "
            f"of the files: {change} it.")


def _refused_write(err: OSError, data_dir: pathlib.Path) -> bool:
    """Whether ``err`` is a write the data dir refused (read-only, a file in its place, full):
    one naming a path under it, or a full disk under an open file (the token cache)."""
    if isinstance(err, FileNotFoundError):
        return False
    if err.filename is None:  # only the data dir is written while the data is prepared
        return err.errno in (errno.ENOSPC, errno.EDQUOT)
    return pathlib.Path(os.fsdecode(err.filename)).resolve().is_relative_to(data_dir.resolve())


def _token_streams(s: TrainSettings, data_dir: pathlib.Path) -> tuple[Any, Any, Any]:
    """The tokenizer and the train and validation token streams (prepared once in
    ``data_dir``, read from there later)."""
    corpus = None
    if s.data.source != "tokens":  # pre-tokenized streams need no text
        corpus = data_lib.load_corpus(
            s.data.source,
            data_dir=data_dir,
            path=s.data.path or None,
            tfds_name=s.data.tfds_name or None,
            max_documents=s.data.max_documents or None,
            validation_fraction=s.data.validation_fraction,
            seed=s.seed,
            encoding=s.data.encoding,
        )
    tokenizer = data_lib.make_tokenizer(
        s.data.tokenizer,
        corpus=corpus,
        vocab_size=s.data.tokenizer_vocab_size or None,
        cache_dir=data_dir,
        path=s.data.tokenizer_path or None,
        field="config.data.tokenizer_vocab_size",
    )
    # Streams stay on disk and are read window by window (data larger than RAM).
    if corpus is None:
        train, val = open_token_dir(s.data.path, tokenizer.vocab_size)
    else:
        train = data_lib.load_token_stream(corpus, tokenizer, "train", data_dir, on_disk=True)
        val = data_lib.load_token_stream(corpus, tokenizer, "validation", data_dir, on_disk=True)
    return tokenizer, train, val


def prepare_model(s: TrainSettings, vocab_size: int, abstract: bool = False
                  ) -> tuple[models.LlamaConfig, Any, Any]:  # fmt: skip
    """Model config, graphdef and the initial params (identical for every replica).

    ``abstract``: the preset's params as ``jax.ShapeDtypeStruct`` (nothing is allocated; the
    trainer initialises them in place); ``init_from`` weights are always read.
    """
    if s.model.init_from:
        from noloco_jax.trainer.hf_init import prepare_hf_model  # noqa: PLC0415

        return prepare_hf_model(s, vocab_size)
    if abstract:
        return abstract_model(s, vocab_size)
    cfg = model_config(s, vocab_size)
    return cfg, *models.init_params(cfg, s.seed)


def abstract_model(s: TrainSettings, vocab_size: int) -> tuple[models.LlamaConfig, Any, Any]:
    """Model config, graphdef and the params' shapes (nothing is allocated or read)."""
    cfg = model_config(s, vocab_size)
    return cfg, *jax.eval_shape(functools.partial(models.init_params, cfg, s.seed))


def check_split(s: TrainSettings, params: Any) -> None:
    """Refuses a ``config.mesh`` split that does not divide the model's dims, naming the fix;
    an ``init_from`` table keeps its size (``model.vocab_size`` must equal it): no padding hint."""
    sharding.check_divides(params, {"fsdp": s.mesh.fsdp, "tensor": s.mesh.tensor},
                           pad_vocab=not s.model.init_from)


def model_config(s: TrainSettings, vocab_size: int) -> models.LlamaConfig:
    """The run's model config for a tokenizer of ``vocab_size`` ids (``model_vocab``'s rule)."""
    if s.model.init_from:  # the checkpoint's config.json replaces the preset
        from noloco_jax.models.hf import read_config  # noqa: PLC0415

        cfg = read_config(s.model.init_from, dtype=s.model.dtype, param_dtype=s.model.param_dtype)
        model_vocab(s, vocab_size, init_vocab=cfg.vocab_size)
        return dataclasses.replace(cfg, remat=s.model.remat)
    cfg = models.get_preset(
        s.model.preset,
        vocab_size=model_vocab(s, vocab_size),
        dtype=s.model.dtype,
        param_dtype=s.model.param_dtype,
        max_seq_len=max(2048, s.data.seq_len),
        num_kv_heads=s.model.num_kv_heads,
        tie_embeddings=s.model.tie_embeddings,
        remat=s.model.remat,
        **({"num_layers": s.model.num_layers} if s.model.num_layers else {}),
    )
    if cfg.tie_embeddings and s.num_stages > 1:
        raise ValueError("config.model.tie_embeddings=True cannot be split into "
                         "config.num_stages > 1 pipeline stages.")  # fmt: skip
    return cfg


def model_vocab(s: TrainSettings, vocab_size: int, init_vocab: int | None = None) -> int:
    """The model's vocabulary size: at least the tokenizer's, larger when the table is padded.

    ``config.model.vocab_size`` 0 takes the tokenizer's; a larger value pads the embedding
    table (and output head), e.g. to a multiple of 128. The padding ids never occur in the
    data. An ``init_from`` checkpoint keeps its own table (its config.json's vocab_size).

    Args:
      s: the run settings.
      vocab_size: the tokenizer's vocabulary size.
      init_vocab: the ``init_from`` checkpoint's vocab_size; None for a preset.

    Returns:
      ``init_vocab`` if given, else ``config.model.vocab_size`` or, when 0, ``vocab_size``.

    Raises:
      ValueError: the model's vocabulary is smaller than the tokenizer's (its larger ids
        would be outside the table), or ``config.model.vocab_size`` is set and differs from
        the ``init_from`` checkpoint's.
    """
    if init_vocab is not None:
        if init_vocab < vocab_size:
            raise ValueError(
                f"config.model.init_from={s.model.init_from!r} has a vocabulary of {init_vocab} "
                f"ids but the {s.data.tokenizer!r} tokenizer has {vocab_size} (its ids from "
                f"{init_vocab} up are outside the model's table); use the model's own tokenizer "
                f"(--config.data.tokenizer=hf --config.data.tokenizer_path=DIR).")  # fmt: skip
        if s.model.vocab_size and s.model.vocab_size != init_vocab:
            raise ValueError(f"config.model.vocab_size={s.model.vocab_size} differs from the "
                             f"init_from model's {init_vocab}; set it to 0 (the checkpoint's "
                             f"table is used as it is).")  # fmt: skip
        return init_vocab
    if s.model.vocab_size and s.model.vocab_size < vocab_size:
        padded = -(-vocab_size // 128) * 128
        raise ValueError(
            f"config.model.vocab_size={s.model.vocab_size} is smaller than the "
            f"{s.data.tokenizer!r} tokenizer's vocabulary of {vocab_size} (its ids from "
            f"{s.model.vocab_size} up would be outside the embedding table); set it to 0 (take "
            f"the tokenizer's) or to at least {vocab_size}, e.g. {padded} (a multiple of 128).")
    return s.model.vocab_size or vocab_size


@dataclasses.dataclass
class Run:
    """Everything compiled and built for one run.

    The run's two programs: ``inner(state, tokens [N, K, ...])`` runs K <= ``block`` inner
    steps; ``sync(state, tokens [N, 1, ...])`` the step that ends a round (None without rounds).
    With ``delay`` > 0, ``sync[p](state, tokens)`` runs fragment p's window, the delay + 1 steps
    from its exchange to its merge (``tokens``: one [N, 1, ...] array per step).
    """

    settings: TrainSettings
    data: DataBundle
    reps: replicas.Replicas
    params0: Any
    graphdef: Any
    inner: Callable
    sync: Callable | None
    block: int  # steps per call of ``inner``; the sync steps fall on block ends
    period: int | None  # steps between sync steps (H, or H / fragments)
    evaluate: Callable
    meta: dict
    fresh: Callable[[], TrainState]  # the step-0 state, made in place (trainer.state)
    resized_from: int | None = None  # the checkpoint's replica count after a resize
    counted: tuple | None = None  # the restored checkpoint's (step, tokens seen, bytes sent)
    streak: list | None = None  # the restored checkpoint's consecutive resets per replica
    calls: set = dataclasses.field(default_factory=set)  # (program, length or fragment) compiled
    delay: int = 0  # tau, the steps between an exchange's start and its merge


def optimizer_factory(s: TrainSettings, params: Any) -> tuple[Any, Callable]:
    """The run's fragment spec (None for one fragment) and its optimizer factory, which
    ``grads.per_stage`` calls with ``stage=...`` on a stage mesh."""
    spec = (by_layer_blocks(params, s.outer.fragments, field="config.outer.fragments")
            if s.outer.fragments > 1 else None)  # fmt: skip
    return spec, functools.partial(
        optim_lib.build_optimizer, s.method, s.optim, s.outer, num_steps=s.num_steps,
        num_replicas=s.num_replicas, num_stages=s.num_stages, fault=s.fault,
        fragment_spec=spec,
    )  # fmt: skip


def run_programs(s: TrainSettings, cfg: Any, graphdef: Any, build_tx: Callable, spec: Any
                 ) -> tuple[replicas.Replicas, dict, Callable, Any]:  # fmt: skip
    """The run's ``topology``, its step's arguments and its two programs (``make_programs``)."""
    reps, step_kwargs = topology(s, cfg, graphdef, build_tx)
    inner, sync = make_programs(reps, step_kwargs, s.method in ROUND_METHODS,
                                fragments=spec is not None, delay=schedule(s)[2],
                                num_fragments=s.outer.fragments)  # fmt: skip
    return reps, step_kwargs, inner, sync


def schedule(s: TrainSettings) -> tuple[int | None, int, int]:
    """(period, block, delay): the steps between sync steps (None without rounds), per call of
    ``inner`` (the sync steps fall on block ends) and from an exchange's start to its merge."""
    if s.method not in ROUND_METHODS:
        return None, s.log_every, 0
    period = s.outer.sync_every // s.outer.fragments
    return period, math.gcd(s.log_every, period), s.outer.delay


def build_run(s: TrainSettings) -> tuple[Run, TrainState]:
    """The run's data, programs and state target (placed shapes: nothing is allocated)."""
    data = prepare_data(s)
    cfg, graphdef, params0 = prepare_model(s, data.tokenizer.vocab_size, abstract=True)
    spec, build_tx = optimizer_factory(s, params0)
    check_memory(s, data.tokenizer.vocab_size, build_tx())
    check_split(s, params0)
    programs = _reuse(_COMPILED, _program_key(s, data, cfg),
                      lambda: _Programs.make(s, cfg, graphdef, build_tx, spec, data, params0))
    fresh = functools.partial(programs.first_state, params0 if _given(params0) else None)
    period, block, delay = schedule(s)
    meta = {
        "settings": s.to_dict(),
        "batcher": data.batcher.state(),
        "vocab_size": int(cfg.vocab_size),  # the model's (padded: above the tokenizer's)
        "tokenizer_vocab_size": int(data.tokenizer.vocab_size),
    }
    if s.model.init_from:  # its config.json shapes the model but is no setting: a resume checks it
        meta["init_model"] = dataclasses.asdict(cfg)
    return Run(s, data, programs.reps, params0, graphdef, programs.inner, programs.sync, block,
                period, programs.evaluate, meta, fresh, calls=programs.calls,
                delay=delay), programs.target  # fmt: skip


# A process keeps the programs of its last few runs: a run with the same settings and data (a
# resume, a notebook cell run again) reuses them; one with another optimizer, the evaluator.
KEEP_COMPILED = 8


@dataclasses.dataclass
class _Programs:
    """A run's topology and jitted programs, and which of them have run (so compiled).

    ``target``: the state's placed shapes; ``first_state(params)``: the step-0 state
    (``params`` None: the model's initialiser).
    """

    reps: replicas.Replicas
    inner: Callable
    sync: Any
    evaluate: Callable
    target: TrainState
    first_state: Callable
    calls: set = dataclasses.field(default_factory=set)

    @classmethod
    def make(cls, s: TrainSettings, cfg: Any, graphdef: Any, build_tx: Callable, spec: Any,
             data: DataBundle, params0: Any) -> "_Programs":  # fmt: skip
        reps, step_kwargs, inner, sync = run_programs(s, cfg, graphdef, build_tx, spec)
        tx = build_tx()
        target = aot.abstract_state(reps, tx, params0)
        init = None if _given(params0) else model_init(cfg, s.seed)
        evaluate = _reuse(_EVALUATORS, _evaluator_key(s, data, cfg),
                          lambda: make_evaluator(reps, graphdef, data.eval_windows))
        return cls(reps, inner, sync, evaluate, target,
                   first_state(target, tx, s.num_replicas, init))  # fmt: skip


def _given(params0: Any) -> bool:
    """Whether the initial params are given values (``init_from``), not shapes to initialise."""
    return not isinstance(jax.tree.leaves(params0)[0], jax.ShapeDtypeStruct)


_COMPILED: "collections.OrderedDict[tuple, _Programs]" = collections.OrderedDict()


_EVALUATORS: "collections.OrderedDict[tuple, Callable]" = collections.OrderedDict()


def _reuse(cache: collections.OrderedDict, key: tuple, make: Callable[[], Any]) -> Any:
    """``cache[key]``, made by ``make()`` when missing; the cache keeps its newest KEEP_COMPILED."""
    value = cache.pop(key, None)
    cache[key] = make() if value is None else value  # the newest last
    while len(cache) > KEEP_COMPILED:
        cache.popitem(last=False)
    return cache[key]


# Fields the programs never read: the data reach them only through the vocabulary and the
# evaluation windows (both in the key), and these top-level fields (and groups) are host
# bookkeeping. log_every sets how many steps one call of the inner program runs; the program
# reads that from its batch's shape (each length compiles once), so runs differing only in it
# share programs. A field not listed here (a new one included) is part of the key.
_HOST = ("eval_every", "checkpoint_every", "keep_checkpoints", "profile_steps", "log",
         "allow_resize", "log_every", "data.source", "data.path", "data.tfds_name",
         "data.data_dir", "data.encoding", "data.tokenizer", "data.tokenizer_path",
         "data.tokenizer_vocab_size", "data.validation_fraction", "data.eval_windows")  # fmt: skip


# The evaluator reads the topology and the model (with data.seq_len, which bounds its
# positions): these fields and every model.* and mesh.* field.
_EVALUATOR_FIELDS = ("num_replicas", "backend", "num_stages", "data.seq_len")


def _program_key(s: TrainSettings, data: DataBundle, cfg: models.LlamaConfig) -> tuple:
    """What the compiled programs depend on: the settings less host-only fields, the data and
    the model config (an ``init_from`` config.json may change under the same settings)."""
    return _key(s, data, cfg, lambda k: k not in _HOST and k.split(".")[0] not in _HOST)


def _evaluator_key(s: TrainSettings, data: DataBundle, cfg: models.LlamaConfig) -> tuple:
    """What the evaluator depends on: the model, the topology and the data, not the optimizer."""
    return _key(s, data, cfg,
                lambda k: k.startswith(("model.", "mesh.")) or k in _EVALUATOR_FIELDS)  # fmt: skip


def _key(s: TrainSettings, data: DataBundle, cfg: models.LlamaConfig,
         read: Callable[[str], bool]) -> tuple:  # fmt: skip
    """The settings' fields that ``read`` takes (dotted names), the model config and the data."""
    own = sorted((k, v) for k, v in defaults.dotted(s.to_dict()).items() if read(k))
    return (repr(own), repr(cfg), int(data.tokenizer.vocab_size),
            hashlib.sha256(data.eval_windows.tobytes()).digest())  # fmt: skip


def topology(s: TrainSettings, cfg: Any, graphdef: Any, build_tx: Callable
              ) -> tuple[replicas.Replicas, dict]:  # fmt: skip
    """Where the replicas run, and how one replica's step computes its gradients."""
    kwargs = dict(tx=build_tx(), nonfinite_guard=s.fault.nonfinite_guard,
                  corrupt=nan_drill(s.fault))  # fmt: skip
    if s.num_stages == 1:
        skip = _skip_config(s, cfg.num_layers)
        grads_fn = grads.plain(graphdef) if skip is None else grads.skipping(graphdef, skip)
        grads_fn = grads.accumulated(grads_fn, s.optim.micro_batches)
        split = {"fsdp": s.mesh.fsdp, "tensor": s.mesh.tensor}
        return replicas.make_replicas(s.num_replicas, backend=s.backend, mesh_shape=split), {
            **kwargs, "grads_fn": grads_fn}
    check_stages(cfg.num_layers, s.num_stages, field="config.num_stages")
    fixed, on_mesh = s.routing == "fixed", stage_mesh(s)
    if on_mesh and not fixed:
        _check_mesh_pool(s)
    # Fixed routing takes row 0 (the identity) only: the rest of a pool compiled unused branches.
    pool = pl.permutation_pool(s.num_replicas, 1 if fixed else s.routing_pool_size, s.seed)
    route = dict(seed=s.seed, fixed=fixed)
    if not on_mesh:
        return replicas.Replicas(s.num_replicas), {
            **kwargs, "grads_fn": grads.routed(graphdef, pool, s.num_stages, **route)}
    mesh = pl.make_pipeline_mesh(s.num_replicas, s.num_stages)
    reps = replicas.Replicas(s.num_replicas, mesh=mesh, leaf_axes=pl.stage_leaf_axes)
    return reps, {**kwargs, "tx": grads.per_stage(build_tx), "guard_axis": STAGE,
                  "grads_fn": grads.routed_on_mesh(graphdef, pool, s.num_stages, **route)}


# On the (replica, stage) mesh each pool entry compiles one ppermute branch per micro-batch
# and boundary (256 entries x 8 micro-batches: 24 s, BENCHMARKS.md); N! of 8 replicas is 40320.
MAX_MESH_ROUTING_POOL = 1024


def _check_mesh_pool(s: TrainSettings) -> None:
    """A ValueError when the mesh's routing pool (min(N!, routing_pool_size)) is too big to
    compile; the simulated path gathers, and any size compiles there (fixed routing keeps
    only the identity)."""
    size = min(math.factorial(s.num_replicas), s.routing_pool_size)
    errors.require(size <= MAX_MESH_ROUTING_POOL, "config.routing_pool_size",
                   f"must be in [1, {MAX_MESH_ROUTING_POOL}] on the (replica, stage) device mesh "
                   f"(each bijection compiles a branch per micro-batch and stage boundary), got "
                   f"{s.routing_pool_size} for num_replicas={s.num_replicas}; use a smaller pool "
                   f"or backend='vmap' (simulated stages gather, for any pool).")  # fmt: skip


def stage_mesh(s: TrainSettings) -> bool:
    """Whether a pipelined run gets a ``(replica, stage)`` mesh (else it is simulated)."""
    need = s.num_replicas * s.num_stages
    return s.backend == "shard_map" or (s.backend == "auto" and jax.device_count() >= need)


def nan_drill(fault: Any) -> Callable | None:
    """NaN weights for one replica at one step (a fault drill for tests and demos), or None."""
    if fault.inject_nan_step < 0:
        return None

    def corrupt(params: Any, step: jax.Array) -> Any:
        hit = (step == fault.inject_nan_step) & (lax.axis_index("replica") == fault.inject_nan_replica)
        return jax.tree.map(lambda p: jnp.where(hit, jnp.full_like(p, jnp.nan), p), params)

    return corrupt


def make_programs(reps: replicas.Replicas, step_kwargs: dict, rounds: bool, fragments: bool,
              delay: int = 0, num_fragments: int = 1) -> tuple[Callable, Any]:  # fmt: skip
    """The run's two jitted programs over replicas (state donated): inner steps and sync step.

    With ``delay`` > 0 the second is one window program per fragment (exchange, delay - 1
    inner steps, merge), each fragment's phases known at compile time.
    """
    program = functools.partial(make_program, reps, **step_kwargs)
    if not rounds:
        return program(sync_step=None), None
    if delay:
        windows = tuple(make_window_program(reps, delay=delay, **step_kwargs,
                                            fragment=p if fragments else None)
                        for p in range(num_fragments if fragments else 1))  # fmt: skip
        return program(sync_step=False, merge_step=False), windows
    # With fragments the sync step picks its fragment from the step counter.
    return program(sync_step=False), program(sync_step=None if fragments else True)


def check_memory(s: TrainSettings, vocab_size: int, tx: Any) -> None:
    """Refuses a state that cannot fit, from shapes only (nothing is allocated)."""
    abstract = abstract_model(s, vocab_size)[2]
    backend, stages, split = s.backend, 1, s.mesh.fsdp * s.mesh.tensor
    if s.num_stages > 1:  # stages split a replica only on the (replica, stage) mesh
        backend = "shard_map" if stage_mesh(s) else "vmap"
        stages = s.num_stages if backend == "shard_map" else 1
    elif backend == "auto":  # make_replicas' rule: a split replica always needs its devices
        spans = split > 1 or 1 < s.num_replicas <= jax.device_count()
        backend = "shard_map" if spans else "vmap"
    per_device = memory.state_bytes_per_device(abstract, tx, num_replicas=s.num_replicas,
                                               backend=backend, num_stages=stages)
    per_device //= split  # a replica split over F x T devices
    used = (1 if backend == "vmap" else s.num_replicas) * stages * split
    # This host's share: with several processes (hosts) each holds its own devices' state.
    memory.check_fits(per_device, min(used, jax.local_device_count()), preset=s.model.preset,
                      backend=backend, init_from=s.model.init_from)  # fmt: skip


def _skip_config(s: TrainSettings, num_layers: int) -> Any:
    if s.skip.num_stages == 0:
        return None
    check_stages(num_layers, s.skip.num_stages, field="config.skip.num_stages")
    return SkipConfig(s.skip.num_stages, s.skip.path_length, num_layers // s.skip.num_stages,
                      s.skip.full_every, s.skip.swaps, s.seed)  # fmt: skip
