"""Tokenizers that need no downloaded assets: UTF-8 bytes, or SentencePiece trained locally."""

from __future__ import annotations

import collections
import hashlib
import io
import pathlib
import re
import uuid
from typing import Iterable, Protocol

import numpy as np

from noloco_jax.errors import check_documents

__all__ = [
    "Tokenizer",
    "ByteTokenizer",
    "SentencePieceTokenizer",
    "train_sentencepiece",
    "make_tokenizer",
    "well_formed",
    "TOKENIZERS",
    "SP_RESERVED",
]

TOKENIZERS = ("byte", "sentencepiece", "hf")


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer.

    ``name`` identifies the vocabulary (``"byte256"``, or ``"sp"`` + a hash of
    the SentencePiece model) in the token-stream cache keys.
    """

    vocab_size: int
    eos_id: int
    name: str

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids: Iterable[int]) -> str: ...


def decode_ids(ids: Iterable[int], vocab_size: int) -> np.ndarray:
    """``ids`` as a flat int64 array, or a ``ValueError``: ids are integers in [0, vocab_size)
    (a float id was truncated or dropped, an id past the vocabulary decoded as another)."""
    arr = np.asarray(ids if hasattr(ids, "__array__") else list(ids))
    if arr.size and not np.issubdtype(arr.dtype, np.integer):  # bool is not an integer dtype
        raise ValueError(f"token ids must be integers, got an array of dtype {arr.dtype}.")
    arr = arr.astype(np.int64).ravel()
    if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
        raise ValueError(f"token ids must be in [0, {vocab_size - 1}], got "
                         f"{arr.min()}..{arr.max()}.")  # fmt: skip
    return arr


def well_formed(text: str) -> str:
    """``text`` with each lone surrogate (not encodable as UTF-8) replaced by U+FFFD.

    A high and a low surrogate written as two code points in a row join into their
    character, as UTF-16 would read them.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; id 0 (NUL, stripped from text) ends documents."""

    vocab_size = 256
    eos_id = 0
    name = "byte256"

    def encode(self, text: str) -> np.ndarray:
        """UTF-8 bytes of ``text`` (NUL characters, reserved for eos, are dropped; a lone
        surrogate, which UTF-8 cannot hold, becomes U+FFFD)."""
        data = well_formed(text.replace("\x00", "")).encode("utf-8")
        return np.frombuffer(data, np.uint8).astype(np.int32)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; eos ids are dropped, invalid UTF-8 becomes U+FFFD."""
        arr = decode_ids(ids, self.vocab_size)
        return arr[arr != self.eos_id].astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class SentencePieceTokenizer:
    """A SentencePiece model file (trained by ``train_sentencepiece``).

    ``name`` ("sp" + a hash of the model file) identifies the model in cache keys.
    """

    def __init__(self, model_path: str | pathlib.Path):
        import sentencepiece as spm  # noqa: PLC0415

        self.model_path = pathlib.Path(model_path)
        blob = self.model_path.read_bytes()
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=blob)
        except RuntimeError as err:  # a truncated or damaged file: a C++ parse error
            raise ValueError(f"{self.model_path} is not a SentencePiece model ({err}).") from err
        self.vocab_size = int(self._sp.get_piece_size())
        if not self.vocab_size:  # an empty file parses as a model of no pieces
            raise ValueError(f"{self.model_path} is not a SentencePiece model (no pieces).")
        self.eos_id = int(self._sp.eos_id())
        self.name = "sp" + hashlib.sha256(blob).hexdigest()[:12]

    def encode(self, text: str) -> np.ndarray:
        """int32 ids of ``text`` (no eos appended; a lone surrogate becomes U+FFFD)."""
        return np.asarray(self._sp.encode(well_formed(text)), np.int32)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; eos ids are dropped."""
        arr = decode_ids(ids, self.vocab_size)
        return self._sp.decode(arr[arr != self.eos_id].tolist())


_SP_SPECIALS = 2  # unk (never produced: byte fallback covers everything) and eos
SP_RESERVED = 256 + _SP_SPECIALS  # ids a sentencepiece vocabulary holds before any merge
_SP_MAX_LINES = 2_000_000


# SentencePiece skips a training line over max_sentence_length bytes (default 4192) without a
# word; a corpus of one paragraph per line trained on a fraction of its text, or failed.
_MAX_LINE_BYTES = 4000


def _nbytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _spans(line: str, start: int, end: int, limit: int) -> list[tuple[int, int]]:
    """``line[start:end]`` as one span, or cut between characters into spans of at most
    ``limit`` UTF-8 bytes when it is longer (a word over the limit: CJK text, a URL)."""
    if _nbytes(line[start:end]) <= limit:
        return [(start, end)]
    spans, a, size = [], start, 0
    for i in range(start, end):
        n = _nbytes(line[i])
        if size + n > limit:
            spans.append((a, i))
            a, size = i, 0
        size += n
    return spans + [(a, end)]


def _split_long(line: str, limit: int = _MAX_LINE_BYTES) -> list[str]:
    """``line`` cut before whitespace into pieces of at most ``limit`` UTF-8 bytes (a word, or
    the trailing whitespace, longer than that is cut between characters); pieces never span
    whitespace in training anyway."""
    if _nbytes(line) <= limit:
        return [line]
    pieces, start, size = [], 0, 0
    for match in re.finditer(r"\s*\S+|\s+", line):  # \s+ only matches trailing whitespace
        for a, b in _spans(line, match.start(), match.end(), limit):
            n = _nbytes(line[a:b])
            if size and size + n > limit:
                pieces.append(line[start:a])
                start, size = a, 0
            size += n
    pieces.append(line[start:])
    return [p for p in pieces if p.strip()]


def _training_lines(texts: Iterable[str], vocab_size: int, field: str = "vocab_size"
                    ) -> list[str]:  # fmt: skip
    """Non-blank lines of ``texts``, restricted to the characters the vocabulary can afford.

    SentencePiece needs a piece for every character it trains on. With a small
    vocabulary (or a corpus with many distinct characters, e.g. CJK) those would
    not fit, so only the most frequent ``(vocab_size - 258) // 2`` characters are
    kept in the training text (leaving at least as many slots for merges); all
    others still encode exactly, through the 256 byte-fallback pieces.
    """
    lines = [piece for text in texts for line in text.splitlines() if line.strip()
             for piece in _split_long(line)]  # fmt: skip
    counts = collections.Counter()
    for line in lines:
        counts.update(line)
    budget = max(1, (vocab_size - SP_RESERVED) // 2)
    if len(counts) > budget:
        keep = {ch for ch, _ in counts.most_common(budget)}
        table = {ord(ch): None for ch in counts if ch not in keep}
        lines = [line.translate(table) for line in lines]
        lines = [line for line in lines if line.strip()]
        if not lines:
            raise ValueError(
                f"{field}={vocab_size} leaves room for only {budget} character piece(s) "
                f"besides the {SP_RESERVED} reserved ones, and the {budget} most frequent "
                f"character(s) leave no text to learn merges from; use a larger {field}, "
                f"e.g. {SP_RESERVED + 2 * 64} or more.")  # fmt: skip
    return lines


def train_sentencepiece(
    texts: Iterable[str],
    *,
    vocab_size: int,
    model_path: str | pathlib.Path,
    seed: int = 0,
    field: str = "vocab_size",
) -> SentencePieceTokenizer:
    """Trains a byte-fallback BPE SentencePiece model locally; reuses ``model_path`` if it exists.

    The model keeps text exactly: no normalization, whitespace kept as is, and
    newlines and any character not in the vocabulary encode as UTF-8 byte
    pieces, so ``decode(encode(text)) == text`` for any text without U+2581
    ("\u2581", SentencePiece's space mark, which comes back as a space). Training is
    single-threaded on the text's lines and seeded, hence deterministic.

    Args:
      texts: training documents.
      vocab_size: size of the vocabulary, > 258 (256 byte pieces, unk and eos
        are reserved); the corpus must have enough distinct merges to fill it.
      model_path: where the ``.model`` file goes (written atomically).
      seed: seeds SentencePiece's sampling of lines (used when the corpus has
        more than two million lines).
      field: the name the messages give ``vocab_size`` ("config.data.tokenizer_vocab_size"
        in the trainer).

    Returns:
      The tokenizer.

    Raises:
      TypeError: ``texts`` is one str or bytes (its characters were taken for documents).
    """
    check_documents("texts", texts)
    model_path = pathlib.Path(model_path)
    if model_path.exists():
        tokenizer = SentencePieceTokenizer(model_path)
        if tokenizer.vocab_size != vocab_size:
            raise ValueError(
                f"{model_path} already holds a model with vocab_size={tokenizer.vocab_size}, "
                f"not {vocab_size}; remove it or choose another model_path."
            )
        return tokenizer
    _check_vocab_size(vocab_size)
    import sentencepiece as spm  # noqa: PLC0415

    lines = _training_lines(texts, vocab_size, field)
    if not lines:
        raise ValueError("cannot train sentencepiece: the training texts are empty.")
    spm.set_random_generator_seed(seed)
    proto = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_writer=proto,
            vocab_size=vocab_size,
            model_type="bpe",
            byte_fallback=True,
            character_coverage=1.0,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            input_sentence_size=_SP_MAX_LINES,
            shuffle_input_sentence=True,
            num_threads=1,
            pad_id=-1,
            unk_id=0,
            bos_id=-1,
            eos_id=1,
            minloglevel=2,
        )
    except RuntimeError as err:
        raise ValueError(
            f"sentencepiece training with {field}={vocab_size} failed (more pieces than this "
            f"corpus has merges for, or too few for its characters): {err}"
        ) from err
    model_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = model_path.with_name(f"{model_path.name}.tmp.{uuid.uuid4().hex}")  # hosts share pids
    try:
        tmp.write_bytes(proto.getvalue())
        tmp.replace(model_path)
    finally:  # a full disk leaves no partial temporary file behind
        tmp.unlink(missing_ok=True)
    return SentencePieceTokenizer(model_path)


def _check_vocab_size(vocab_size: object) -> None:
    valid = isinstance(vocab_size, int) and not isinstance(vocab_size, bool)
    if not valid or vocab_size <= SP_RESERVED:
        raise ValueError(
            f"vocab_size must be an integer > {SP_RESERVED} for sentencepiece (256 byte-fallback "
            f"pieces, unk and eos are reserved), got {vocab_size!r}."
        )


def _drop_damaged(path: pathlib.Path, vocab_size: int) -> None:
    """Removes a cached model that does not load, or not with the ``vocab_size`` its name
    says (a truncated or emptied file), with a warning: it is trained again, as a damaged
    token cache is rebuilt."""
    if not path.exists():
        return
    try:
        loaded = SentencePieceTokenizer(path).vocab_size
    except ValueError as err:
        loaded, why = None, str(err)
    else:
        why = f"{path} holds {loaded} pieces, not {vocab_size}."
    if loaded != vocab_size:
        print(f"WARNING: a cached SentencePiece model is damaged: {why[:400]} Training it "
              f"again.", flush=True)  # fmt: skip
        path.unlink(missing_ok=True)


def make_tokenizer(
    kind: str,
    *,
    corpus=None,
    vocab_size: int | None = None,
    cache_dir: str | pathlib.Path | None = None,
    path: str | pathlib.Path | None = None,
    field: str = "vocab_size",
) -> Tokenizer:
    """A tokenizer by name.

    Args:
      kind: ``"byte"``, ``"sentencepiece"`` or ``"hf"`` (a local ``tokenizer.json``).
      corpus: the ``Corpus`` a SentencePiece model is trained on (its train split).
      vocab_size: ``None`` or 256 for bytes; required for SentencePiece.
      cache_dir: trained SentencePiece models are cached in
        ``cache_dir/tokenizers``, keyed by corpus name, a hash of its training
        text and the vocabulary size; default ``default_data_dir()``.
      path: for ``"hf"``: the directory holding ``tokenizer.json``.
      field: the name a SentencePiece training error gives ``vocab_size``.

    Returns:
      The tokenizer.
    """
    if kind == "byte":
        if vocab_size not in (None, 256):
            raise ValueError(
                f"the byte tokenizer has exactly 256 ids (UTF-8 bytes); got vocab_size="
                f"{vocab_size}. Leave it unset, or use kind='sentencepiece' for another size."
            )
        return ByteTokenizer()
    if kind == "sentencepiece":
        if corpus is None or vocab_size is None:
            raise ValueError("the sentencepiece tokenizer needs corpus= and vocab_size=.")
        from noloco_jax.data.sources import default_data_dir, texts_digest  # noqa: PLC0415

        root = pathlib.Path(cache_dir) if cache_dir is not None else default_data_dir()
        # v2: lines over 4000 bytes are split (SentencePiece skipped them); v3: words too
        key = f"{corpus.name}-{texts_digest(corpus.train)}-sp{vocab_size}v3.model"
        path = root / "tokenizers" / key
        if not isinstance(vocab_size, (int, np.integer)):  # "300" took the cache of 300 for
            _check_vocab_size(vocab_size)  # a damaged one and removed it
        _drop_damaged(path, vocab_size)
        return train_sentencepiece(corpus.train, vocab_size=vocab_size, model_path=path,
                                   field=field)
    if kind == "hf":
        if not path:
            raise ValueError("the hf tokenizer needs path= (a directory with tokenizer.json).")
        from noloco_jax.data.hf_tokenizer import HFTokenizer  # noqa: PLC0415

        return HFTokenizer(path)
    raise ValueError(f"tokenizer kind must be one of {list(TOKENIZERS)}, got {kind!r}.")
