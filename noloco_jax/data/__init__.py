"""Data: TFDS-backed corpora, tokenizers, token streams and per-replica batches."""

from noloco_jax.data.batches import (
    ReplicaBatcher,
    eval_windows,
    load_token_stream,
    tokenize_documents,
)
from noloco_jax.data.sources import (
    SOURCES,
    Corpus,
    CorpusUnavailableError,
    default_data_dir,
    load_corpus,
)
from noloco_jax.data.tokenizers import (
    TOKENIZERS,
    ByteTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    make_tokenizer,
    train_sentencepiece,
)

__all__ = [
    "SOURCES",
    "TOKENIZERS",
    "ByteTokenizer",
    "Corpus",
    "CorpusUnavailableError",
    "ReplicaBatcher",
    "SentencePieceTokenizer",
    "Tokenizer",
    "default_data_dir",
    "eval_windows",
    "load_corpus",
    "load_token_stream",
    "make_tokenizer",
    "tokenize_documents",
    "train_sentencepiece",
]
