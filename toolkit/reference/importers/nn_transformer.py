"""torch.nn.Transformer checkpoints built like PyTorch's translation tutorial -> onnxformer checkpoint.

The accepted layout is the tutorial's `Seq2SeqTransformer` (batch_first False or True, ReLU or GELU, post-norm as
the tutorial builds it, or norm_first=True when the JSON says so: the state dict cannot tell them apart):

    src_tok_emb.embedding.weight          [src_vocab, d]     token embeddings, scaled by sqrt(d) in forward
    tgt_tok_emb.embedding.weight          [tgt_vocab, d]
    positional_encoding.pos_embedding     [max_len, 1, d]    interleaved sinusoids (checked; learned ones refused)
    transformer.encoder.layers.{i}.self_attn.in_proj_weight / in_proj_bias / out_proj.weight / out_proj.bias
    transformer.encoder.layers.{i}.linear1.* linear2.* norm1.* norm2.*
    transformer.encoder.norm.*                                the final LayerNorm nn.Transformer adds
    transformer.decoder.layers.{i}.self_attn.* multihead_attn.* linear1.* linear2.* norm1.* norm2.* norm3.*
    transformer.decoder.norm.*
    generator.weight [tgt_vocab, d], generator.bias [tgt_vocab]

saved with torch.save(model.state_dict(), PATH) (loaded with weights_only=True) or with safetensors; a training
checkpoint's {"model_state_dict": ...} (or "state_dict", "model") and DataParallel's 'module.' prefix are taken
off (sources.read_state). Plus a JSON file (--config):

    {"nhead": 8, "pad_id": 1, "bos_id": 2, "eos_id": 3, "unk_id": 0,          required: heads and special ids
     "activation": "relu", "layer_norm_eps": 1e-5, "max_len": 256,          optional (max_len: <= the table's rows)
     "norm_first": false,                                                   optional: nn.Transformer(norm_first=...)
     "source_spm": "src.model", "target_spm": "tgt.model"}                  optional, paths beside the JSON file

Sizes (layers, d_model, FFN, vocabularies) are read from the tensors. With SentencePiece models the ids are
SentencePiece's own (as the tutorial's vocabularies would be built from them) and sources get BOS ... EOS, as
the tutorial's tensor_transform does.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

from toolkit.reference.config import ModelConfig
from toolkit.reference.importers.registry import Converted, Family, ImportOptions, ImportRefused, register_family
from toolkit.reference.importers.sources import read_state

if TYPE_CHECKING:
    import torch

REQUIRED = ("nhead", "pad_id", "bos_id", "eos_id")
OPTIONAL = ("unk_id", "activation", "layer_norm_eps", "max_len", "source_spm", "target_spm", "dropout", "norm_first")
TOP = ("src_tok_emb.embedding.weight", "tgt_tok_emb.embedding.weight", "positional_encoding.pos_embedding",
       "generator.weight", "generator.bias", "transformer.encoder.norm.weight", "transformer.encoder.norm.bias",
       "transformer.decoder.norm.weight", "transformer.decoder.norm.bias")
ENC = {"self_attn": "self_attn", "linear1": "ffn.w_1", "linear2": "ffn.w_2", "norm1": "sublayers.0.norm",
       "norm2": "sublayers.1.norm"}
DEC = {"self_attn": "self_attn", "multihead_attn": "cross_attn", "linear1": "ffn.w_1", "linear2": "ffn.w_2",
       "norm1": "sublayers.0.norm", "norm2": "sublayers.1.norm", "norm3": "sublayers.2.norm"}


def expected_names(n_enc: int, n_dec: int) -> list[str]:
    names = list(TOP)
    for side, n, layer in (("encoder", n_enc, ENC), ("decoder", n_dec, DEC)):
        for i in range(n):
            for theirs in layer:
                params = ("in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias") \
                    if theirs.endswith("attn") else ("weight", "bias")
                names += [f"transformer.{side}.layers.{i}.{theirs}.{p}" for p in params]
    return names


def read_config(path: Path | None) -> dict:
    if path is None:
        raise ImportRefused("an nn-transformer state dict needs --config JSON with nhead, pad_id, bos_id and eos_id "
                            "(see toolkit/reference/importers/nn_transformer.py for the layout)")
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ImportRefused(f"--config {path} does not exist") from None
    except json.JSONDecodeError as exc:
        raise ImportRefused(f"--config {path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise ImportRefused(f"--config {path} must be a JSON object")
    missing = [k for k in REQUIRED if k not in data]
    unknown = sorted(set(data) - set(REQUIRED) - set(OPTIONAL))
    if missing or unknown:
        raise ImportRefused(f"--config {path}: missing {missing or 'nothing'}, unknown {unknown or 'nothing'}; "
                            f"expected {', '.join(REQUIRED)} and optionally {', '.join(OPTIONAL)}")
    return data


def layer_count(state: dict, side: str) -> int:
    found = {int(m.group(1)) for k in state if (m := re.match(rf"transformer\.{side}\.layers\.(\d+)\.", k))}
    return max(found) + 1 if found else 0


def tutorial_config(state: dict, hp: dict, where: Path) -> ModelConfig:
    import torch

    n_enc, n_dec = layer_count(state, "encoder"), layer_count(state, "decoder")
    expected = expected_names(n_enc, n_dec)
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected or not n_enc or not n_dec:
        first = [n for n in expected if n in missing][:3]
        raise ImportRefused(f"{where} is not in the tutorial's Seq2SeqTransformer layout: expected "
                            f"{', '.join(TOP[:3])}, transformer.encoder/decoder.layers.N..., found missing "
                            f"{first or 'none'} and unexpected {unexpected[:3] or 'none'}")
    norm_first = hp.get("norm_first", False)
    if not isinstance(norm_first, bool):
        raise ImportRefused(f"--config norm_first must be true or false, got {norm_first!r}")
    src_v, d = state["src_tok_emb.embedding.weight"].shape
    tgt_v = state["tgt_tok_emb.embedding.weight"].shape[0]
    table = state["positional_encoding.pos_embedding"]
    rows = table.shape[0]
    max_len = int(hp.get("max_len", min(rows, 1024)))
    if not 1 <= max_len <= rows:
        raise ImportRefused(f"--config max_len {max_len} must be between 1 and the position table's {rows} rows")
    act = hp.get("activation", "relu")
    if act not in ("relu", "gelu"):
        raise ImportRefused(f"activation {act!r} cannot be represented for nn.Transformer (relu or gelu)")
    try:
        config = ModelConfig(vocab_size=int(tgt_v), src_vocab_size=int(src_v), share_embeddings=False,
                             d_model=int(d), n_heads=int(hp["nhead"]), n_encoder_layers=n_enc, n_decoder_layers=n_dec,
                             d_ff=int(state["transformer.encoder.layers.0.linear1.weight"].shape[0]), max_len=max_len,
                             dropout=float(hp.get("dropout", 0.1)), norm="pre" if norm_first else "post",
                             activation=act,
                             tie_embeddings=False, layer_norm_eps=float(hp.get("layer_norm_eps", 1e-5)),
                             pad_id=int(hp["pad_id"]), bos_id=int(hp["bos_id"]), eos_id=int(hp["eos_id"]),
                             positions="interleaved", scale_embeddings=True, logits_bias=True,
                             final_norm=not norm_first)          # pre-norm stacks end in their LayerNorm anyway
    except Exception as exc:
        raise ImportRefused(f"{where}: the hyperparameters cannot be represented ({exc})") from None
    from toolkit.reference.model import sinusoid_table

    ours = sinusoid_table(config)
    theirs = table.reshape(rows, -1)[:max_len].float()
    if theirs.shape != ours.shape or not torch.allclose(theirs, ours, atol=1e-4, rtol=0):
        raise ImportRefused(f"{where}: positional_encoding.pos_embedding is not the interleaved sinusoid table "
                            f"(learned positions?); learned positions cannot be represented")
    return config


def map_state(state: dict, config: ModelConfig) -> dict[str, torch.Tensor]:
    d = config.d_model
    out = {"embed.lut.weight": state["tgt_tok_emb.embedding.weight"],
           "src_embed.lut.weight": state["src_tok_emb.embedding.weight"],
           "generator.proj.weight": state["generator.weight"], "generator.bias": state["generator.bias"],
           "encoder.norm.weight": state["transformer.encoder.norm.weight"],
           "encoder.norm.bias": state["transformer.encoder.norm.bias"],
           "decoder.norm.weight": state["transformer.decoder.norm.weight"],
           "decoder.norm.bias": state["transformer.decoder.norm.bias"]}
    for side, n, layer in (("encoder", config.n_encoder_layers, ENC), ("decoder", config.n_decoder_layers, DEC)):
        for i in range(n):
            for theirs, ours in layer.items():
                src, dst = f"transformer.{side}.layers.{i}.{theirs}", f"{side}.layers.{i}.{ours}"
                if theirs.endswith("attn"):                     # packed in_proj: rows q | k | v
                    w, b = state[f"{src}.in_proj_weight"], state[f"{src}.in_proj_bias"]
                    for j, p in enumerate(("q", "k", "v")):
                        out[f"{dst}.{p}_proj.weight"] = w[j * d:(j + 1) * d]
                        out[f"{dst}.{p}_proj.bias"] = b[j * d:(j + 1) * d]
                    out[f"{dst}.out_proj.weight"] = state[f"{src}.out_proj.weight"]
                    out[f"{dst}.out_proj.bias"] = state[f"{src}.out_proj.bias"]
                else:
                    out[f"{dst}.weight"], out[f"{dst}.bias"] = state[f"{src}.weight"], state[f"{src}.bias"]
    return {k: v.detach().float().contiguous().clone() for k, v in out.items()}


def spm_tokenizer(hp: dict, base: Path, config: ModelConfig, work: Path):
    """A SentencePieceTokenizer over SentencePiece's own ids (vocabularies written from the .spm files)."""
    import shutil

    from runtime.tokenizer import SentencePieceTokenizer

    names = {}
    for side in ("source_spm", "target_spm"):
        path = base / hp[side]
        if not path.is_file():
            raise ImportRefused(f"--config {side} {path} does not exist")
        shutil.copyfile(path, work / f"{side.split('_')[0]}.spm")
        names[side] = f"{side.split('_')[0]}.spm"
    try:
        import sentencepiece as spm
    except ImportError:
        raise ImportRefused("SentencePiece tokenizers need the sentencepiece package; pip install sentencepiece") \
            from None
    vocabs = {}
    for side, file in (("source", "source.spm"), ("target", "target.spm")):
        sp = spm.SentencePieceProcessor(model_file=str(work / file))
        vocabs[side] = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
        (work / f"{side}_vocab.json").write_text(json.dumps(vocabs[side], ensure_ascii=False))
    tgt = {i: p for p, i in vocabs["target"].items()}
    unk = hp.get("unk_id", 0)
    spec = {**names, "vocab": "source_vocab.json", "target_vocab": "target_vocab.json", "eos": tgt[config.eos_id],
            "unk": tgt[unk], "pad": tgt[config.pad_id], "bos": tgt[config.bos_id], "prepend_bos": True}
    return SentencePieceTokenizer(work, spec)


def convert(source: Path, options: ImportOptions) -> Converted:
    """The reference Transformer (eval mode) of a tutorial-layout state dict, with SentencePiece tokenizers when the
    --config JSON names them (written into options.work)."""
    from toolkit.reference.model import Transformer

    hp = read_config(options.config_file)
    state = read_state(source, "save it with torch.save(model.state_dict(), PATH)", options.progress)
    config = tutorial_config(state, hp, source)
    model = Transformer.from_state(config, map_state(state, config))
    tokenizer = None
    if hp.get("source_spm") or hp.get("target_spm"):
        if not (hp.get("source_spm") and hp.get("target_spm")):
            raise ImportRefused("--config names one SentencePiece model; give both source_spm and target_spm")
        tokenizer = spm_tokenizer(hp, Path(options.config_file).parent, config, options.work)
    return Converted(model.eval(), tokenizer, {"config": hp})


FAMILY = register_family(Family(
    name="nn-transformer", source="a state dict of the PyTorch tutorial's nn.Transformer model (with --config JSON)",
    convert=convert, reads_files=True, takes_config=True))

__all__ = ["FAMILY", "convert", "read_config", "tutorial_config", "map_state"]
