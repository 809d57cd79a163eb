"""HFTokenizer on tokenizer.json files made here with the ``tokenizers`` package (``[hf]``)."""

from __future__ import annotations

import json
import pathlib

import pytest

tokenizers = pytest.importorskip("tokenizers")

from noloco_jax.data.hf_tokenizer import HFTokenizer  # noqa: E402

WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "far", "away"]
TEXT = " ".join(WORDS * 100)  # 1,000 words, one id each


def _save(directory, *, truncation=None, padding=None, gap=False, eos_config=None, bos=None,
          add_bos=None):
    """A word-level tokenizer.json (ids: [UNK] 0, [PAD] 1, the words, then "</s>" and "<e2>");
    ``bos``: "template" or "sequence" saves a post-processor that puts "<e2>" (13) first, alone
    or inside a Sequence with a byte-level processor (as Llama 3's)."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab = {"[UNK]": 0, "[PAD]": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    if gap:  # an added token after a gap in the ids, as in cl100k-style vocabularies
        vocab["<gap>"] = 99
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["</s>", "<e2>"])
    if truncation:
        tok.enable_truncation(max_length=truncation)
    if padding:
        tok.enable_padding(length=padding, pad_id=1, pad_token="[PAD]")
    if bos:
        template = tokenizers.processors.TemplateProcessing(
            single="<e2> $A", pair="<e2> $A <e2> $B", special_tokens=[("<e2>", 13)])
        tok.post_processor = template if bos == "template" else tokenizers.processors.Sequence(
            [tokenizers.processors.ByteLevel(trim_offsets=False), template])  # fmt: skip
    tok.save(str(directory / "tokenizer.json"))
    if eos_config:
        fields = {"eos_token": eos_config}
        if add_bos is not None:
            fields["add_bos_token"] = add_bos
        (directory / "tokenizer_config.json").write_text(json.dumps(fields))
    return directory


@pytest.mark.parametrize("saved", [dict(truncation=16), dict(padding=2048)])
def test_a_saved_truncation_or_padding_does_not_cut_or_pad_documents(tmp_path, saved):
    """A tokenizer.json saved with truncation kept 16 ids of each document; with fixed-length
    padding it added pad ids to each."""
    plain = HFTokenizer(_save(tmp_path / "plain"))
    tok = HFTokenizer(_save(tmp_path / "saved", **saved))
    assert len(plain.encode(TEXT)) == 1000
    assert tok.encode(TEXT).tolist() == plain.encode(TEXT).tolist()
    assert tok.name != plain.name  # another file: its own cached streams


def test_vocab_size_is_the_largest_id_plus_one(tmp_path):
    """Ids with a gap: 15 tokens, the largest id 99 (the count made id 99 out of range)."""
    tok = HFTokenizer(_save(tmp_path, gap=True))
    assert tok.vocab_size == 100 and tok._tok.token_to_id("<gap>") == 99


def test_the_document_separator_is_part_of_the_cache_key(tmp_path):
    """Changing tokenizer_config.json's eos_token reused streams cut with the old one."""
    a = HFTokenizer(_save(tmp_path / "a", eos_config="</s>"))
    b = HFTokenizer(_save(tmp_path / "b", eos_config="<e2>"))
    assert (a.eos_id, b.eos_id) == (12, 13) and a.name != b.name


@pytest.mark.parametrize("content,match", [
    (b"version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 9\n", "git-lfs pointer"),
    (b"not json", "is not a Hugging Face tokenizer.json"),
])  # fmt: skip
def test_an_unreadable_tokenizer_file_names_the_file_and_the_setting(tmp_path, content, match):
    (tmp_path / "tokenizer.json").write_bytes(content)
    with pytest.raises(ValueError, match=match) as err:
        HFTokenizer(tmp_path)
    assert "tokenizer_path" in str(err.value) and "tokenizer.json" in str(err.value)


def test_a_broken_tokenizer_config_names_the_file(tmp_path):
    d = _save(tmp_path)
    (d / "tokenizer_config.json").write_text("{broken")
    with pytest.raises(ValueError, match=r"tokenizer_config\.json is not valid JSON"):
        HFTokenizer(d)



@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_a_tokenizer_file_the_process_cannot_read_names_the_file_and_the_setting(
        tmp_path, monkeypatch, name):
    """Without read permission it was a PermissionError traceback (the CLI's user errors are
    ValueErrors: exit 2)."""
    directory = _save(tmp_path / "tok", eos_config="</s>")
    read_bytes = pathlib.Path.read_bytes

    def refuse(path):
        if path.name == name:
            raise PermissionError(13, "Permission denied", str(path))
        return read_bytes(path)

    monkeypatch.setattr(pathlib.Path, "read_bytes", refuse)
    monkeypatch.setattr(pathlib.Path, "read_text", lambda path, *a, **k: refuse(path).decode())
    with pytest.raises(ValueError, match=rf"{name}' cannot be read \(Permission denied\).*"
                                         r"config\.data\.tokenizer_path"):  # fmt: skip
        HFTokenizer(directory)

@pytest.mark.parametrize("text", ['["eos"]', '{"eos_token": 5}', '{"eos_token": {"content": 5}}'])
def test_a_tokenizer_config_of_the_wrong_shape_names_the_file(tmp_path, text):
    """A list was an AttributeError, a number a TypeError inside tokenizers."""
    d = _save(tmp_path)
    (d / "tokenizer_config.json").write_text(text)
    with pytest.raises(ValueError, match=r"tokenizer_config\.json must be a JSON object"):
        HFTokenizer(d)


def test_decode_refuses_float_and_out_of_vocabulary_ids(tmp_path):
    """int(2.7) decoded as id 2, silently."""
    tok = HFTokenizer(_save(tmp_path))
    with pytest.raises(ValueError, match="token ids must be integers"):
        tok.decode([2.7])
    with pytest.raises(ValueError, match=rf"token ids must be in \[0, {tok.vocab_size - 1}\]"):
        tok.decode([tok.vocab_size])
    assert tok.decode([2, 3]) == "the cat"


def test_decode_keeps_special_tokens_other_than_eos_and_bos(tmp_path):
    """tokenizers' decode skips every special token by default: an <unk> or added special token
    vanished from the text (transformers keeps them); only eos and bos ids are dropped."""
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    vocab = {"<unk>": 0, "the": 1, "cat": 2}
    raw = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    raw.add_special_tokens(["<unk>", "</s>", "<sep>"])
    raw.save(str(tmp_path / "tokenizer.json"))
    tok = HFTokenizer(tmp_path)
    ids = tok.encode("the zebra cat").tolist()
    assert ids == [1, 0, 2] and tok.eos_id == 3
    assert tok.decode([*ids, 4, tok.eos_id]) == "the <unk> cat <sep>"



@pytest.mark.parametrize("bos", ["template", "sequence"])
def test_documents_start_with_the_token_the_tokenizer_puts_first(tmp_path, bos):
    """A Llama tokenizer's post-processor puts <s> (or <|begin_of_text|>) first; the streams
    started documents without it, unlike the text a model from init_from was trained on."""
    from noloco_jax.data.batches import tokenize_documents  # noqa: PLC0415

    plain = HFTokenizer(_save(tmp_path / "plain", eos_config="</s>"))
    tok = HFTokenizer(_save(tmp_path / bos, eos_config="</s>", bos=bos))
    assert (plain.bos_id, tok.bos_id) == (None, 13) and tok.name != plain.name
    stream = tokenize_documents(["the cat", "a dog ran"], tok).tolist()
    assert stream == [13, 2, 3, 12, 13, 7, 8, 9, 12]  # <e2> the cat </s> <e2> a dog ran </s>
    assert tokenize_documents(["the cat"], plain).tolist() == [2, 3, 12]  # unchanged
    assert tok.decode(stream) == plain.decode([2, 3, 12, 7, 8, 9]) == "the cat a dog ran"


@pytest.mark.parametrize("special_tokens", [
    [("<e2>", 13), ("[PAD]", 1)],  # "<e2> [PAD] $A": two special tokens first
    [{"id": "<e2>", "ids": [13, 1], "tokens": ["<e2>", "[PAD]"]}],  # one token of two ids
])  # fmt: skip
def test_documents_start_with_every_id_the_post_processor_puts_first(tmp_path, special_tokens):
    """The streams kept only the first of them (13), unlike the tokenizer and transformers."""
    from noloco_jax.data.batches import tokenize_documents  # noqa: PLC0415

    _save(tmp_path, eos_config="</s>")
    raw = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    single = " ".join(t[0] if isinstance(t, tuple) else t["id"] for t in special_tokens)
    raw.post_processor = tokenizers.processors.TemplateProcessing(
        single=f"{single} $A", special_tokens=special_tokens)
    raw.save(str(tmp_path / "tokenizer.json"))
    tok = HFTokenizer(tmp_path)
    assert raw.encode("the cat").ids == [13, 1, 2, 3]
    assert (tok.bos_id, tok.bos_ids) == (13, (13, 1))
    assert tokenize_documents(["the cat"], tok).tolist() == [13, 1, 2, 3, 12]
    assert tok.decode([13, 1, 2, 3, 12]) == "the cat"


def test_a_first_token_outside_the_vocabulary_is_refused(tmp_path):
    """The eos id must be in the vocabulary; the post-processor's first id was not checked and
    failed later in the token cache as 'token ids must lie in [0, 14), got [2, 99]'."""
    _save(tmp_path, eos_config="</s>", bos="template")
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    spec["post_processor"]["special_tokens"]["<e2>"]["ids"] = [99]
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="post-processor puts id 99 first"):
        HFTokenizer(tmp_path)


@pytest.mark.parametrize("add_bos, expected", [(False, None), (True, 13)])
def test_add_bos_token_false_in_the_config_wins_over_the_post_processor(tmp_path, add_bos,
                                                                       expected):  # fmt: skip
    """transformers rebuilds a Llama tokenizer's post-processor from add_bos_token; the streams
    started with <s> although the config turned it off."""
    tok = HFTokenizer(_save(tmp_path, eos_config="</s>", bos="template", add_bos=add_bos))
    assert tok.bos_id == expected


@pytest.mark.parametrize("kind", ["BertProcessing", "RobertaProcessing"])
def test_documents_start_with_the_cls_token_of_a_bert_or_roberta_processor(tmp_path, kind):
    """These processors put their cls token (RoBERTa's <s>) first too; bos_id was None."""
    _save(tmp_path, eos_config="</s>")
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    spec["post_processor"] = {"type": kind, "sep": ["</s>", 12], "cls": ["<e2>", 13]}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    tok = HFTokenizer(tmp_path)
    assert tok._tok.encode("the cat").ids == [13, 2, 3, 12]
    assert tok.bos_id == 13


def test_the_readme_says_a_bert_or_roberta_processor_gives_the_first_token():
    """The README said documents get no first token from a RobertaProcessing or BertProcessing,
    and only the first of a template's; they get the cls token (test above) and all of them."""
    readme = pathlib.Path(__file__).resolve().parents[1] / "README.md"
    text = " ".join(readme.read_text(encoding="utf-8").split())
    assert "none from a `RobertaProcessing`" not in text
    assert "starts with the first token of the tokenizer's" not in text
    assert "the `cls` token of a `BertProcessing` or `RobertaProcessing`" in text


def test_an_empty_vocabulary_names_the_file(tmp_path):
    """It failed with Python's 'max() arg is an empty sequence', naming no file or setting."""
    tokenizers.Tokenizer(tokenizers.models.BPE()).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="tokenizer.json' has no end-of-document token"):
        HFTokenizer(tmp_path)


def test_add_bos_token_true_in_the_config_adds_its_bos_token(tmp_path):
    """Llama-2-style: no post-processor in tokenizer.json, add_bos_token true and bos_token in
    tokenizer_config.json; transformers starts each text with it, the streams did not."""
    from noloco_jax.data.batches import tokenize_documents  # noqa: PLC0415

    _save(tmp_path)
    fields = {"eos_token": "</s>", "bos_token": {"content": "<e2>"}, "add_bos_token": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(fields))
    tok = HFTokenizer(tmp_path)
    assert (tok.bos_id, tok.bos_ids) == (13, (13,))
    assert tokenize_documents(["the cat"], tok).tolist() == [13, 2, 3, 12]


@pytest.mark.parametrize("fields, match", [
    ({"bos_token": "<nope>"}, "bos_token '<nope>' is not in the vocabulary"),
    ({}, "add_bos_token: true but names no bos_token"),
])  # fmt: skip
def test_add_bos_token_true_without_a_known_bos_token_is_refused(tmp_path, fields, match):
    """Both added no bos token, silently."""
    _save(tmp_path)
    fields = {"eos_token": "</s>", "add_bos_token": True, **fields}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(fields))
    with pytest.raises(ValueError, match=match):
        HFTokenizer(tmp_path)


def test_a_character_the_tokenizer_cannot_encode_names_the_file(tmp_path):
    """A Unigram model without unk_id failed with tokenizers' bare Exception ('Encountered an
    unknown token but `unk_id` is missing'), naming no file or setting."""
    raw = tokenizers.Tokenizer(tokenizers.models.Unigram([("</s>", 0.0), ("a", -1.0)]))
    raw.save(str(tmp_path / "tokenizer.json"))
    tok = HFTokenizer(tmp_path)
    assert tok.encode("a").tolist() == [1]
    with pytest.raises(ValueError, match="tokenizer.json' cannot encode the text .*unk_id"):
        tok.encode("ab")


def test_a_lone_surrogate_is_encoded_as_the_replacement_character(tmp_path):
    """A str with a lone surrogate (json.loads of "\\udcff") was refused as a character the
    tokenizer cannot encode ("give its model an unk token"); ByteTokenizer encodes U+FFFD."""
    tok = HFTokenizer(_save(tmp_path))
    assert tok.encode("cat \udcff dog").tolist() == tok.encode("cat \ufffd dog").tolist() == [
        3, 0, 8]


def test_a_bpe_that_drops_unknown_characters_warns(tmp_path, capsys):
    """A BPE without unk_token or byte_fallback drops "z" from "zebra" (ids of "ebra" only):
    the streams lost text and nothing said so. Known characters do not warn."""
    merges = [("e", "b")]
    vocab = {"</s>": 0, "e": 1, "b": 2, "r": 3, "a": 4, "eb": 5}
    raw = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, merges))
    raw.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    raw.save(str(tmp_path / "tokenizer.json"))
    tok = HFTokenizer(tmp_path)
    assert tok.encode("ebra  a").tolist() == [5, 3, 4, 4]
    assert "WARNING" not in capsys.readouterr().out
    assert tok.encode("zebra").tolist() == [5, 3, 4]
    assert "drops characters it has no token for (its BPE model" in capsys.readouterr().out
    tok.encode("zebra")
    assert "WARNING" not in capsys.readouterr().out  # once
