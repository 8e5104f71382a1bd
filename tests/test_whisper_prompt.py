"""Whisper text prompts (<|startofprev|> + the prompt's ids before <|startoftranscript|>), conditioning on the
previous windows' text, and segment times clamped to the audio.

A tiny random Whisper with timestamp tokens (toolkit/testing/tiny_whisper.py; max_len 64, so a window takes at most
31 prompt ids) is built and imported once for the session. Proofs: the prompt's ids are transformers' get_prompt_ids
(less <|startofprev|>); greedy on 16 inputs gives generate(prompt_ids=..., return_timestamps=True)'s first window
(outputs vary, and the prompt changes them: asserted); the prompt is forced, never returned; a window's no-speech
probability is transformers' after its prompt; openai-whisper's rules for which ids each window gets (initial
prompt, condition_on_previous_text, the reset after a hot fallback, carry_initial_prompt, the cut from the left) and
their use on a 45 s clip; the max_len check; the errors (API and CLI); the CLI's --prompt is the API's
initial_prompt. Slow: beam 4; transformers' long-form generate(prompt_ids, condition_on_prev_tokens=True) on a
45 s clip (the first window's segments; the second window's ids from its zero padding; its segment ends pass the
clip's, ours do not); tests/test_whisper_speech.py: prompted ids on the trained model's held-out clips.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from click.testing import CliRunner

transformers = pytest.importorskip("transformers")
sf = pytest.importorskip("soundfile")

from runtime.errors import InputError  # noqa: E402
from runtime.generate import generate  # noqa: E402
from runtime.longform import Context, segments_of, whole_mel  # noqa: E402
from runtime.request import Request  # noqa: E402
from runtime.transcribe import Transcriber  # noqa: E402
from toolkit.apps.cli import main  # noqa: E402
from toolkit.reference.checkpoint import load_checkpoint  # noqa: E402
from toolkit.reference.importers import import_model  # noqa: E402
from toolkit.reference.torch_engine import TorchEngine  # noqa: E402
from toolkit.testing.tiny_whisper import random_whisper  # noqa: E402

INPUTS = 16
MAX_NEW = 12
TEXT = "the lazy dog jumps over a jolly box"


@pytest.fixture(scope="session")
def prompted(tmp_path_factory):
    """(transformers model, features [16, 80, 3000], the checkpoint dir, a Transcriber on it, its tokenizer dir)."""
    root = tmp_path_factory.mktemp("whisper_prompt")
    model, features = random_whisper(root / "tiny", inputs=INPUTS, timestamps=True)
    ckpt = import_model(root / "tiny", root / "ckpt")
    loaded = load_checkpoint(ckpt)
    return model, features, ckpt, Transcriber.from_engine(TorchEngine(loaded.model), loaded.tokenizer), root / "tiny"


def hf_first_windows(model, features, beams, prompt_ids) -> list[list[int]]:
    """Each input's first window's ids after its decoder input (the prompt's, the forced ones), end token kept."""
    with torch.no_grad():
        out = model.generate(features, language="en", task="transcribe", return_timestamps=True, num_beams=beams,
                             max_new_tokens=MAX_NEW, return_segments=True, prompt_ids=torch.tensor(prompt_ids))
    eos, skip = model.generation_config.eos_token_id, len(prompt_ids) + 3   # <|sot|> <|en|> <|transcribe|>
    rows = [out["segments"][i][0]["result"].tolist() for i in range(len(features))]
    assert all(r[:len(prompt_ids)] == list(prompt_ids) for r in rows)   # the prompt leads the decoder input
    return [r[skip:][: r[skip:].index(eos) + 1] if eos in r[skip:] else r[skip:] for r in rows]


@pytest.mark.parametrize("beams,inputs", [(1, INPUTS), pytest.param(4, 8, marks=pytest.mark.slow)])
def test_prompted_ids_equal_generate_prompt_ids(prompted, beams, inputs):
    model, features, _, tr, tokenizer_dir = prompted
    features = features[:inputs]
    hf = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    context = tr.prompt_ids(TEXT)
    assert hf.get_prompt_ids(TEXT).tolist() == [tr.start_of_prev, *context]
    want = hf_first_windows(model, features, beams, [tr.start_of_prev, *context])
    assert len({tuple(r) for r in want}) >= max(4, inputs // 4), want  # outputs vary by input
    prompt = tr.prompt("en", "transcribe", True)
    plain = replace(tr.options(prompt, True, beams, max_new_tokens=MAX_NEW), prefix_ids=(tuple(prompt),) * inputs)
    plain = [h[0].tokens[len(prompt):] for h in generate(tr.engine, Request.build(tr.engine, list(features.numpy()),
                                                                                 None, plain))]
    assert sum(w != p for w, p in zip(want, plain)) >= inputs // 4    # the prompt changes them (unprompted ids
                                                                       # are generate's: tests/test_transcribe.py)
    opts = tr.options(prompt, True, beams, max_new_tokens=MAX_NEW, context=context)
    assert opts.start_id == tr.start_of_prev and opts.prefix_ids[0] == (*context, tr.engine.bos_id, *prompt)
    opts = replace(opts, prefix_ids=opts.prefix_ids * inputs)
    hyps = generate(tr.engine, Request.build(tr.engine, list(features.numpy()), None, opts))
    assert [h[0].tokens[len(opts.prefix_ids[0]):] for h in hyps] == want
    window = tr.decode_window(features[0].numpy(), replace(opts, prefix_ids=opts.prefix_ids[:1]))
    assert window.tokens == [t for t in want[0] if t != tr.engine.eos_id]   # the prompt is never returned


def test_which_ids_each_window_is_prompted_with():
    """openai-whisper's all_tokens[prompt_reset_since:], its carry_initial_prompt and its cut from the left."""
    once = Context([1, 2, 3], condition=False, carry=False, reset_temperature=0.5, limit=5)
    assert once.ids() == [1, 2, 3]
    once.add([4, 5], 0.0)
    assert once.ids() == []                                            # the first window only
    going = Context([1, 2, 3], condition=True, carry=False, reset_temperature=0.5, limit=5)
    going.add([4, 5], 0.0)
    going.add([6], 0.4)
    assert going.ids() == [2, 3, 4, 5, 6]                              # the latest 5
    going.add([7], 0.6)
    assert going.ids() == []                                           # a window above 0.5 resets it
    going.add([8], 0.0)
    assert going.ids() == [8]
    carried = Context([1, 2], condition=True, carry=True, reset_temperature=0.5, limit=4)
    carried.add([3, 4, 5], 0.0)
    assert carried.ids() == [1, 2, 4, 5]                               # the prompt whole, then the latest text
    carried.add([6], 0.8)
    assert carried.ids() == [1, 2]
    alone = Context([1, 2], condition=False, carry=True, reset_temperature=0.5, limit=4)
    alone.add([3], 0.0)
    assert alone.ids() == [1, 2]
    assert Context(list(range(10)), False, True, 0.5, 4).ids() == [6, 7, 8, 9]


def clip(seconds: int, seed: int = 5) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.normal(0, 0.1, 16000 * seconds) * np.repeat(rng.uniform(0.2, 1.0, seconds), 16000)).astype(np.float32)


def test_windows_are_conditioned_on_the_prompt_and_the_previous_text(prompted):
    """A 45 s clip, at temperature 0: window 1 decodes after the prompt; window 2 after nothing, or (conditioned)
    after the prompt and window 1's ids; each window's no-speech probability is transformers' after its own prompt
    (<|startofprev|>, the ids, <|startoftranscript|> fed at once)."""
    model, _, _, tr, _ = prompted
    audio, plain = clip(45), dict(language="en", max_new_tokens=MAX_NEW, temperatures=(0.0,))
    mel, _ = whole_mel(audio, 80)
    windows = [mel[:, 0:3000], mel[:, 3000:6000]]
    prompt, context = tr.prompt("en", "transcribe", False), tr.prompt_ids(TEXT)

    encoded = [tr.encode(w[None]) for w in windows]                  # one encoder run a window here too

    def decoded(at, ctx):
        opts = tr.options(prompt, False, max_new_tokens=MAX_NEW, context=ctx)
        return tr.decode_window(windows[at], opts, encoded[at]).tokens

    def no_speech(at, ctx):                                            # transformers' logits after the prompt
        ids = torch.tensor([[*tr.lead(ctx), tr.engine.bos_id]])
        with torch.no_grad():
            logits = model(input_features=torch.from_numpy(windows[at][None]), decoder_input_ids=ids).logits
        return float(torch.softmax(logits[0, -1].double(), -1)[tr.no_speech])

    once = tr.transcribe(audio, initial_prompt=TEXT, no_speech_threshold=None, **plain).segments
    first = decoded(0, context)
    assert first != decoded(0, [])                                     # the prompt matters here
    assert [s.tokens for s in once] == [first, decoded(1, [])]
    going = tr.transcribe(audio, initial_prompt=TEXT, condition_on_previous_text=True, **plain).segments
    assert [s.tokens for s in going] == [first, decoded(1, (context + first)[-tr.context_limit:])]
    assert going[1].tokens != once[1].tokens
    assert [s.no_speech_prob for s in going] == pytest.approx(
        [no_speech(0, context), no_speech(1, (context + first)[-tr.context_limit:])], abs=1e-6)
    assert going[0].no_speech_prob != pytest.approx(no_speech(0, ()), abs=1e-6)


def test_a_long_prompt_is_cut_from_the_left_and_leaves_room(prompted):
    _, _, _, tr, _ = prompted
    long_text = " ".join([TEXT] * 6)
    ids = tr.prompt_ids(long_text)
    assert len(ids) > tr.context_limit == tr.engine.max_len // 2 - 1
    kept = Context(ids, False, False, 0.5, tr.context_limit).ids()
    assert kept == ids[-tr.context_limit:]
    opts = tr.options(tr.prompt("en", "transcribe", True), True, context=kept)
    assert len(opts.prefix_ids[0]) + opts.max_new_tokens == tr.engine.max_len   # every position, none past it
    result = tr.transcribe(clip(4), language="en", timestamps=True, initial_prompt=long_text, temperatures=(0.0,))
    assert result.segments[0].tokens[0] >= tr.timestamp_begin          # its text, not the prompt, comes back
    with pytest.raises(InputError, match=r"max_new_tokens 40 and the window's 35 prompt tokens pass the model's 64 "
                                         r"decoder positions; give max_new_tokens of at most 29 \(or a shorter"):
        tr.transcribe(clip(4), language="en", initial_prompt=long_text, max_new_tokens=40)


def test_segment_times_are_clamped_to_the_audio():
    from types import SimpleNamespace

    tr, b = SimpleNamespace(timestamp_begin=1000), 1000
    pieces, _ = segments_of(tr, [b, 7, b + 10, b + 10, 8, b + 1400, b + 1400], 30.0, 500)
    assert [p[:2] for p in pieces] == [(30.0, 30.2), (30.2, 35.0)]    # 58 s said, the audio ends at 35 s
    pieces, _ = segments_of(tr, [b, 7, b + 100, b + 600, 8, b + 700, b + 700], 0.0, 200)
    assert [p[:2] for p in pieces] == [(0.0, 2.0), (2.0, 2.0)]         # a start past the end too
    assert segments_of(tr, [b, 7, 8, b + 1000], 0.0, 300)[0][0][:2] == (0.0, 3.0)   # no pair: its last timestamp


def test_transcribed_segments_end_inside_the_clip(prompted):
    _, _, _, tr, _ = prompted
    for seconds in (4, 45):
        result = tr.transcribe(clip(seconds, seed=seconds), language="en", timestamps=True, temperatures=(0.0,),
                               max_new_tokens=MAX_NEW)
        assert result.segments and all(0.0 <= s.start <= s.end <= result.duration for s in result.segments)


def test_bad_prompts_are_refused(prompted):
    _, _, _, tr, _ = prompted
    audio = clip(4)
    for prompt, message in (("<|en|> hello", "special token id"), (3.5, "a prompt is a text or a list of token ids"),
                            ([tr.engine.eos_id], "special token id"), ([tr.engine.vocab_size], "special token id")):
        with pytest.raises(InputError, match=message):
            tr.transcribe(audio, language="en", initial_prompt=prompt)
    assert tr.prompt_ids([tr.start_of_prev, 5, tr.timestamp_begin]) == [5, tr.timestamp_begin]   # ids: stamps too
    assert tr.prompt_ids("   ") == []


def wav(tmp_path, seconds: int = 4):
    path = tmp_path / "clip.wav"
    sf.write(path, clip(seconds), 16000)
    return path


def test_cli_prompt_is_the_apis_initial_prompt(prompted, tmp_path):
    _, _, ckpt, tr, _ = prompted
    path = wav(tmp_path, 45)
    flags = ["--language", "en", "--format", "json", "--no-fallback", "--max-new-tokens", str(MAX_NEW)]
    result = CliRunner().invoke(main, ["transcribe", str(ckpt), str(path), *flags, "--prompt", TEXT,
                                       "--condition-on-previous-text"])
    assert result.exit_code == 0, result.output
    want = tr.transcribe(path, language="en", max_new_tokens=MAX_NEW, temperatures=(0.0,),
                         compression_ratio_threshold=None, logprob_threshold=None, no_speech_threshold=None,
                         initial_prompt=TEXT, condition_on_previous_text=True)
    assert json.loads(result.stdout)["segments"] == json.loads(json.dumps(want.to_dict()))["segments"]
    for args, message in ((["--prompt", "<|de|>"], "special token id"),
                          (["--carry-prompt"], "give --prompt too")):
        bad = CliRunner().invoke(main, ["transcribe", str(ckpt), str(path), *flags, *args])
        assert bad.exit_code == 2 and message in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.output


@pytest.mark.slow
def test_conditioned_long_form_equals_generate_condition_on_prev_tokens(prompted):
    """A 45 s clip, prompt_ids and condition_on_prev_tokens=True in transformers' long-form generate: its first
    window's segments are ours, and its second window's ids are ours decoded after the prompt and the first window's
    ids from transformers' zero padding (runtime.longform pads the last window with the log-mel of silence, as
    openai-whisper does: tests/test_whisper_speech.py)."""
    model, _, _, tr, _ = prompted
    audio, context = clip(45), tr.prompt_ids(TEXT)
    mel, content = whole_mel(audio, 80)
    model.generation_config.prev_sot_token_id = tr.start_of_prev   # real checkpoints' configs have it (without,
    try:                                                            # transformers puts <|startofprev|> in twice)
        with torch.no_grad():
            out = model.generate(torch.from_numpy(mel[None, :, :content]), language="en", task="transcribe",
                                 attention_mask=torch.ones(1, content, dtype=torch.long), return_timestamps=True,
                                 return_segments=True, condition_on_prev_tokens=True, temperature=0.0,
                                 max_new_tokens=MAX_NEW, logprob_threshold=None, no_speech_threshold=None,
                                 compression_ratio_threshold=None,
                                 prompt_ids=torch.tensor([tr.start_of_prev, *context]))
    finally:
        del model.generation_config.prev_sot_token_id
    eos = model.generation_config.eos_token_id
    want = [(round(float(s["start"]), 3), round(float(s["end"]), 3), [t for t in s["tokens"].tolist() if t != eos])
            for s in out["segments"][0]]
    got = tr.transcribe(audio, language="en", timestamps=True, temperatures=(0.0,), max_new_tokens=MAX_NEW,
                        no_speech_threshold=None, logprob_threshold=None, compression_ratio_threshold=None,
                        initial_prompt=TEXT, condition_on_previous_text=True).segments
    first = [(s.start, s.end, s.tokens) for s in got if s.seek == 0]
    assert len(first) >= 2 and first == want[:len(first)]
    seek = got[len(first)].seek                                        # the second window's first frame
    ctx = (context + [t for s in first for t in s[2]])[-tr.context_limit:]
    zero = np.pad(mel[:, seek:content], ((0, 0), (0, 3000 - (content - seek))))
    opts = tr.options(tr.prompt("en", "transcribe", True), True, max_new_tokens=MAX_NEW, context=ctx)
    pieces, _ = segments_of(tr, [t for t in tr.decode_window(zero, opts).tokens if t != eos], seek / 100, 3000)
    assert [p[2] for p in pieces] == [w[2] for w in want[len(first):]] and len(pieces) >= 2
    assert any(w[1] > 45.0 for w in want) and all(s.end <= 45.0 for s in got)   # its ends pass the clip's; ours not
