"""``--config.model.init_from=DIR``: start every replica from a Hugging Face Llama checkpoint."""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import jax
import numpy as np

from noloco_jax.errors import is_int
from noloco_jax.models import LlamaConfig, init_params
from noloco_jax.models.hf import load_llama, read_config, save_llama
from noloco_jax.replicas import to_host
from noloco_jax.trainer.settings import TrainSettings

__all__ = ["prepare_hf_model", "export_run"]


def prepare_hf_model(s: TrainSettings, vocab_size: int) -> tuple[LlamaConfig, Any, Any]:
    """Config, graphdef and params of ``s.model.init_from`` (replaces the preset's shape).

    Args:
      s: the run settings (``model.init_from`` set).
      vocab_size: the tokenizer's vocabulary size.

    Returns:
      (cfg, graphdef, params), the checkpoint's weights for every replica, as NumPy arrays in
      host memory (no device holds the whole replica).

    Raises:
      ValueError: the model's vocabulary is smaller than the tokenizer's (a larger, padded
        one is fine), config.model.vocab_size is set to another, seq_len exceeds the
        model's positions, or a tied model is asked to run as routed pipeline stages.
      FileNotFoundError: a missing directory, config.json or safetensors file.
    """
    try:  # checked before any weight is read
        cfg = read_config(s.model.init_from)
    except (FileNotFoundError, ValueError) as err:  # hf's message names the path, not the field
        kind = FileNotFoundError if isinstance(err, FileNotFoundError) else ValueError
        raise kind(f"config.model.init_from: {err}") from err
    from noloco_jax.trainer.build import model_vocab  # noqa: PLC0415 (build imports this lazily)

    model_vocab(s, vocab_size, init_vocab=cfg.vocab_size)  # a padded table (larger) is fine
    if s.data.seq_len > cfg.max_seq_len:
        raise ValueError(f"config.data.seq_len={s.data.seq_len} exceeds the init_from model's "
                         f"max_position_embeddings={cfg.max_seq_len}.")  # fmt: skip
    if cfg.tie_embeddings and s.num_stages > 1:
        raise ValueError("config.num_stages > 1 cannot split a model with tied embeddings "
                         "(the first and last stage would share one table).")  # fmt: skip
    cfg, graphdef, params = load_llama(s.model.init_from, dtype=s.model.dtype,
                                       param_dtype=s.model.param_dtype, host=True)  # fmt: skip
    if s.model.remat:  # the same weights, run by a model that recomputes its blocks
        cfg = dataclasses.replace(cfg, remat=True)
        graphdef = jax.eval_shape(lambda: init_params(cfg, 0))[0]
    return cfg, graphdef, params


def export_run(
    s: TrainSettings, workdir: str | pathlib.Path, out: str | pathlib.Path,
    *, replica: int | None = None,
) -> pathlib.Path:
    """Saves a run's latest checkpoint as a Hugging Face ``LlamaForCausalLM`` directory.

    ``config.json`` names the run's tokenizer's ``eos_token_id`` and ``bos_token_id``.

    Args:
      s: the run's settings.
      workdir: the run's workdir.
      out: the directory to write (config.json + model.safetensors).
      replica: which replica to export; None = the replica-averaged model.

    Returns:
      ``out``.

    Raises:
      ValueError: ``replica`` is not None or an int in [0, num_replicas), or the weights to
        export are non-finite.
    """
    from noloco_jax.trainer.build import model_config  # noqa: PLC0415
    from noloco_jax.trainer.loop import load_run  # noqa: PLC0415

    if replica is not None and not (is_int(replica) and 0 <= replica < s.num_replicas):
        raise ValueError(f"replica must be None or an int in [0, {s.num_replicas}), got "
                         f"{replica!r}.")  # checked before the run is read
    _, params, data = load_run(s, workdir)
    _check_finite(params, replica)
    # config.json only: prepare_model read an init_from model's weights again (load_run has)
    cfg = model_config(s, data.tokenizer.vocab_size)
    pick = lambda x: x.mean(0) if replica is None else _replica_on_host(x, replica)  # noqa: E731
    single = jax.tree.map(pick, params)
    tok = data.tokenizer  # its special ids, or generation in transformers stops at Llama's
    return save_llama(out, cfg, single, eos_token_id=tok.eos_id,
                      bos_token_id=getattr(tok, "bos_id", None))


def _replica_on_host(x: Any, i: int) -> np.ndarray:
    """Replica ``i`` of ``x`` on the host, copied from the shards that hold it (each part
    once): ``to_host(x)[i]`` copied every replica to the host to keep one."""
    if not isinstance(x, jax.Array) or not x.is_fully_addressable:
        return to_host(x)[i]
    out, copied = np.empty(x.shape[1:], x.dtype), set()
    for shard in x.addressable_shards:
        first, stop, _ = shard.index[0].indices(x.shape[0])
        part = repr(shard.index[1:])
        if first <= i < stop and part not in copied:
            out[shard.index[1:]] = np.asarray(shard.data[i - first])
            copied.add(part)
    return out


def _check_finite(params: Any, replica: int | None) -> None:
    """Refuses to export non-finite weights: the NaN fast weights of a replica the non-finite
    guard had not repaired by the run's last step (they also make the averaged model NaN)."""
    from noloco_jax.trainer.health import finite_replicas  # noqa: PLC0415

    ok = finite_replicas(params)
    bad = np.flatnonzero(~ok).tolist() if replica is None else [replica] * (not ok[replica])
    if bad:
        raise ValueError(f"replica={replica!r}: the weights of replica(s) {bad} are non-finite "
                         f"(not repaired by the run's last step); export one of the finite "
                         f"replicas {np.flatnonzero(ok).tolist()} (replica=i), or resume the "
                         f"run up to its next sync, which repairs them.")  # fmt: skip
