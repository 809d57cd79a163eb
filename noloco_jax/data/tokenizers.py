"""Tokenizers that need no downloaded assets: UTF-8 bytes, or SentencePiece trained locally."""

from __future__ import annotations

import hashlib
import pathlib
from typing import Iterable, Protocol

import numpy as np

__all__ = [
    "Tokenizer",
    "ByteTokenizer",
    "SentencePieceTokenizer",
    "train_sentencepiece",
    "make_tokenizer",
    "TOKENIZERS",
]

TOKENIZERS = ("byte", "sentencepiece")


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    vocab_size: int
    eos_id: int
    name: str

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; id 0 (NUL, stripped from text) ends documents."""

    vocab_size = 256
    eos_id = 0
    name = "byte256"

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.replace("\x00", "").encode("utf-8"), np.uint8).astype(np.int32)

    def decode(self, ids: Iterable[int]) -> str:
        data = bytes(int(i) for i in ids if int(i) != self.eos_id)
        return data.decode("utf-8", errors="replace")


class SentencePieceTokenizer:
    """A SentencePiece model file (trained by ``train_sentencepiece``)."""

    def __init__(self, model_path: str | pathlib.Path):
        import sentencepiece as spm  # noqa: PLC0415

        self.model_path = pathlib.Path(model_path)
        blob = self.model_path.read_bytes()
        self._sp = spm.SentencePieceProcessor(model_proto=blob)
        self.vocab_size = int(self._sp.get_piece_size())
        self.eos_id = int(self._sp.eos_id())
        self.name = "sp" + hashlib.sha256(blob).hexdigest()[:12]

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._sp.encode(text), np.int32)

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids if int(i) != self.eos_id])


def train_sentencepiece(
    texts: Iterable[str],
    *,
    vocab_size: int,
    model_path: str | pathlib.Path,
    seed: int = 0,
) -> SentencePieceTokenizer:
    """Trains a BPE SentencePiece model locally (reuses ``model_path`` if it exists).

    Args:
      texts: training documents.
      vocab_size: size of the vocabulary (> 259: bytes + specials are reserved).
      model_path: where the ``.model`` file goes.
      seed: recorded for determinism (training itself is single-threaded and
        deterministic for a given input).

    Returns:
      The trained tokenizer.
    """
    model_path = pathlib.Path(model_path)
    if model_path.exists():
        return SentencePieceTokenizer(model_path)
    if vocab_size <= 260:
        raise ValueError(
            f"vocab_size must be > 260 for sentencepiece (256 byte-fallback pieces + specials), "
            f"got {vocab_size}."
        )
    import sentencepiece as spm  # noqa: PLC0415

    model_path.parent.mkdir(parents=True, exist_ok=True)
    lines = (line for text in texts for line in text.splitlines() if line.strip())
    tmp_prefix = model_path.with_suffix(f".tmp{seed}")
    spm.SentencePieceTrainer.train(
        sentence_iterator=lines,
        model_prefix=str(tmp_prefix),
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        num_threads=1,
        pad_id=-1,
        unk_id=0,
        bos_id=-1,
        eos_id=1,
        minloglevel=2,
    )
    tmp_prefix.with_suffix(".model").replace(model_path)
    tmp_prefix.with_suffix(".vocab").unlink(missing_ok=True)
    return SentencePieceTokenizer(model_path)


def make_tokenizer(
    kind: str,
    *,
    corpus=None,
    vocab_size: int | None = None,
    cache_dir: str | pathlib.Path | None = None,
) -> Tokenizer:
    """A tokenizer by name.

    Args:
      kind: ``"byte"`` or ``"sentencepiece"``.
      corpus: the ``Corpus`` a SentencePiece model is trained on (its train split).
      vocab_size: ``None``/256 for bytes; required for SentencePiece.
      cache_dir: where trained SentencePiece models are cached.

    Returns:
      The tokenizer.
    """
    if kind == "byte":
        if vocab_size not in (None, 256):
            raise ValueError(f"the byte tokenizer has exactly 256 ids; got vocab_size={vocab_size}.")
        return ByteTokenizer()
    if kind == "sentencepiece":
        if corpus is None or not vocab_size or cache_dir is None:
            raise ValueError("sentencepiece needs corpus=, vocab_size= and cache_dir=.")
        path = pathlib.Path(cache_dir) / "tokenizers" / f"{corpus.name}_sp{vocab_size}.model"
        return train_sentencepiece(corpus.train, vocab_size=vocab_size, model_path=path)
    raise ValueError(f"tokenizer kind must be one of {list(TOKENIZERS)}, got {kind!r}.")
