"""nn.Transformer checkpoints in the PyTorch translation tutorial's layout, against the tutorial's own module.

The tutorial's Seq2SeqTransformer, PositionalEncoding, TokenEmbedding and greedy_decode are copied below as the
tutorial writes them (seq-first tensors). The imported model must give the same logits (<= 1e-5, batched and
padded) and, trained briefly on a reversal task so its outputs vary, the same greedy tokens.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import Tensor, nn
from torch.nn import Transformer

from runtime.generate import generate_ids
from runtime.search import SearchOptions
from toolkit.reference.checkpoint import load_checkpoint
from toolkit.apps.cli import main
from toolkit.reference.importers import import_model
from toolkit.reference.torch_engine import TorchEngine

UNK_IDX, PAD_IDX, BOS_IDX, EOS_IDX = 0, 1, 2, 3


# ---------------------------------------------------------------- the tutorial's code (as published)
class PositionalEncoding(nn.Module):
    def __init__(self, emb_size: int, dropout: float, maxlen: int = 5000):
        super(PositionalEncoding, self).__init__()
        den = torch.exp(- torch.arange(0, emb_size, 2) * math.log(10000) / emb_size)
        pos = torch.arange(0, maxlen).reshape(maxlen, 1)
        pos_embedding = torch.zeros((maxlen, emb_size))
        pos_embedding[:, 0::2] = torch.sin(pos * den)
        pos_embedding[:, 1::2] = torch.cos(pos * den)
        pos_embedding = pos_embedding.unsqueeze(-2)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer('pos_embedding', pos_embedding)

    def forward(self, token_embedding: Tensor):
        return self.dropout(token_embedding + self.pos_embedding[:token_embedding.size(0), :])


class TokenEmbedding(nn.Module):
    def __init__(self, vocab_size: int, emb_size):
        super(TokenEmbedding, self).__init__()
        self.embedding = nn.Embedding(vocab_size, emb_size)
        self.emb_size = emb_size

    def forward(self, tokens: Tensor):
        return self.embedding(tokens.long()) * math.sqrt(self.emb_size)


class Seq2SeqTransformer(nn.Module):
    def __init__(self, num_encoder_layers, num_decoder_layers, emb_size, nhead, src_vocab_size, tgt_vocab_size,
                 dim_feedforward=512, dropout=0.1):
        super(Seq2SeqTransformer, self).__init__()
        self.transformer = Transformer(d_model=emb_size, nhead=nhead, num_encoder_layers=num_encoder_layers,
                                       num_decoder_layers=num_decoder_layers, dim_feedforward=dim_feedforward,
                                       dropout=dropout)
        self.generator = nn.Linear(emb_size, tgt_vocab_size)
        self.src_tok_emb = TokenEmbedding(src_vocab_size, emb_size)
        self.tgt_tok_emb = TokenEmbedding(tgt_vocab_size, emb_size)
        self.positional_encoding = PositionalEncoding(emb_size, dropout=dropout)

    def forward(self, src, trg, src_mask, tgt_mask, src_padding_mask, tgt_padding_mask, memory_key_padding_mask):
        src_emb = self.positional_encoding(self.src_tok_emb(src))
        tgt_emb = self.positional_encoding(self.tgt_tok_emb(trg))
        outs = self.transformer(src_emb, tgt_emb, src_mask, tgt_mask, None,
                                src_padding_mask, tgt_padding_mask, memory_key_padding_mask)
        return self.generator(outs)

    def encode(self, src, src_mask):
        return self.transformer.encoder(self.positional_encoding(self.src_tok_emb(src)), src_mask)

    def decode(self, tgt, memory, tgt_mask):
        return self.transformer.decoder(self.positional_encoding(self.tgt_tok_emb(tgt)), memory, tgt_mask)


def generate_square_subsequent_mask(sz):
    mask = (torch.triu(torch.ones((sz, sz))) == 1).transpose(0, 1)
    return mask.float().masked_fill(mask == 0, float('-inf')).masked_fill(mask == 1, float(0.0))


def greedy_decode(model, src, src_mask, max_len, start_symbol):
    memory = model.encode(src, src_mask)
    ys = torch.ones(1, 1).fill_(start_symbol).type(torch.long)
    for i in range(max_len - 1):
        tgt_mask = (generate_square_subsequent_mask(ys.size(0)).type(torch.bool))
        out = model.decode(ys, memory, tgt_mask)
        out = out.transpose(0, 1)
        prob = model.generator(out[:, -1])
        _, next_word = torch.max(prob, dim=1)
        next_word = next_word.item()
        ys = torch.cat([ys, torch.ones(1, 1).type_as(src.data).fill_(next_word)], dim=0)
        if next_word == EOS_IDX:
            break
    return ys
# ---------------------------------------------------------------- end of the tutorial's code


SRC_V, TGT_V = 40, 36
HP = {"nhead": 4, "pad_id": PAD_IDX, "bos_id": BOS_IDX, "eos_id": EOS_IDX, "unk_id": UNK_IDX, "max_len": 64}


def tutorial_model(seed: int = 0) -> Seq2SeqTransformer:
    torch.manual_seed(seed)
    model = Seq2SeqTransformer(2, 2, 32, 4, SRC_V, TGT_V, dim_feedforward=64, dropout=0.0)
    for p in model.parameters():
        if p.dim() > 1:
            nn.init.xavier_uniform_(p)
    return model


def sources(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[BOS_IDX, *rng.integers(4, SRC_V, size=int(rng.integers(2, 10))).tolist(), EOS_IDX] for _ in range(n)]


def train_reverse(model: Seq2SeqTransformer, steps: int = 250) -> Seq2SeqTransformer:
    """The tutorial's training step on a toy task (target = source reversed, ids folded into the target vocab)."""
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    loss_fn = nn.CrossEntropyLoss(ignore_index=PAD_IDX)
    model.train()
    for step in range(steps):
        srcs = sources(32, 100 + step)
        tgts = [[BOS_IDX, *[4 + (t - 4) % (TGT_V - 4) for t in reversed(s[1:-1])], EOS_IDX] for s in srcs]
        src = nn.utils.rnn.pad_sequence([torch.tensor(s) for s in srcs], padding_value=PAD_IDX)
        tgt = nn.utils.rnn.pad_sequence([torch.tensor(t) for t in tgts], padding_value=PAD_IDX)
        tgt_in = tgt[:-1]
        tgt_mask = generate_square_subsequent_mask(tgt_in.shape[0])
        src_mask = torch.zeros((src.shape[0], src.shape[0])).type(torch.bool)
        logits = model(src, tgt_in, src_mask, tgt_mask, (src == PAD_IDX).T, (tgt_in == PAD_IDX).T, (src == PAD_IDX).T)
        loss = loss_fn(logits.reshape(-1, TGT_V), tgt[1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def save(model, tmp_path, hp=None):
    torch.save(model.state_dict(), tmp_path / "model.pt")
    (tmp_path / "hp.json").write_text(json.dumps(hp or HP))
    return tmp_path / "model.pt", tmp_path / "hp.json"


def test_logits_equal_the_tutorial_module_on_padded_batches(tmp_path):
    model = tutorial_model().eval()
    pt, hp = save(model, tmp_path)
    ours = load_checkpoint(import_model(pt, tmp_path / "ckpt", format="nn-transformer", config_file=hp)).model
    srcs = sources(16, 0)
    src = nn.utils.rnn.pad_sequence([torch.tensor(s) for s in srcs], padding_value=PAD_IDX)       # [S, B]
    tgt = torch.from_numpy(np.random.default_rng(1).integers(4, TGT_V, size=(7, 16)))
    tgt[0] = BOS_IDX
    with torch.no_grad():
        want = model(src, tgt, torch.zeros((src.shape[0],) * 2, dtype=torch.bool),
                     generate_square_subsequent_mask(7), (src == PAD_IDX).T, None, (src == PAD_IDX).T)
        got = ours(src.T, (src != PAD_IDX).T.long(), tgt.T).transpose(0, 1)
    err = float((want - got).abs().max())
    assert err <= 1e-5 and float(want.std()) > 0.1, err


def test_norm_first_when_the_json_says_so(tmp_path):
    model = tutorial_model()
    model.transformer = Transformer(d_model=32, nhead=4, num_encoder_layers=2, num_decoder_layers=2,
                                    dim_feedforward=64, dropout=0.0, norm_first=True)
    with torch.no_grad():
        for p in model.transformer.parameters():
            p.add_(torch.randn_like(p) * 0.3)              # LayerNorm weights and biases that matter
    model.eval()
    pt, hp = save(model, tmp_path, {**HP, "norm_first": True})
    ours = load_checkpoint(import_model(pt, tmp_path / "ckpt", config_file=hp)).model
    assert ours.config.norm == "pre"
    srcs = sources(8, 2)
    src = nn.utils.rnn.pad_sequence([torch.tensor(s) for s in srcs], padding_value=PAD_IDX)
    tgt = torch.from_numpy(np.random.default_rng(3).integers(4, TGT_V, size=(5, 8)))
    tgt[0] = BOS_IDX
    with torch.no_grad():
        want = model(src, tgt, torch.zeros((src.shape[0],) * 2, dtype=torch.bool),
                     generate_square_subsequent_mask(5), (src == PAD_IDX).T, None, (src == PAD_IDX).T)
        got = ours(src.T, (src != PAD_IDX).T.long(), tgt.T).transpose(0, 1)
    assert float((want - got).abs().max()) <= 1e-5 and float(want.std()) > 0.1


@pytest.mark.slow
def test_greedy_tokens_equal_the_tutorials_greedy_decode(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = train_reverse(tutorial_model(seed=1))
    finally:
        torch.set_num_threads(threads)
    pt, hp = save(model, tmp_path)
    ours = load_checkpoint(import_model(pt, tmp_path / "ckpt", config_file=hp)).model   # format detected: a file
    srcs = sources(64, 7)
    with torch.no_grad():
        want = []
        for s in srcs:
            src = torch.tensor(s).view(-1, 1)
            ys = greedy_decode(model, src, torch.zeros((len(s), len(s))).type(torch.bool), 20, BOS_IDX)
            want.append(ys.flatten().tolist()[1:])
    got = [h[0].tokens for h in generate_ids(TorchEngine(ours), srcs, SearchOptions(max_new_tokens=19))]
    assert len({tuple(w) for w in want}) >= 32
    assert got == want


@pytest.mark.parametrize("change,message", [
    ("rename", "not in the tutorial's Seq2SeqTransformer layout"),
    ("learned", "learned positions cannot be represented"),
    ("no_config", "needs --config JSON"),
    ("bad_config", "missing ['eos_id']"),
])
def test_wrong_layouts_exit_2_naming_expected_and_found(tmp_path, change, message):
    model = tutorial_model()
    state = model.state_dict()
    hp = dict(HP)
    if change == "rename":
        state["src_embed.weight"] = state.pop("src_tok_emb.embedding.weight")
    if change == "learned":
        state["positional_encoding.pos_embedding"] = torch.randn_like(state["positional_encoding.pos_embedding"])
    if change == "bad_config":
        del hp["eos_id"]
    torch.save(state, tmp_path / "model.pt")
    (tmp_path / "hp.json").write_text(json.dumps(hp))
    args = ["import", str(tmp_path / "model.pt"), "--out", str(tmp_path / "out"), "--format", "nn-transformer"]
    if change != "no_config":
        args += ["--config", str(tmp_path / "hp.json")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and message in result.output and result.output.count("\n") == 1, result.output
    assert not (tmp_path / "out").exists()


def _ddp(sd: dict) -> dict:
    return {f"module.{k}": v for k, v in sd.items()}


WRAPPED = {                              # name -> (what a training script saves, the wrapper key taken off)
    "model_state_dict": (lambda sd: {"epoch": 3, "model_state_dict": sd, "optimizer_state_dict": {"step": 5}},
                         "model_state_dict"),
    "state_dict": (lambda sd: {"state_dict": sd, "best_loss": 0.5}, "state_dict"),
    "model": (lambda sd: {"model": sd}, "model"),
    "module.": (_ddp, None),
    "both": (lambda sd: {"model_state_dict": _ddp(sd), "epoch": 1}, "model_state_dict"),
}


@pytest.mark.parametrize("wrapping", list(WRAPPED))
def test_training_checkpoints_and_ddp_prefixes_are_unwrapped(tmp_path, wrapping):
    """A training script's checkpoint ({"model_state_dict": ...}) or a DataParallel state dict ('module.' names)
    imports as the plain state dict would, and the output says what was taken off; an empty --out needs no --force."""
    model = tutorial_model(seed=2)
    pt, hp = save(model, tmp_path)
    plain = load_checkpoint(import_model(pt, tmp_path / "plain", config_file=hp)).model.state_dict()
    wrap, key = WRAPPED[wrapping]
    torch.save(wrap(model.state_dict()), tmp_path / "wrapped.pt")
    (tmp_path / "out").mkdir()
    result = CliRunner().invoke(main, ["import", str(tmp_path / "wrapped.pt"), "--config", str(hp),
                                       "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert (f"took the state dict under {key!r}" in result.stderr) == (key is not None), result.stderr
    assert ("removed the 'module.' prefix DataParallel" in result.stderr) == (wrapping in ("module.", "both"))
    got = load_checkpoint(tmp_path / "out").model.state_dict()
    assert all(torch.equal(got[k], plain[k]) for k in plain)


def test_safetensors_state_dicts_and_truncated_files(tmp_path):
    """A state dict saved with safetensors imports too; a file cut short is reported as truncated, not as a file
    to re-save with torch.save."""
    from safetensors.torch import save_file

    model = tutorial_model(seed=3)
    pt, hp = save(model, tmp_path)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    plain = load_checkpoint(import_model(pt, tmp_path / "a", config_file=hp)).model.state_dict()
    got = load_checkpoint(import_model(tmp_path / "model.safetensors", tmp_path / "b", config_file=hp)).model
    assert all(torch.equal(got.state_dict()[k], plain[k]) for k in plain)
    for name in ("model.safetensors", "model.pt"):
        whole = (tmp_path / name).read_bytes()
        (tmp_path / f"cut-{name}").write_bytes(whole[: len(whole) * 2 // 3])
        result = CliRunner().invoke(main, ["import", str(tmp_path / f"cut-{name}"), "--config", str(hp),
                                           "--out", str(tmp_path / "out")])
        assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
        assert f"cut-{name} is truncated" in result.stderr and "download or save it again" in result.stderr
        assert "torch.save" not in result.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", [float("nan"), float("-inf")])
def test_nonfinite_source_weights_are_refused_naming_the_tensor(tmp_path, value):
    model = tutorial_model()
    with torch.no_grad():
        model.transformer.decoder.layers[1].linear2.weight[0, 0] = value
    pt, hp = save(model, tmp_path)
    result = CliRunner().invoke(main, ["import", str(pt), "--config", str(hp), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
    assert "weight transformer.decoder.layers.1.linear2.weight holds" in result.stderr
    assert "the source model is broken" in result.stderr and not (tmp_path / "out").exists()


def test_sentencepiece_models_per_side(tmp_path):
    """--config source_spm/target_spm: SentencePiece's own ids, sources as BOS ... EOS (the tutorial's transform)."""
    pytest.importorskip("sentencepiece")
    import sentencepiece as spm

    from toolkit.testing.tiny_marian import corpus

    lines = corpus(n=500, seed=3)
    for side in ("src", "tgt"):                            # the tutorial's special ids: unk 0, pad 1, bos 2, eos 3
        spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(tmp_path / side),
                                       vocab_size=SRC_V if side == "src" else TGT_V, unk_id=UNK_IDX, pad_id=PAD_IDX,
                                       bos_id=BOS_IDX, eos_id=EOS_IDX, minloglevel=2, num_threads=1)
    model = tutorial_model().eval()
    pt, hp = save(model, tmp_path, {**HP, "source_spm": "src.model", "target_spm": "tgt.model"})
    ckpt = load_checkpoint(import_model(pt, tmp_path / "ckpt", config_file=hp))
    src = spm.SentencePieceProcessor(model_file=str(tmp_path / "src.model"))
    tgt = spm.SentencePieceProcessor(model_file=str(tmp_path / "tgt.model"))
    for text in lines[:20]:
        assert ckpt.tokenizer.encode(text) == [BOS_IDX, *src.encode(text), EOS_IDX]
        ids = tgt.encode(text)
        assert ckpt.tokenizer.decode([BOS_IDX, *ids, EOS_IDX, PAD_IDX]) == tgt.decode(ids)
    result = CliRunner().invoke(main, ["generate", str(tmp_path / "ckpt"), lines[0], "--max-new-tokens", "5"])
    assert result.exit_code == 0, result.output


def train_as_the_tutorial(model, srcs: list[list[int]], tgts: list[list[int]], steps: int = 3000) -> None:
    """The tutorial's training loop (Adam, warm-up then linear decay, batches of 32 pairs), on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        warmup = steps // 10
        opt = torch.optim.Adam(model.parameters(), lr=3e-3, betas=(0.9, 0.98))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / warmup, max(
            0.1, 1 - (s - warmup) / (steps - warmup))))
        loss_fn = nn.CrossEntropyLoss(ignore_index=PAD_IDX)
        gen = torch.Generator().manual_seed(0)
        model.train()
        for _ in range(steps):                           # the tutorial's training step, on the cipher pairs
            rows = torch.randint(0, len(srcs), (32,), generator=gen).tolist()
            src = nn.utils.rnn.pad_sequence([torch.tensor(srcs[r]) for r in rows], padding_value=PAD_IDX)
            tgt = nn.utils.rnn.pad_sequence([torch.tensor(tgts[r]) for r in rows], padding_value=PAD_IDX)
            tgt_in = tgt[:-1]
            logits = model(src, tgt_in, torch.zeros((src.shape[0],) * 2, dtype=torch.bool),
                           generate_square_subsequent_mask(tgt_in.shape[0]), (src == PAD_IDX).T,
                           (tgt_in == PAD_IDX).T, (src == PAD_IDX).T)
            loss = loss_fn(logits.reshape(-1, 100), tgt[1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_trained_tutorial_model_passes_the_int8_gate(tmp_path):
    """The tutorial-like family on a realistic footing: the tutorial's module (interleaved positions, relu, the final
    encoder/decoder LayerNorms, untied generator, separate vocabularies), trained as the tutorial trains it on a
    text task (toolkit.testing.tiny_marian's syllable cipher) with one SentencePiece model per side, imported with its
    tokenizers, fused, and its int8 bundle verified by the gate (>= 98% of greedy tokens) on held-out texts."""
    pytest.importorskip("sentencepiece")
    import sentencepiece as spm

    from exporters.export import export_checkpoint
    from exporters.optimize import optimize_bundle
    from runtime.manifest import read_manifest
    from toolkit.parity.tolerances import tolerance
    from toolkit.testing.tiny_marian import cipher, corpus, held_out

    lines = corpus(seed=0)
    targets = [cipher(t) for t in lines]
    for side, texts, size in (("src", lines, 120), ("tgt", targets, 100)):
        spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_prefix=str(tmp_path / side),
                                       vocab_size=size, unk_id=UNK_IDX, pad_id=PAD_IDX, bos_id=BOS_IDX,
                                       eos_id=EOS_IDX, minloglevel=2, num_threads=1)
    src_sp, tgt_sp = (spm.SentencePieceProcessor(model_file=str(tmp_path / f"{s}.model")) for s in ("src", "tgt"))
    srcs = [[BOS_IDX, *src_sp.encode(t), EOS_IDX] for t in lines]
    tgts = [[BOS_IDX, *tgt_sp.encode(t), EOS_IDX] for t in targets]
    torch.manual_seed(0)
    model = Seq2SeqTransformer(2, 2, 64, 4, 120, 100, dim_feedforward=256, dropout=0.0)
    for p in model.parameters():
        if p.dim() > 1:
            nn.init.xavier_uniform_(p)
    train_as_the_tutorial(model, srcs, tgts)
    model.eval()
    pt, hp = save(model, tmp_path, {**HP, "source_spm": "src.model", "target_spm": "tgt.model", "max_len": 128})
    ckpt = import_model(pt, tmp_path / "ckpt", config_file=hp)
    c = load_checkpoint(ckpt).config
    assert (c.positions, c.activation, c.final_norm, c.tie_embeddings, c.share_embeddings, c.logits_bias) == \
        ("interleaved", "relu", True, False, False, True)
    fused, _ = optimize_bundle(export_checkpoint(ckpt, tmp_path / "bundle"), tmp_path / "fused")
    ops = read_manifest(fused)["graphs"]["decoder"]["op_counts"]
    assert ops["Relu"] == 2 and ops["LayerNormalization"] == 1 and ops["com.microsoft.SkipLayerNormalization"] > 0
    texts = held_out(64)
    tok = load_checkpoint(ckpt).tokenizer
    hyps = generate_ids(TorchEngine(load_checkpoint(ckpt).model), [tok.encode(t) for t in texts],
                        SearchOptions(max_new_tokens=40))
    right = sum(tok.decode(h[0].tokens) == cipher(t) for t, h in zip(texts, hyps))
    print(f"tutorial model: {right} of {len(texts)} held-out texts translated exactly")
    out, report = optimize_bundle(fused, tmp_path / "int8", precision="int8", texts=texts, samples=64)
    gen = report.parity["generation"]
    assert report.parity["verified"] and gen["basis"] == "tokens" and gen["distinct_outputs"] >= 32, report.parity
    assert gen["tokens_equal"] >= tolerance("int8", "cpu").token_match, report.parity["summary"]
    assert read_manifest(out)["parity"]["verified"] is True
    print(report.parity["summary"])
