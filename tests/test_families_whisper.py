"""Whisper (WhisperForConditionalGeneration) imported by `onnxformer import`, against transformers.

A tiny random Whisper is built OFFLINE (toolkit/testing/tiny_whisper.py: d_model 64, 2 + 2 layers, 4 heads, 80 mel
bins, 1500 encoder positions, 64 decoder positions, a byte-level tokenizer.json with Whisper's special tokens, a
generation_config.json with the prompt tokens and suppressed ids), saved with save_pretrained and imported by the
command line. Its inputs are log-mel features [80, 3000] whose greedy outputs vary (>= 8 distinct of 16 asserted
before anything is compared). Proofs: the config holds Whisper's variants; the prompt ids are the ones generate
forces; teacher-forced logits within 1e-5 (float64 where float32 rounding alone exceeds it); greedy and beam-4 ids
equal to `WhisperForConditionalGeneration.generate(input_features, language=..., task=...)` (whose suppressed ids
change the outputs: asserted); text equal to transformers' batch_decode. What cannot be represented is refused.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from runtime.errors import InputError  # noqa: E402
from runtime.generate import generate_ids  # noqa: E402
from runtime.search import SearchOptions  # noqa: E402
from runtime.speech import prompt_ids  # noqa: E402
from toolkit.apps.cli import main  # noqa: E402
from toolkit.parity.original_whisper import whisper_generate, whisper_prompt  # noqa: E402
from toolkit.reference.checkpoint import load_checkpoint  # noqa: E402
from toolkit.reference.importers import ImportRefused  # noqa: E402
from toolkit.reference.importers.whisper import convert_state, generation_fields  # noqa: E402
from toolkit.reference.torch_engine import TorchEngine  # noqa: E402
from toolkit.testing.tiny_whisper import random_whisper  # noqa: E402

INPUTS = 16
MAX_NEW = 10
LIMIT = 1e-5                  # the imported-model row of the tolerance table


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    """(transformers model, its features [16, 80, 3000], the checkpoint `onnxformer import` wrote, source dir)."""
    root = tmp_path_factory.mktemp("whisper")
    model, features = random_whisper(root / "tiny", inputs=INPUTS)
    result = CliRunner().invoke(main, ["import", str(root / "tiny"), "--out", str(root / "ckpt")])
    assert result.exit_code == 0, result.output
    return model, features, load_checkpoint(root / "ckpt"), root / "tiny"


_RUNS: dict = {}


def hf_generate(model, features, language="en", task="transcribe", beams=1, **generation):
    """WhisperForConditionalGeneration.generate's ids after the prompt, cut after the first end token (each run
    once per module: several tests compare with the same one)."""
    key = (id(model), len(features), language, task, beams, tuple(sorted(generation.items())))
    if key not in _RUNS:
        _RUNS[key] = _hf_generate(model, features, language, task, beams, **generation)
    return _RUNS[key]


def _hf_generate(model, features, language, task, beams, **generation):
    with torch.no_grad():
        out = model.generate(features, language=language, task=task, max_new_tokens=MAX_NEW, num_beams=beams,
                             **generation).tolist()
    eos = model.generation_config.eos_token_id
    return [row[: row.index(eos) + 1] if eos in row else row for row in out]


def ours(engine, features, prefix, beams=1):
    opts = SearchOptions(max_new_tokens=MAX_NEW, beam=beams, prefix_ids=(tuple(prefix),) * len(features))
    return [h[0].tokens[len(prefix):] for h in generate_ids(engine, list(features.numpy()), opts)]


def test_the_config_is_whispers(whisper):
    model, _, ckpt, src = whisper
    c, hf, gen = ckpt.config, model.config, json.loads((src / "generation_config.json").read_text())
    assert (c.encoder_input, c.n_mels, c.source_positions, c.max_len) == ("features", 80, 1500, 64)
    assert (c.norm, c.positions, c.activation, c.scale_embeddings, c.tie_embeddings, c.key_bias, c.linear_bias) == \
        ("pre", "table", "gelu", False, True, False, True)
    assert (c.bos_id, c.eos_id, c.pad_id) == (hf.decoder_start_token_id, hf.eos_token_id, hf.pad_token_id)
    assert list(c.suppress_tokens) == gen["suppress_tokens"] and list(c.begin_suppress_tokens) == \
        gen["begin_suppress_tokens"]
    assert ckpt.model.decoder.layers[0].self_attn.k_proj.bias is None
    assert json.loads((ckpt.path / "import.json").read_text())["format"] == "whisper"
    assert type(ckpt.tokenizer).__name__ == "FastTokenizer" and ckpt.tokenizer.languages == ("en", "de", "fr")


def test_the_prompt_is_the_one_generate_forces(whisper):
    model, features, ckpt, src = whisper
    hf_tok = transformers.AutoTokenizer.from_pretrained(src)
    for language, task in (("en", "transcribe"), ("de", "translate")):
        want = hf_tok.convert_tokens_to_ids([f"<|{language}|>", f"<|{task}|>", "<|notimestamps|>"])
        assert prompt_ids(ckpt.tokenizer, language, task) == want
    with pytest.raises(InputError, match="give the audio's language, one of 3 codes"):
        prompt_ids(ckpt.tokenizer, "xx")
    with pytest.raises(InputError, match="task must be one of transcribe, translate"):
        prompt_ids(ckpt.tokenizer, "en", "summarize")


def test_logits_equal_the_originals(whisper):
    model, features, ckpt, _ = whisper
    c = ckpt.config
    tgt = torch.from_numpy(np.random.default_rng(0).integers(0, c.vocab_size, (INPUTS, 8)))
    tgt[:, 0] = c.bos_id

    def both(hf, ref, feats):
        with torch.no_grad():
            want = hf(input_features=feats, decoder_input_ids=tgt).logits
            _, cross = ref.encode(feats, None)
            got, _ = ref.decode_step(tgt, torch.ones(INPUTS, c.source_positions), ref.empty_cache(INPUTS,
                                     dtype=feats.dtype), cross)
        return want, float((want - got).abs().max())

    want, err = both(model, ckpt.model, features)
    assert float(want.std(dim=0).mean()) > 1e-3                             # logits that depend on the audio
    if err > LIMIT:                                                           # float32 rounding alone: float64
        _, err = both(copy.deepcopy(model).double(), copy.deepcopy(ckpt.model).double(), features.double())
    assert err <= LIMIT, err


@pytest.mark.parametrize("language,task", [("en", "transcribe"), ("fr", "translate")])
def test_greedy_ids_equal_generates(whisper, language, task):
    model, features, ckpt, _ = whisper
    ref = hf_generate(model, features, language, task)
    assert len({tuple(r) for r in ref}) >= 8, ref                          # outputs that vary by input
    got = ours(TorchEngine(ckpt.model), features, prompt_ids(ckpt.tokenizer, language, task))
    assert got == ref


def test_suppressed_ids_change_the_outputs_and_are_honoured(whisper):
    model, features, ckpt, _ = whisper
    ref = hf_generate(model, features)
    free = hf_generate(model, features, suppress_tokens=None, begin_suppress_tokens=None)
    assert free != ref                                                        # suppression matters here
    engine = TorchEngine(ckpt.model)
    engine.suppress_ids, engine.begin_suppress_ids = (), ()
    assert ours(engine, features, prompt_ids(ckpt.tokenizer, "en")) == free
    banned = set(ckpt.config.suppress_tokens)
    assert not banned & {t for row in ref for t in row}
    assert not set(ckpt.config.begin_suppress_tokens) & {row[0] for row in ref}


def test_beam_ids_equal_generates(whisper):
    model, features, ckpt, _ = whisper
    ref = hf_generate(model, features[:8], beams=4)
    assert len({tuple(r) for r in ref}) >= 4, ref
    assert ours(TorchEngine(ckpt.model), features[:8], prompt_ids(ckpt.tokenizer, "en"), beams=4) == ref


@pytest.mark.parametrize("beams,inputs", [(1, INPUTS), (4, 8)])
def test_the_parity_reference_equals_generate_where_its_seek_ends(whisper, beams, inputs):
    """parity's reference (transformers' search over the window, original_whisper.whisper_generate) gives
    generate's very ids where generate's seek loop ends, as it does on this model (no timestamp tokens)."""
    model, features, _, _ = whisper
    ref = hf_generate(model, features[:inputs], beams=beams)
    prompt = whisper_prompt(model.generation_config, "en")
    assert whisper_generate(model, features[:inputs].numpy(), prompt, beams, MAX_NEW) == ref


def test_text_equals_batch_decode(whisper):
    model, features, ckpt, src = whisper
    hf_tok = transformers.AutoTokenizer.from_pretrained(src)
    ref = hf_generate(model, features)
    assert [ckpt.tokenizer.decode(r) for r in ref] == hf_tok.batch_decode(ref, skip_special_tokens=True)


def test_features_of_another_shape_are_refused(whisper):
    _, features, ckpt, _ = whisper
    engine = TorchEngine(ckpt.model)
    with pytest.raises(InputError, match=r"input 0 has shape \[80, 2999\], but this model takes log-mel features of "
                                         r"shape \[80, 3000\]"):
        generate_ids(engine, [features[0, :, :-1].numpy()], SearchOptions(max_new_tokens=4))
    with pytest.raises(InputError, match="input 0 is text, but this model reads audio"):
        generate_ids(engine, ["hello"], SearchOptions(max_new_tokens=4))


@pytest.mark.parametrize("change,message", [
    (lambda hf, state: hf.update(decoder_attention_heads=2), "different attention heads"),
    (lambda hf, state: hf.update(activation_function="quick_gelu"), "activation 'quick_gelu' cannot be represented"),
    (lambda hf, state: state.update({"proj_out.weight": state["model.decoder.embed_tokens.weight"] + 1}),
     "an untied Whisper head cannot be represented"),
    (lambda hf, state: state.update({"model.encoder.layers.0.self_attn.k_proj.bias": torch.zeros(64)}),
     "a key projection bias"),
])
def test_what_cannot_be_represented_is_refused(whisper, change, message):
    model, _, _, src = whisper
    hf = generation_fields(src, json.loads((src / "config.json").read_text()))
    state = dict(model.state_dict())
    change(hf, state)
    with pytest.raises(ImportRefused, match=message):
        convert_state(hf, state)


def test_onnxformer_parity_against_the_original(whisper, tmp_path):
    _, _, ckpt, src = whisper
    result = CliRunner().invoke(main, ["parity", str(src), str(ckpt.path), "--samples", "16"])
    assert result.exit_code == 0, result.output
    assert "parity with the original ok" in result.output and "log-mel features are not speech" in result.output
    texts = tmp_path / "texts.txt"
    texts.write_text("hello\n")
    result = CliRunner().invoke(main, ["parity", str(src), str(ckpt.path), "--input", str(texts)])
    assert result.exit_code == 2 and "a Whisper model reads audio" in result.stderr, result.output
    sf = pytest.importorskip("soundfile")
    clips = tmp_path / "clips"
    clips.mkdir()
    for i, hz in enumerate((220, 440, 880)):
        sf.write(clips / f"{i}.wav", (0.3 * np.sin(2 * np.pi * hz * np.arange(8000) / 16000)).astype(np.float32), 16000)
    result = CliRunner().invoke(main, ["parity", str(src), str(ckpt.path), "--audio", str(clips), "--beam", "1"])
    assert "3 given audio clips' log-mel features" in result.output and "not speech" not in result.output
    assert result.exit_code in (0, 1) and "Traceback" not in result.output, result.output   # 3 clips: few outputs
    result = CliRunner().invoke(main, ["parity", str(src), str(ckpt.path), "--audio", str(clips), "--input",
                                       str(texts)])
    assert result.exit_code == 2 and "--audio and --input both give the inputs" in result.stderr, result.output
