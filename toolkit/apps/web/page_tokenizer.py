"""The bundle's tokenizer as the page reads it (page-tokenizer.json), written by `onnxformer web`:

    page_tokenizer(tokenizer_json) -> dict    # JSON for src/text.js, which tokenizes as runtime/tokenizer.py

- char: the bundle's tokenizer.json as it is.
- sentencepiece (Marian): the source .spm as a Hugging Face tokenizer.json Unigram (pieces, scores, the
  Precompiled normalizer charsmap, Metaspace), which @huggingface/tokenizers runs in the page; the vocabularies
  (Marian's ids are its vocab.json's, never SentencePiece's) and the decoding .spm's pieces with their kinds, so
  the page maps pieces to ids and back as SentencePieceTokenizer does.
- hf-tokenizers (NLLB, mBART, BART): the original tokenizer.json and our framing spec; the page runs the file with
  @huggingface/tokenizers.
"""

from __future__ import annotations

import json
from pathlib import Path

from runtime.errors import InputError
from runtime.tokenizer import FastTokenizer, SentencePieceTokenizer, load_tokenizer, read_tokenizer_json

PAGE_TOKENIZER = "page-tokenizer.json"
UNIGRAM = 1                             # sentencepiece's ModelProto.TrainerSpec.model_type of a unigram model
NORMAL, UNKNOWN, CONTROL = 1, 2, 3      # ModelProto.SentencePiece.type values the decoder tells apart


def _model_proto(path: Path):
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(path.read_bytes())
    return proto


def unigram_json(spm_path: Path) -> dict:
    """A SentencePiece unigram model as a tokenizer.json giving its pieces (encode(..).tokens) for any text: the
    charsmap normalization, runs of spaces as one, no space at either end (SentencePiece's remove_extra_whitespaces),
    a ▁ before the text (add_dummy_prefix), Viterbi over the pieces' scores, unknown runs fused into one <unk>."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import Unigram

    proto = _model_proto(spm_path)
    spec, norm = proto.trainer_spec, proto.normalizer_spec
    if spec.model_type != UNIGRAM or spec.byte_fallback:
        raise InputError(f"{spm_path} is not a unigram SentencePiece model without byte fallback (Marian's kind); "
                         f"the web page cannot tokenize with it: use onnxformer serve")
    if not norm.add_dummy_prefix or not norm.remove_extra_whitespaces:
        raise InputError(f"{spm_path} normalizes without a dummy prefix or keeps extra spaces; the web page "
                         f"tokenizes only SentencePiece's default normalization: use onnxformer serve")
    tok = Tokenizer(Unigram([(p.piece, p.score) for p in proto.pieces], spec.unk_id, False))
    steps = [normalizers.Precompiled(norm.precompiled_charsmap)] if norm.precompiled_charsmap else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(Regex(" {2,}"), " "), normalizers.Strip()])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    return json.loads(tok.to_str())


def decode_pieces(spm_path: Path) -> dict:
    """The decoding model's pieces by SentencePiece id, their kinds (control pieces decode to nothing, unknown to
    its surface) and the unknown surface: what SentencePieceProcessor.decode_pieces needs."""
    proto = _model_proto(spm_path)
    kinds = {NORMAL: "normal", UNKNOWN: "unknown", CONTROL: "control"}
    return {"pieces": [p.piece for p in proto.pieces],
            "kinds": [kinds.get(p.type, "normal") for p in proto.pieces],
            "unk_surface": proto.trainer_spec.unk_surface or " \u2047 "}


def page_tokenizer(path: Path) -> dict:
    """The page's tokenizer JSON for a bundle's tokenizer.json at `path` (InputError where the page has none of its
    kind)."""
    bundle = path.parent
    spec = json.loads(path.read_text())
    kind = spec.get("type", "char")
    if kind == "char":
        return spec
    tok = load_tokenizer(path)
    if isinstance(tok, SentencePieceTokenizer):
        side = "target_spm" if spec.get("target_vocab") else "source_spm"     # the one decode() uses
        return {**spec, "source_tokenizer": unigram_json(bundle / spec["source_spm"]),
                "source_vocab": tok.source_vocab, "target_vocab": tok.target_vocab,
                "decode": decode_pieces(bundle / spec[side]), "specials": tok.specials}
    if isinstance(tok, FastTokenizer):
        return {**spec, "tokenizer": json.loads(read_tokenizer_json(bundle / spec["file"]))}
    raise InputError(f"{bundle}: its tokenizer is {kind!r}; the web page runs character, SentencePiece (Marian) and "
                     f"tokenizer.json tokenizers: use onnxformer serve for this bundle")
