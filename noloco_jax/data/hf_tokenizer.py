"""A local Hugging Face ``tokenizer.json`` (the ``tokenizers`` package; the ``[hf]`` extra)."""

from __future__ import annotations

import hashlib
import json
import pathlib
from typing import Any, Iterable

import numpy as np

from noloco_jax.data.tokenizers import decode_ids, well_formed
from noloco_jax.errors import UserError

__all__ = ["HFTokenizer"]

# End-of-document tokens tried, in order, when tokenizer_config.json names none.
_EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eot_id|>")


class HFTokenizer:
    """The fast tokenizer stored in ``DIR/tokenizer.json`` (never downloaded).

    The end-of-document id is ``eos_token`` of ``DIR/tokenizer_config.json`` when present (it
    must be in the vocabulary), else the first of ``</s>``, ``<|endoftext|>``, ``<|end_of_text|>``, ``<eos>``,
    ``<|eot_id|>`` in the vocabulary. ``bos_ids`` are the ids the tokenizer's saved
    post-processor puts first (Llama's ``<s>`` / ``<|begin_of_text|>``; all of them for
    ``"<s> <extra> $A"``), or ``()``; ``tokenizer_config.json``'s ``add_bos_token`` wins
    (false: none; true: its ``bos_token``), as transformers 4.x's ``LlamaTokenizerFast`` does
    (its ``PreTrainedTokenizerFast`` and transformers 5 keep the post-processor's, see
    ``_find_bos``). ``bos_id`` is the first, or None:
    the data pipeline starts each document with them, as the model saw text in pretraining (a Llama
    started from ``model.init_from`` scores text without it worse). ``name`` ("hf" + a hash of
    tokenizer.json and these ids) keys caches.

    Args:
      path: the directory holding ``tokenizer.json``, or that file itself.

    Raises:
      FileNotFoundError: no tokenizer.json there.
      UserError: (a ``ValueError``) the ``tokenizers`` package is missing (``pip install
        'noloco-jax[hf]'``).
      ValueError: no end-of-document token can be found, or the configured one is unknown, or
        the post-processor puts an id outside the vocabulary first, or ``add_bos_token: true``
        names an unknown ``bos_token`` (or none, and the post-processor puts none first).
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
            raise UserError(
                "config.data.tokenizer='hf' needs the 'tokenizers' package: "
                "pip install 'noloco-jax[hf]' (or pip install tokenizers)."
            ) from err
        blob = _read_bytes(file)
        self._tok = _parse(Tokenizer, blob, file)
        # A document that spells "</s>" out is text: only the loader ends documents. A saved
        # truncation or padding would cut or pad every whole document: both are turned off.
        self._tok.encode_special_tokens = True
        self._tok.no_truncation()
        self._tok.no_padding()
        self.path = file
        # Largest id + 1: added tokens may sit after a gap in the ids (then the count is less).
        ids = self._tok.get_vocab(with_added_tokens=True).values()
        self.vocab_size = max(ids, default=-1) + 1  # empty: _find_eos names the file
        config = file.parent / "tokenizer_config.json"
        fields = _read_config(config)
        self.eos_id = self._find_eos(config, fields)
        spec = json.loads(blob)
        bos_ids = self._find_bos(config, fields, spec)
        self._may_drop = _may_drop(spec)  # checked in encode, warned about once
        for bos in bos_ids or ():
            if not 0 <= bos < self.vocab_size:
                raise ValueError(f"{str(file)!r}'s post-processor puts id {bos} first, outside "
                                 f"its vocabulary of {self.vocab_size}; fix its special_tokens.")
        self.bos_ids: tuple[int, ...] = bos_ids or ()
        self.bos_id = self.bos_ids[0] if self.bos_ids else None
        # v4: documents start with bos_id when the tokenizer puts one first (v3: no truncation
        # or padding; v2: special-token text encoded as text); eos and bos shape the streams.
        bos_key = self.bos_id if len(self.bos_ids) < 2 else self.bos_ids  # v4 keys unchanged
        key = f"v4:{self.eos_id}:{bos_key}".encode()
        self.name = "hf" + hashlib.sha256(blob + key).hexdigest()[:12]

    def _find_eos(self, config: pathlib.Path, fields: Any) -> int:
        names = list(_EOS_CANDIDATES)
        if fields is not None:
            eos = fields.get("eos_token") if isinstance(fields, dict) else None
            eos = eos.get("content") if isinstance(eos, dict) else eos
            if not isinstance(fields, dict) or not isinstance(eos, (str, type(None))):
                raise ValueError(f"{config} must be a JSON object whose eos_token is a string (or "
                                 f"{{'content': string}}); fix or remove it.")  # fmt: skip
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

    def _find_bos(self, config: pathlib.Path, fields: Any, spec: dict) -> tuple[int, ...] | None:
        """tokenizer_config.json's add_bos_token wins over the post-processor: false adds nothing,
        true adds the config's bos_token (the post-processor's first ids when it names none).

        That is what transformers 4.x's LlamaTokenizerFast does (it rebuilds the post-processor
        from the config; checked with 4.57.6), the class a Llama-2 tokenizer_config names. Not
        every AutoTokenizer does: 4.57.6's PreTrainedTokenizerFast and GPT2TokenizerFast, and
        every class of transformers 5 (checked with 5.24.0, which drops add_bos_token and
        add_eos_token from the config when tokenizer.json exists), keep the saved
        post-processor's, so where the two disagree their input_ids start otherwise."""
        add = fields.get("add_bos_token") if isinstance(fields, dict) else None
        if add is False:
            return None
        bos = fields.get("bos_token") if add is True else None
        bos = bos.get("content") if isinstance(bos, dict) else bos
        if not bos:
            found = _template_bos(spec)
            if add is True and found is None:
                raise ValueError(f"{config} says add_bos_token: true but names no bos_token and "
                                 f"{str(self.path)!r} puts none first; set bos_token.")  # fmt: skip
            return found
        bos_id = self._tok.token_to_id(bos) if isinstance(bos, str) else None
        if bos_id is None:
            raise ValueError(f"{config}'s bos_token {bos!r} is not in the vocabulary of "
                             f"{str(self.path)!r}; fix tokenizer_config.json.")  # fmt: skip
        return (int(bos_id),)

    def encode(self, text: str) -> np.ndarray:
        """int32 ids of ``text`` (no special tokens added; special-token text is encoded as text;
        a lone surrogate, which ``tokenizers`` refuses, becomes U+FFFD as in ``ByteTokenizer``).

        Raises:
          ValueError: the tokenizer cannot encode a character of ``text`` (a Unigram or WordLevel
            model without an unk token).
        """
        text = well_formed(text)
        try:
            encoding = self._tok.encode(text, add_special_tokens=False)
        except Exception as err:  # tokenizers raises a bare Exception
            raise ValueError(f"the tokenizer {str(self.path)!r} cannot encode the text ({err}); "
                             f"give its model an unk token or set config.data.tokenizer_path "
                             f"to another.") from err  # fmt: skip
        lost = _lost_chars(text, encoding.offsets) if self._may_drop else 0
        if lost:
            self._may_drop = False  # once per tokenizer
            print(f"WARNING: the tokenizer {str(self.path)!r} drops characters it has no token "
                  f"for (its BPE model has neither unk_token nor byte_fallback): {lost} of a "
                  f"document's {len(text)}; the token streams lose them, as transformers' "
                  f"would.", flush=True)  # fmt: skip
        return np.asarray(encoding.ids, np.int32)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; eos and bos ids are dropped, every other special token (``<unk>``,
        added special tokens) is kept, as transformers' ``decode`` does by default
        (``skip_special_tokens=False``; ``tokenizers`` skips all of them by default)."""
        arr = decode_ids(ids, self.vocab_size)
        drop = [self.eos_id, *self.bos_ids]
        return self._tok.decode(arr[~np.isin(arr, drop)].tolist(), skip_special_tokens=False)


def _read_bytes(file: pathlib.Path) -> bytes:
    """``file``'s bytes, or a ``UserError`` naming it and the setting (a file the process may
    not read was a PermissionError traceback)."""
    try:
        return file.read_bytes()
    except PermissionError as err:
        raise UserError(f"{str(file)!r} cannot be read ({err.strerror}); fix its permissions "
                        f"or point config.data.tokenizer_path elsewhere.") from err


def _read_config(config: pathlib.Path) -> Any:
    """The parsed ``tokenizer_config.json`` (any JSON value), or None when there is none."""
    if not config.is_file():
        return None
    raw = _read_bytes(config)
    try:
        return json.loads(raw.decode("utf-8"))
    except ValueError as err:
        raise ValueError(f"{config} is not valid JSON ({err}); fix or remove it.") from err


def _may_drop(spec: Any) -> bool:
    """Whether the saved model is a BPE that silently drops characters outside its vocabulary
    (no ``unk_token``, no ``byte_fallback``); not one behind a byte-level pre-tokenizer (GPT-2,
    Llama 3: every character is bytes it has tokens for), which skips the check's cost."""
    model = spec.get("model") if isinstance(spec, dict) else None
    byte_level = '"ByteLevel"' in json.dumps(spec.get("pre_tokenizer"))
    return (isinstance(model, dict) and model.get("type") == "BPE" and not byte_level
            and not model.get("unk_token") and not model.get("byte_fallback"))  # fmt: skip


def _lost_chars(text: str, offsets: list[tuple[int, int]]) -> int:
    """How many characters of ``text``, but whitespace, no token's (character) offsets cover.
    A count, not which: tokenizers shifts the offsets of the tokens after a dropped one."""
    depth = np.zeros(len(text) + 1, np.int64)
    spans = np.asarray(offsets, np.int64).reshape(-1, 2)
    np.add.at(depth, spans[:, 0], 1)
    np.add.at(depth, spans[:, 1], -1)
    codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), np.uint32)
    return int(np.sum(~np.isin(codes[np.cumsum(depth[:-1]) == 0], _SPACES)))


# Every whitespace code point (all lie below U+3001): not text a tokenizer loses.
_SPACES = np.asarray([c for c in range(0x3001) if chr(c).isspace()], np.uint32)


def _template_bos(spec: dict) -> tuple[int, ...] | None:
    """The ids a saved ``TemplateProcessing`` post-processor puts before a single sequence (a
    Llama tokenizer's ``<s>`` or ``<|begin_of_text|>``; all of them for ``"<s> <extra> $A"``),
    or a ``Bert``/``RobertaProcessing``'s ``cls``, looking inside a ``Sequence`` of processors;
    None when there is none (GPT-2's byte-level processor adds nothing)."""
    post = spec.get("post_processor") if isinstance(spec, dict) else None
    if not isinstance(post, dict):
        return None
    if post.get("type") in ("BertProcessing", "RobertaProcessing"):  # cls: [token, id]
        return (int(post["cls"][1]),)
    if post.get("type") == "Sequence":
        found = [_template_bos({"post_processor": p}) for p in post.get("processors", [])]
        return next((f for f in found if f is not None), None)
    single = post.get("single") if post.get("type") == "TemplateProcessing" else None
    prefix = []
    for piece in single or []:  # "<s> <extra> $A": every special id before the sequence
        if not (isinstance(piece, dict) and "SpecialToken" in piece):
            break
        ids = post.get("special_tokens", {}).get(piece["SpecialToken"]["id"], {}).get("ids")
        prefix += [int(i) for i in ids or []]
    return tuple(prefix) or None


def _parse(tokenizer_cls: type, blob: bytes, file: pathlib.Path):
    """The ``Tokenizer`` in ``blob``, or a ``ValueError`` naming the file and the setting."""
    if blob.startswith(b"version https://git-lfs"):
        raise ValueError(f"{str(file)!r} is a git-lfs pointer, not the tokenizer: fetch it "
                         f"(git lfs pull) or point config.data.tokenizer_path elsewhere.")
    try:
        return tokenizer_cls.from_str(blob.decode("utf-8"))
    except Exception as err:  # tokenizers raises a bare Exception on bad JSON
        raise ValueError(f"{str(file)!r} is not a Hugging Face tokenizer.json ({err}); "
                         f"config.data.tokenizer_path must name the directory holding "
                         f"one.") from err
