"""Token streams and deterministic per-replica batches with a checkpointable position.

A batch is a pure function of the step, so the data position of a run is its
step: resuming at step s yields exactly the batches an uninterrupted run
would have seen.
"""

from __future__ import annotations

import pathlib
from typing import Any, Sequence

import numpy as np

__all__ = ["tokenize_documents", "load_token_stream", "ReplicaBatcher", "eval_windows"]


def tokenize_documents(docs: Sequence[str], tokenizer: Any) -> np.ndarray:
    """One int32 stream: each document's ids followed by ``tokenizer.eos_id``."""
    parts = []
    for doc in docs:
        parts.append(tokenizer.encode(doc))
        parts.append(np.asarray([tokenizer.eos_id], np.int32))
    return np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)


def load_token_stream(
    corpus: Any, tokenizer: Any, split: str, cache_dir: str | pathlib.Path
) -> np.ndarray:
    """The tokenized ``split`` of ``corpus``, cached as .npy (tokenized once)."""
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}.")
    path = pathlib.Path(cache_dir) / "tokens" / f"{corpus.name}-{tokenizer.name}-{split}.npy"
    if path.exists():
        return np.load(path).astype(np.int32)
    tokens = tokenize_documents(getattr(corpus, split), tokenizer)
    path.parent.mkdir(parents=True, exist_ok=True)
    dtype = np.uint16 if tokenizer.vocab_size <= 65536 else np.int32
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, tokens.astype(dtype))
    tmp.replace(path)
    return tokens


def _check_int(name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")


class ReplicaBatcher:
    """Per-replica training batches from one token stream.

    The stream is cut into non-overlapping windows of ``seq_len + 1`` tokens
    (inputs ``w[:-1]``, targets ``w[1:]``). A seeded permutation deals the
    windows to replicas once, so each replica owns a disjoint shard for the
    whole run (the reference code shards by sample index mod N). Each replica
    walks its shard in a fresh seeded order every epoch.

    Args:
      tokens: 1-D int token stream.
      num_replicas: N.
      batch_size: sequences per replica per step.
      seq_len: tokens per input sequence.
      seed: seed of the dealing and of the epoch orders.
    """

    def __init__(
        self, tokens: np.ndarray, *, num_replicas: int, batch_size: int, seq_len: int, seed: int = 0
    ):
        for name, value in [("num_replicas", num_replicas), ("batch_size", batch_size),
                            ("seq_len", seq_len)]:  # fmt: skip
            _check_int(name, value)
        _check_int("seed", seed, minimum=0)
        self.tokens = np.asarray(tokens, np.int32)
        self.num_replicas, self.batch_size, self.seq_len, self.seed = (
            num_replicas, batch_size, seq_len, seed)  # fmt: skip
        self.num_windows = max(len(self.tokens) - 1, 0) // seq_len
        self.windows_per_replica = self.num_windows // num_replicas
        if self.windows_per_replica < batch_size:
            need = num_replicas * batch_size * seq_len + 1
            raise ValueError(
                f"the training stream is too small: {len(self.tokens)} tokens give "
                f"{self.windows_per_replica} windows of {seq_len + 1} per replica, but a batch "
                f"needs {batch_size}; at least {need} tokens are needed for num_replicas="
                f"{num_replicas}, batch_size={batch_size}, seq_len={seq_len}."
            )
        dealt = np.random.default_rng([seed, 0]).permutation(self.num_windows)
        used = dealt[: self.windows_per_replica * num_replicas]
        self._shards = used.reshape(self.windows_per_replica, num_replicas).T.copy()
        self.steps_per_epoch = self.windows_per_replica // batch_size
        self._order_cache: dict[tuple[int, int], np.ndarray] = {}
        self._offsets = np.arange(seq_len + 1)

    def shard(self, replica: int) -> np.ndarray:
        """Window ids owned by ``replica`` (sorted)."""
        return np.sort(self._shards[replica])

    def _order(self, replica: int, epoch: int) -> np.ndarray:
        key = (replica, epoch)
        if key not in self._order_cache:
            if len(self._order_cache) > 4 * self.num_replicas:
                self._order_cache.clear()
            rng = np.random.default_rng([self.seed, 1, replica, epoch])
            self._order_cache[key] = self._shards[replica][rng.permutation(self.windows_per_replica)]
        return self._order_cache[key]

    def window_ids(self, step: int) -> np.ndarray:
        """Window ids of every replica's batch at ``step``: [N, B]."""
        _check_int("step", step, minimum=0)
        epoch, k = divmod(step, self.steps_per_epoch)
        sl = slice(k * self.batch_size, (k + 1) * self.batch_size)
        return np.stack([self._order(r, epoch)[sl] for r in range(self.num_replicas)])

    def batch(self, step: int) -> np.ndarray:
        """int32 [num_replicas, batch_size, seq_len + 1]."""
        ids = self.window_ids(step)
        return self.tokens[ids[..., None] * self.seq_len + self._offsets]

    def state(self) -> dict:
        """JSON-able description, stored in checkpoints."""
        return {
            "seed": self.seed,
            "num_replicas": self.num_replicas,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "num_windows": self.num_windows,
        }

    @staticmethod
    def check_compatible(saved: dict, current: dict) -> None:
        """Raises ``ValueError`` naming what changed between two ``state()``s."""
        changed = [k for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)]
        if changed:
            detail = ", ".join(f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in changed)
            raise ValueError(
                f"the training data stream differs from the checkpoint's ({detail}); resuming "
                f"would not continue the same data order."
            )


def eval_windows(tokens: np.ndarray, *, seq_len: int, max_windows: int | None = None) -> np.ndarray:
    """Validation windows [num, seq_len + 1]: non-overlapping, evenly spread over the stream.

    With ``max_windows`` smaller than the number of windows, windows are taken
    at evenly spaced positions, so every part of the validation split (e.g.
    every held-out play) is represented. Deterministic.
    """
    _check_int("seq_len", seq_len)
    tokens = np.asarray(tokens, np.int32)
    total = max(len(tokens) - 1, 0) // seq_len
    ids = np.arange(total)
    if max_windows is not None and max_windows < total:
        ids = np.linspace(0, total - 1, max_windows).round().astype(np.int64)
    return tokens[ids[:, None] * seq_len + np.arange(seq_len + 1)] if total else np.zeros(
        (0, seq_len + 1), np.int32
    )
