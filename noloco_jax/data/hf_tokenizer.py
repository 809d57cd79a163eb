"""A local Hugging Face ``tokenizer.json`` (the ``tokenizers`` package; the ``[hf]`` extra)."""

from __future__ import annotations

import hashlib
import json
import pathlib
from typing import Iterable

import numpy as np

__all__ = ["HFTokenizer"]

# End-of-document tokens tried, in order, when tokenizer_config.json names none.
_EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eot_id|>")


class HFTokenizer:
    """The fast tokenizer stored in ``DIR/tokenizer.json`` (never downloaded).

    The end-of-document id is ``eos_token`` of ``DIR/tokenizer_config.json`` when present (it
    must be in the vocabulary), else the first of ``</s>``, ``<|endoftext|>``, ``<|end_of_text|>``, ``<eos>``,
    ``<|eot_id|>`` in the vocabulary. ``name`` ("hf" + a hash of tokenizer.json) keys caches.

    Args:
      path: the directory holding ``tokenizer.json``, or that file itself.

    Raises:
      FileNotFoundError: no tokenizer.json there.
      ImportError: the ``tokenizers`` package is missing (``pip install 'noloco-jax[hf]'``).
      ValueError: no end-of-document token can be found, or the configured one is unknown.
    """

    def __init__(self, path: str | pathlib.Path):
        path = pathlib.Path(path).expanduser()
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(
                f"config.data.tokenizer_path={str(path)!r} holds no tokenizer.json (give the "
                f"directory of a Hugging Face tokenizer, e.g. what save_pretrained wrote)."
            )
        try:
            from tokenizers import Tokenizer  # noqa: PLC0415
        except ImportError as err:
            raise ImportError(
                "config.data.tokenizer='hf' needs the 'tokenizers' package: "
                "pip install 'noloco-jax[hf]' (or pip install tokenizers)."
            ) from err
        blob = file.read_bytes()
        self._tok = Tokenizer.from_str(blob.decode("utf-8"))
        # A document that spells "</s>" out is text: only the loader ends documents.
        self._tok.encode_special_tokens = True
        self.path = file
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.eos_id = self._find_eos(file.parent)
        # v2: special-token text is encoded as text (streams cached before used the specials)
        self.name = "hf" + hashlib.sha256(blob + b"v2").hexdigest()[:12]

    def _find_eos(self, directory: pathlib.Path) -> int:
        names = list(_EOS_CANDIDATES)
        config = directory / "tokenizer_config.json"
        if config.is_file():
            eos = json.loads(config.read_text()).get("eos_token")
            eos = eos.get("content") if isinstance(eos, dict) else eos
            if eos and self._tok.token_to_id(eos) is None:
                raise ValueError(f"{config}'s eos_token {eos!r} is not in the vocabulary of "
                                 f"{str(self.path)!r}; fix tokenizer_config.json.")  # fmt: skip
            if eos:
                names.insert(0, eos)
        for name in names:
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                return int(token_id)
        raise ValueError(
            f"the tokenizer {str(self.path)!r} has no end-of-document token (tried "
            f"tokenizer_config.json's eos_token and {list(_EOS_CANDIDATES)}); add one."
        )

    def encode(self, text: str) -> np.ndarray:
        """int32 ids of ``text`` (no special tokens added; special-token text is encoded as text)."""
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; eos ids are dropped."""
        return self._tok.decode([int(i) for i in ids if int(i) != self.eos_id])
