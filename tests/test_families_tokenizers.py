"""The runtime's FastTokenizer (the `tokenizers` library reading a model's tokenizer.json) against transformers'
tokenizers of BART (byte-level BPE), NLLB (BPE, language codes), mBART-cc25 and mBART-50 and Pegasus (Unigram).

Each original is built OFFLINE from a small vocabulary, saved with save_pretrained, and imported by
importers.bart.family_tokenizer, whose framing data (FRAMINGS) puts the language code and EOS where each
family's tokenizer puts them. Source ids must equal the original's `tok(text)["input_ids"]`; the text of any ids
must equal `tok.decode(ids, skip_special_tokens=True)`.
"""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from runtime.errors import TokenizerError  # noqa: E402
from runtime.tokenizer import FastTokenizer, load_tokenizer  # noqa: E402
from toolkit.reference.config import preset  # noqa: E402
from toolkit.reference.importers import ImportRefused  # noqa: E402
from toolkit.reference.importers.bart import family_tokenizer  # noqa: E402
from toolkit.testing.tiny_families import tiny_tokenizer  # noqa: E402

TEXTS = ["the fox jumps", "Quick brown dogs hex seven boxes.", "  the  lazy   wizard ", "ω über naïve", "a", "",
         "the </s> box", "jolly, jolly; the end!"]
IDS = {"bart": (1, 2), "nllb": (1, 2), "mbart": (1, 2), "mbart50": (1, 2), "pegasus": (0, 1)}   # (pad, eos)
MODEL_TYPE = {"bart": "bart", "nllb": "m2m_100", "mbart": "mbart", "mbart50": "mbart", "pegasus": "pegasus"}


@pytest.fixture(scope="module", params=sorted(IDS))
def pair(request, tmp_path_factory):
    """(name, transformers tokenizer, our FastTokenizer imported from its save_pretrained directory)."""
    name = request.param
    directory = tmp_path_factory.mktemp(name)
    theirs = tiny_tokenizer(name)
    theirs.save_pretrained(directory)
    (directory / "config.json").write_text(json.dumps({"model_type": MODEL_TYPE[name]}))
    pad, eos = IDS[name]
    config = preset("tiny", vocab_size=len(theirs), pad_id=pad, bos_id=eos, eos_id=eos)
    return name, theirs, family_tokenizer(directory, config)


def test_source_ids_equal_the_originals(pair):
    name, theirs, ours = pair
    for text in TEXTS:
        assert ours.encode(text) == theirs(text)["input_ids"], (name, text)


def test_framing_puts_the_language_where_the_family_does(pair):
    name, theirs, ours = pair
    ids = ours.encode("the fox")
    lang = {"nllb": "fra_Latn", "mbart": "de_DE", "mbart50": "de_DE"}.get(name)
    if lang is None:
        assert ids[-1] == ours.eos_id and (ids[0] == theirs.bos_token_id) == (name == "bart")
        return
    code = theirs.convert_tokens_to_ids(lang)
    assert ids[:1] == [code] if name in ("nllb", "mbart50") else ids[-2:] == [ours.eos_id, code]


def test_decode_equals_the_originals(pair):
    name, theirs, ours = pair
    rng = np.random.default_rng(0)
    for _ in range(30):
        ids = rng.integers(0, len(theirs), size=int(rng.integers(0, 14))).tolist()
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), (name, ids)
    past = [3, len(theirs), len(theirs) + 27, 4]                       # rows of the model with no token
    assert ours.decode(past) == theirs.decode(past, skip_special_tokens=True) == ours.decode([3, 4])
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        ours.decode([-1])


def test_saved_and_loaded_without_the_original_directory(pair, tmp_path):
    name, theirs, ours = pair
    ours.save(tmp_path / "tokenizer.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf_tokenizer.json.gz", "tokenizer.json"]
    stored = tmp_path / "hf_tokenizer.json.gz"
    original = ours.source.read_bytes() if ours.source.suffix != ".gz" else gzip.decompress(ours.source.read_bytes())
    assert gzip.decompress(stored.read_bytes()) == original                 # lossless: the original's bytes
    assert stored.stat().st_size < len(original) / 2
    again = load_tokenizer(tmp_path / "tokenizer.json")
    assert isinstance(again, FastTokenizer) and again.files == ["hf_tokenizer.json.gz"]
    assert [again.encode(t) for t in TEXTS] == [ours.encode(t) for t in TEXTS]
    (tmp_path / "copy").mkdir()
    again.save(tmp_path / "copy" / "tokenizer.json")
    assert (tmp_path / "copy" / "hf_tokenizer.json.gz").read_bytes() == stored.read_bytes()   # same bytes again


def test_a_bundle_with_a_plain_hf_tokenizer_json_still_loads(pair, tmp_path):
    """Checkpoints and bundles made before the compressed file name hf_tokenizer.json and store it as is."""
    name, theirs, ours = pair
    ours.save(tmp_path / "tokenizer.json")
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    (tmp_path / "hf_tokenizer.json").write_bytes(gzip.decompress((tmp_path / "hf_tokenizer.json.gz").read_bytes()))
    (tmp_path / "hf_tokenizer.json.gz").unlink()
    (tmp_path / "tokenizer.json").write_text(json.dumps({**spec, "file": "hf_tokenizer.json"}))
    old = load_tokenizer(tmp_path / "tokenizer.json")
    assert old.files == ["hf_tokenizer.json"]
    assert [old.encode(t) for t in TEXTS] == [ours.encode(t) for t in TEXTS]


def test_a_damaged_compressed_tokenizer_is_refused(pair, tmp_path):
    name, theirs, ours = pair
    ours.save(tmp_path / "tokenizer.json")
    stored = tmp_path / "hf_tokenizer.json.gz"
    stored.write_bytes(stored.read_bytes()[:200])
    with pytest.raises(TokenizerError, match="not a gzip-compressed tokenizer.json.*re-import"):
        load_tokenizer(tmp_path / "tokenizer.json")


def test_bad_tokenizer_files_are_refused(tmp_path):
    theirs = tiny_tokenizer("nllb")
    theirs.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "m2m_100"}))
    config = preset("tiny", vocab_size=len(theirs), pad_id=1, bos_id=2, eos_id=2)
    tc = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**tc, "src_lang": "xx_Nope"}))
    with pytest.raises(ImportRefused, match="has no token 'xx_Nope'"):
        family_tokenizer(tmp_path, config)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**tc, "tokenizer_class": "XLNetTokenizer"}))
    with pytest.raises(ImportRefused, match="source framing is unknown"):
        family_tokenizer(tmp_path, config)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tc))
    with pytest.raises(ImportRefused, match="eos and pad ids"):
        family_tokenizer(tmp_path, preset("tiny", vocab_size=len(theirs), pad_id=0, bos_id=1, eos_id=2))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ImportRefused, match="not a Hugging Face tokenizer.json"):
        family_tokenizer(tmp_path, config)
    (tmp_path / "ids-only").mkdir()
    assert family_tokenizer(tmp_path / "ids-only", config) is None          # no tokenizer.json: ids only
