"""Token streams and deterministic per-replica batches with a checkpointable position.

A batch is a pure function of the step, so the data position of a run is its
step: resuming at step s yields exactly the batches an uninterrupted run
would have seen.

Windows: the stream is cut into windows of ``seq_len + 1`` tokens at stride
``seq_len`` (window ``w`` is ``tokens[w * seq_len : (w + 1) * seq_len + 1]``).
Their targets ``w[1:]`` never overlap, so every token of the stream is
predicted at most once per epoch; neighbouring windows share only the one
boundary token, as an input of the later window and a target of the earlier.
"""

from __future__ import annotations

import hashlib
import pathlib
from typing import Any, Sequence

import numpy as np

from noloco_jax.data.sources import texts_digest
from noloco_jax.data.token_files import TokenFile, write_tokens
from noloco_jax.errors import check_bool, check_documents, check_int

__all__ = ["tokenize_documents", "load_token_stream", "ReplicaBatcher", "eval_windows"]


def tokenize_documents(docs: Sequence[str], tokenizer: Any) -> np.ndarray:
    """One int32 stream: each document's ids followed by ``tokenizer.eos_id`` (and preceded by
    ``tokenizer.bos_ids``, else ``tokenizer.bos_id`` where it is not None: Hugging Face Llamas)."""
    check_documents("docs", docs)
    bos = getattr(tokenizer, "bos_ids", None)
    if bos is None:
        bos = () if getattr(tokenizer, "bos_id", None) is None else (tokenizer.bos_id,)
    parts = []
    for doc in docs:
        if bos:
            parts.append(np.asarray(bos, np.int32))
        parts.append(tokenizer.encode(doc))
        parts.append(np.asarray([tokenizer.eos_id], np.int32))
    return np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)


def load_token_stream(
    corpus: Any, tokenizer: Any, split: str, cache_dir: str | pathlib.Path, *,
    on_disk: bool = False,
) -> np.ndarray | TokenFile:
    """The tokenized ``split`` of ``corpus`` (``tokenize_documents``), cached as .npy.

    The cache file, ``cache_dir/tokens/<corpus name>-<text hash>-<tokenizer
    name>-<split>.npy``, is keyed by the corpus name, a hash of the split's
    text and the tokenizer's identity (``"byte256"``, the SentencePiece
    model's hash, or the Hugging Face tokenizer's hash of its tokenizer.json and
    its end/start ids), so a corpus is tokenized once and a changed one again. It
    holds the smallest unsigned dtype of the vocabulary (``token_dtype``).

    Args:
      corpus: the ``Corpus``.
      tokenizer: its tokenizer.
      split: "train" or "validation".
      cache_dir: root of the cache.
      on_disk: return a ``TokenFile`` reading the cache window by window instead of an
        int32 array in memory.
    """
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}.")
    check_bool("on_disk", on_disk)  # "no" was truthy: a TokenFile came back
    docs = getattr(corpus, split)
    key = f"{corpus.name}-{texts_digest(docs)}-{tokenizer.name}-{split}.npy"
    path = pathlib.Path(cache_dir) / "tokens" / key
    if path.exists():
        try:
            return _open_cache(path, on_disk)
        except (ValueError, EOFError, OSError) as err:  # truncated or damaged cache file
            print(f"WARNING: token cache {path} is unreadable ({type(err).__name__}: "
                  f"{str(err)[:200]}); rebuilding it.", flush=True)
            path.unlink(missing_ok=True)
    parts = (tokenize_documents([doc], tokenizer) for doc in docs)
    write_tokens(path, parts, tokenizer.vocab_size)
    return _open_cache(path, on_disk)


def _open_cache(path: pathlib.Path, on_disk: bool) -> np.ndarray | TokenFile:
    return TokenFile(path) if on_disk else np.load(path).astype(np.int32)


def _as_ids(tokens: Any) -> np.ndarray:
    """An in-memory stream as int32 ids; non-integer values or ids beyond int32 are refused."""
    array = np.asarray(tokens)
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"tokens must hold integer ids, got dtype {array.dtype}.")
    if array.size and (array.min() < 0 or array.max() > np.iinfo(np.int32).max):
        raise ValueError(f"token ids must be in [0, 2**31 - 1], got {array.min()}..{array.max()}.")
    return array.astype(np.int32)


def _as_stream(tokens: Any) -> np.ndarray | TokenFile:
    """``_as_ids`` of an in-memory 1-D stream; a ``TokenFile`` after the same range check (one
    chunked pass, cached for ``digest``): its windows are read as int32."""
    if not isinstance(tokens, TokenFile):
        ids = _as_ids(tokens)
        if ids.ndim != 1:  # eval_windows read rows of a 2-D array as tokens
            raise ValueError(f"tokens must be a 1-D stream, got shape {ids.shape}.")
        return ids
    low, top = tokens.min_id(), tokens.max_id()  # an empty file: 0 and -1
    if low < 0 or top > np.iinfo(np.int32).max:
        bad = low if low < 0 else top
        raise ValueError(f"token ids must be in [0, 2**31 - 1], but {tokens.path} holds id {bad}.")
    return tokens


class ReplicaBatcher:
    """Per-replica training batches from one token stream.

    The stream is cut into windows of ``seq_len + 1`` tokens at stride
    ``seq_len`` (inputs ``w[:-1]``, targets ``w[1:]``; targets never overlap,
    see the module doc). A seeded permutation deals the windows to the
    replicas round-robin once, so each replica owns a disjoint shard for the
    whole run (the NoLoCo reference code shards by sample index mod N). Every
    shard holds the same number of windows, a multiple of ``batch_size``; the
    few windows left over (fewer than ``num_replicas * batch_size`` plus the
    remainder of the deal) are never used. Each replica walks its shard in a
    fresh seeded order every epoch of its shard, visiting each of its windows
    exactly once per epoch; the epoch and the position in it follow from the
    step alone.

    Args:
      tokens: 1-D int token stream, in memory or a ``TokenFile`` (read window by window).
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
            check_int(name, value)
        check_int("seed", seed, minimum=0)
        self.tokens = _as_stream(tokens)
        self.num_replicas, self.batch_size, self.seq_len, self.seed = (
            num_replicas, batch_size, seq_len, seed)  # fmt: skip
        self.num_windows = max(len(self.tokens) - 1, 0) // seq_len
        self.steps_per_epoch = self.num_windows // num_replicas // batch_size
        self.windows_per_replica = self.steps_per_epoch * batch_size
        if self.steps_per_epoch < 1:
            need = num_replicas * batch_size * seq_len + 1
            raise ValueError(
                f"the training stream is too small: {len(self.tokens)} tokens give "
                f"{self.num_windows // num_replicas} windows of {seq_len + 1} tokens per replica, "
                f"but a batch needs {batch_size}; at least {need} tokens are needed for "
                f"num_replicas={num_replicas}, batch_size={batch_size}, seq_len={seq_len}. Use a "
                f"larger corpus or fewer replicas, a smaller batch or a shorter seq_len (the "
                f"trainer's config.num_replicas, config.global_batch_size / num_replicas and "
                f"config.data.seq_len)."
            )
        # int32 ids while they fit: 4 bytes per window, half of numpy's default. Shuffling an
        # arange of either dtype draws the same order as ``permutation(num_windows)``.
        self._ids_dtype = np.int32 if self.num_windows < 2**31 else np.int64
        dealt = np.random.default_rng([seed, 0]).permutation(self._arange(self.num_windows))
        used = dealt[: self.windows_per_replica * num_replicas]
        self._shards = np.ascontiguousarray(used.reshape(self.windows_per_replica, num_replicas).T)
        del dealt, used
        self._digest: str | None = None
        self._order_cache: dict[tuple[int, int], np.ndarray] = {}
        self._offsets = np.arange(seq_len + 1)

    def _arange(self, n: int) -> np.ndarray:
        return np.arange(n, dtype=self._ids_dtype)

    def shard(self, replica: int) -> np.ndarray:
        """Window ids owned by ``replica`` (sorted)."""
        check_int("replica", replica, minimum=0)
        if replica >= self.num_replicas:
            raise ValueError(f"replica must be < num_replicas={self.num_replicas}, got {replica}.")
        return np.sort(self._shards[replica])

    def _order(self, replica: int, epoch: int) -> np.ndarray:
        key = (replica, epoch)
        if key not in self._order_cache:
            if len(self._order_cache) > 4 * self.num_replicas:
                self._order_cache.clear()
            rng = np.random.default_rng([self.seed, 1, replica, epoch])
            order = rng.permutation(self._arange(self.windows_per_replica))
            self._order_cache[key] = self._shards[replica][order]
        return self._order_cache[key]

    def window_ids(self, step: int, replicas: Sequence[int] | None = None) -> np.ndarray:
        """Window ids of every (or each listed) replica's batch at ``step``: [N, B]."""
        check_int("step", step, minimum=0)
        epoch, k = divmod(step, self.steps_per_epoch)
        sl = slice(k * self.batch_size, (k + 1) * self.batch_size)
        rows = range(self.num_replicas) if replicas is None else replicas
        for r in rows:
            check_int("replicas", r, 0, self.num_replicas - 1)
        ids = [self._order(r, epoch)[sl] for r in rows]  # none listed: [0, B], not a crash
        return np.asarray(ids, np.int64).reshape(len(ids), self.batch_size)

    def batch(self, step: int, replicas: Sequence[int] | None = None) -> np.ndarray:
        """int32 [num_replicas, batch_size, seq_len + 1] (only ``replicas``' rows if given).

        From a ``TokenFile`` only these windows are read; the values are the same either way.
        """
        ids = self.window_ids(step, replicas)
        if isinstance(self.tokens, TokenFile):
            return self.tokens.gather(ids * self.seq_len, self.seq_len + 1)
        return self.tokens[ids[..., None] * self.seq_len + self._offsets]

    def state(self) -> dict:
        """JSON-able description of the data order, stored in checkpoints.

        Two batchers with equal states yield identical batches at every step.
        ``tokens_sha256`` is a hash of the stream (a changed corpus of the same
        length is caught too).
        """
        if self._digest is None and isinstance(self.tokens, TokenFile):
            self._digest = self.tokens.digest()
        if self._digest is None:
            self._digest = hashlib.sha256(self.tokens.tobytes()).hexdigest()[:16]
        return {
            "seed": self.seed,
            "num_replicas": self.num_replicas,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "num_windows": self.num_windows,
            "tokens_sha256": self._digest,
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
    """Validation windows, int32 [num, seq_len + 1], evenly spread over the stream.

    The windows are those of ``ReplicaBatcher`` (stride ``seq_len``, targets
    never overlapping). All of them by default; with ``max_windows`` smaller
    than their number, ``max_windows`` of them at evenly spaced positions from
    the first to the last, so every part of the validation split (e.g. every
    held-out play) is represented. Deterministic; empty when the stream holds
    fewer than ``seq_len + 1`` tokens.
    """
    check_int("seq_len", seq_len)
    if max_windows is not None:
        check_int("max_windows", max_windows)
    tokens = _as_stream(tokens)
    total = max(len(tokens) - 1, 0) // seq_len
    ids = np.arange(total)
    if max_windows is not None and max_windows < total:
        ids = np.linspace(0, total - 1, max_windows).round().astype(np.int64)
    if not total:
        return np.zeros((0, seq_len + 1), np.int32)
    if isinstance(tokens, TokenFile):
        return tokens.gather(ids * seq_len, seq_len + 1)
    return tokens[ids[:, None] * seq_len + np.arange(seq_len + 1)]
