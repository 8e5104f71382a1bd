"""Every tokenizer the runtime loads is a runtime.tokenizer.Tokenizer: same members, same method signatures."""

from __future__ import annotations

import inspect
import json

import pytest

from runtime.byte_tokenizer import ByteTokenizer
from runtime.tokenizer import (CharTokenizer, FastTokenizer, SentencePieceTokenizer, Tokenizer, load_tokenizer,
                               tokenizer_files)

METHODS = ("encode", "decode", "to_dict", "save")
PROPERTIES = ("vocab_size", "src_vocab_size", "files")


@pytest.fixture(scope="module")
def sentencepiece_tokenizer(tmp_path_factory) -> SentencePieceTokenizer:
    """A Marian-style SentencePiece tokenizer: one small unigram model for both sides, a Marian vocabulary."""
    pytest.importorskip("sentencepiece")
    from toolkit.testing.tiny_marian import corpus, marian_vocab, train_spm

    root = tmp_path_factory.mktemp("spm")
    model = train_spm(corpus(n=200), 60)
    (root / "source.spm").write_bytes(model)
    (root / "target.spm").write_bytes(model)
    (root / "vocab.json").write_text(json.dumps(marian_vocab([root / "source.spm"])))
    spec = {"source_spm": "source.spm", "target_spm": "target.spm", "vocab": "vocab.json",
            "eos": "</s>", "unk": "<unk>", "pad": "<pad>"}
    return SentencePieceTokenizer(root, spec)


@pytest.fixture(scope="module")
def fast_tokenizer(tmp_path_factory) -> FastTokenizer:
    """A Hugging Face tokenizer.json (NLLB's framing over a small BPE vocabulary), read without transformers."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    from toolkit.testing.tiny_families import tiny_tokenizer

    root = tmp_path_factory.mktemp("fast")
    tiny_tokenizer("nllb").save_pretrained(root)
    spec = {"file": "hf_tokenizer.json", "source_prefix": ["{src_lang}"], "source_suffix": ["</s>"],
            "src_lang": "fra_Latn", "eos": "</s>", "pad": "<pad>"}
    return FastTokenizer(root, spec, source=root / "tokenizer.json")


@pytest.fixture(scope="module")
def bytes_tokenizer() -> ByteTokenizer:
    """ByT5's byte tokenizer as its spec reads: specials stripping the spaces around them, one sentinel."""
    added = [{"content": c, "id": i, "lstrip": i < 3, "rstrip": i < 3, "special": True}
             for i, c in enumerate(("<pad>", "</s>", "<unk>"))] + [
        {"content": "<extra_id_0>", "id": 259, "lstrip": False, "rstrip": False, "special": True}]
    return ByteTokenizer({"offset": 3, "added": added, "eos": "</s>", "pad": "<pad>"})


def _protocol_parameters(name: str) -> list[str]:
    return list(inspect.signature(getattr(Tokenizer, name)).parameters)


@pytest.mark.parametrize("kind", ["char", "sentencepiece", "fast", "bytes"])
def test_every_tokenizer_satisfies_the_protocol(kind, request, tmp_path):
    tok = CharTokenizer("abc") if kind == "char" else request.getfixturevalue(f"{kind}_tokenizer")
    assert isinstance(tok, Tokenizer)
    for name in METHODS:                                  # same parameter names as the protocol, in its order
        assert list(inspect.signature(getattr(type(tok), name)).parameters) == _protocol_parameters(name), name
    for name in PROPERTIES:
        assert isinstance(inspect.getattr_static(type(tok), name), property), name
    assert isinstance(tok.vocab_size, int) and isinstance(tok.src_vocab_size, int)
    assert all(isinstance(f, str) for f in tok.files) and tokenizer_files(tok) == tok.files
    tok.save(tmp_path / "tokenizer.json")                 # what save writes loads back as the same tokenizer
    again = load_tokenizer(tmp_path / "tokenizer.json")
    assert isinstance(again, Tokenizer) and again.to_dict() == tok.to_dict()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["tokenizer.json", *tok.files])


def test_char_tokenizer_has_one_vocabulary_and_no_files():
    tok = CharTokenizer("abc")
    assert tok.src_vocab_size == tok.vocab_size == 6 and tok.files == []


def test_an_object_missing_a_member_is_not_a_tokenizer():
    class NoFiles:
        pad_id, eos_id, vocab_size, src_vocab_size = 0, 2, 6, 6

        def encode(self, text):
            return []

        def decode(self, ids):
            return ""

        def to_dict(self):
            return {}

        def save(self, path):
            pass

    assert not isinstance(NoFiles(), Tokenizer)
    NoFiles.files = []
    assert isinstance(NoFiles(), Tokenizer)


def test_encode_target_gives_target_ids_without_eos(sentencepiece_tokenizer):
    tok = sentencepiece_tokenizer
    text = "the cat sat"
    ids = tok.encode_target(text)
    assert ids and tok.eos_id not in ids and ids == tok.encode(text)[:-1]    # one spm and vocab for both sides here
    assert tok.decode(ids) == tok.decode(tok.encode(text))
    assert CharTokenizer("abc").encode_target("cab") == [5, 3, 4]


def test_byte_tokenizer_is_utf8_bytes_with_added_tokens_split_out(bytes_tokenizer):
    tok = bytes_tokenizer
    assert tok.encode("hé") == [107, 198, 172, 1] and tok.vocab_size == 260 and tok.files == []
    assert tok.encode("a </s>  b<extra_id_0>") == [100, 1, 101, 259, 1]    # </s> strips spaces; eos not doubled
    assert tok.encode("x</s>") == [123, 1]
    assert tok.decode([107, 198, 172, 0, 1, 259, 198]) == "hé"             # specials skipped, a cut byte dropped
