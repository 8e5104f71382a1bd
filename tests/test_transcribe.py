"""`onnxformer transcribe` and runtime.Transcriber against transformers' WhisperForConditionalGeneration.

A tiny random Whisper WITH timestamp tokens is built offline (toolkit/testing/tiny_whisper.py, timestamps=True: 1501
timestamp tokens after <|notimestamps|>, max_initial_timestamp_index 50) and imported once for the module. Proofs:
language detection equals detect_language on features whose detected language varies; ids with the timestamp rules
equal generate(return_timestamps=True)'s first window (timestamps chosen, asserted), greedy on 16 inputs and beam 4
on 8; openai-whisper's cut of a window into segments and its seek; one encoder run a window (every fallback
temperature shares it); the command line decodes wav files as the API decodes their features (greedy; beam 4
slow); the formats; the errors. Slow: an exported bundle transcribes as the checkpoint, one encoder session run a
window; long-form segments equal transformers' long-form generate's (seek by the last timestamp; a window past the
audio's end compared on transformers' zero padding, see the test). Not proven here: ids without timestamps against
generate (on this model, whose vocabulary has timestamp tokens, its plain return re-cuts ids at them, and
return_dict_in_generate with beams returns one row), and parity on audio clips (the tiny random model gives
synthesized clips one output: tests/test_whisper_speech.py has a model trained on speech).
"""

from __future__ import annotations

import json
import weakref
from dataclasses import replace

import numpy as np
import pytest
import torch
from click.testing import CliRunner

transformers = pytest.importorskip("transformers")
sf = pytest.importorskip("soundfile")

from runtime.audio import features_for  # noqa: E402
from runtime.generate import generate  # noqa: E402
from runtime.request import Request  # noqa: E402
from runtime.transcribe import Transcriber  # noqa: E402
from toolkit.apps.cli import main  # noqa: E402
from toolkit.reference.checkpoint import load_checkpoint  # noqa: E402
from toolkit.reference.torch_engine import TorchEngine  # noqa: E402
from toolkit.testing.tiny_whisper import random_whisper  # noqa: E402

INPUTS = 16
MAX_NEW = 12
CLIPS = 4


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    """(transformers model, features [16, 80, 3000], checkpoint dir, Transcriber on it, wav paths, root)."""
    root = tmp_path_factory.mktemp("transcribe")
    model, features = random_whisper(root / "tiny", inputs=INPUTS, timestamps=True)
    result = CliRunner().invoke(main, ["import", str(root / "tiny"), "--out", str(root / "ckpt")])
    assert result.exit_code == 0, result.output
    ckpt = load_checkpoint(root / "ckpt")
    return model, features, root / "ckpt", Transcriber.from_engine(TorchEngine(ckpt.model), ckpt.tokenizer), \
        clips(root), root


def clips(root) -> list:
    """CLIPS wav files of 16 kHz tones (each its own frequencies and loudness: a mel profile of its own) over noise."""
    rng, t, paths = np.random.default_rng(3), np.arange(16000 * 4) / 16000, []
    for i in range(CLIPS):
        tones = sum(rng.uniform(0.05, 0.4) * np.sin(2 * np.pi * rng.uniform(80, 7000) * t) for _ in range(6))
        audio = (tones + rng.normal(0, 0.02, t.shape)).astype(np.float32) / 3
        sf.write(root / f"clip{i}.wav", audio, 16000)
        paths.append(root / f"clip{i}.wav")
    return paths


def hf_ids(model, features, beams=1, **kw):
    """generate's sequences after the prompt [<|startoftranscript|>, <|en|>, <|transcribe|>, <|notimestamps|>] (the
    raw sequences, return_dict_in_generate: the plain return re-cuts ids at timestamp tokens), and the end id."""
    with torch.no_grad():
        out = model.generate(features, language="en", task="transcribe", max_new_tokens=MAX_NEW, num_beams=beams,
                             return_dict_in_generate=True, **kw)["sequences"].tolist()
    eos = model.generation_config.eos_token_id
    return [r[4:] for r in out], eos


def test_language_detection_equals_detect_language(whisper):
    model, features, _, tr, _, _ = whisper
    with torch.no_grad():
        want = model.detect_language(features).tolist()
    assert len(set(want)) == 3, want                                   # detection varies over the inputs
    got = tr.detect_language(features.numpy())
    assert [tr.tokenizer._ids([f"<|{code}|>"], "lang")[0] for code, _ in got] == want
    assert all(1 / 3 <= p <= 1 for _, p in got)


@pytest.mark.parametrize("beams,inputs", [(1, INPUTS), (4, 8)])
def test_timestamp_ids_equal_generate_return_timestamps(whisper, beams, inputs):
    """Greedy on 16 inputs, beam 4 on 8: the ids of each input's first 30 s window, timestamps included."""
    model, features, _, tr, _, _ = whisper
    features = features[:inputs]
    with torch.no_grad():
        out = model.generate(features, language="en", task="transcribe", return_timestamps=True, num_beams=beams,
                             max_new_tokens=MAX_NEW, return_segments=True)
    eos, prompt = model.generation_config.eos_token_id, tr.prompt("en", "transcribe", True)
    want = []
    for i in range(inputs):                                            # each input's first window's raw ids
        row = out["segments"][i][0]["result"].tolist()[1 + len(prompt):]
        want.append(row[: row.index(eos) + 1] if eos in row else row)
    assert len({tuple(r) for r in want}) >= max(4, inputs // 4), want
    stamps = [t for r in want for t in r if t >= tr.timestamp_begin]
    assert len(stamps) >= inputs and len(set(stamps)) >= 8            # timestamp tokens exist and are chosen
    opts = replace(tr.options(prompt, True, beams, max_new_tokens=MAX_NEW), prefix_ids=(tuple(prompt),) * inputs)
    hyps = generate(tr.engine, Request.build(tr.engine, list(features.numpy()), None, opts))
    assert [h[0].tokens[len(prompt):] for h in hyps] == want


def test_a_window_is_cut_at_timestamp_pairs_and_seeks_to_the_last():
    from types import SimpleNamespace

    from runtime.longform import segments_of

    tr, b = SimpleNamespace(timestamp_begin=1000), 1000
    pieces, seek = segments_of(tr, [b, 7, b + 10, b + 10, 8, b + 25, b + 25], 30.0, 3000)
    assert pieces == [(30.0, 30.2, [b, 7, b + 10]), (30.2, 30.5, [b + 10, 8, b + 25])] and seek == 50
    pieces, seek = segments_of(tr, [b, 7, b + 10, b + 10, 8, b + 25], 0.0, 3000)     # a lone last timestamp
    assert [p[:2] for p in pieces] == [(0.0, 0.2), (0.2, 0.5)] and seek == 3000
    assert segments_of(tr, [b, 7, 8, b + 40], 0.0, 1200) == ([(0.0, 0.8, [b, 7, 8, b + 40])], 1200)   # no pair
    assert segments_of(tr, [7, 8], 2.0, 1200) == ([(2.0, 14.0, [7, 8])], 1200)


def test_audio_past_30_s_goes_window_by_window(whisper):
    """A 45 s clip: two windows (0-30 s, 30-45 s) without timestamps, each decoded from its slice of the clip's
    log-mel; with timestamps, segments in order inside the clip (seek by the last timestamp)."""
    from runtime.longform import whole_mel

    _, _, _, tr, _, _ = whisper
    rng = np.random.default_rng(5)
    audio = (rng.normal(0, 0.1, 16000 * 45) * np.repeat(rng.uniform(0.2, 1.0, 45), 16000)).astype(np.float32)
    plain = dict(language="en", max_new_tokens=MAX_NEW, temperatures=(0.0,), no_speech_threshold=None)
    got = tr.transcribe(audio, **plain)
    assert [(s.start, s.end) for s in got.segments] == [(0.0, 30.0), (30.0, 45.0)] and got.duration == 45.0
    mel, _ = whole_mel(audio, 80)
    opts = tr.options(tr.prompt("en", "transcribe", False), False, max_new_tokens=MAX_NEW)
    assert [s.tokens for s in got.segments] == [tr.decode_window(mel[:, at:at + 3000], opts).tokens
                                                 for at in (0, 3000)]
    stamped = tr.transcribe(audio, timestamps=True, **plain).segments
    assert stamped and all(0 <= a.start <= a.end for a in stamped)
    assert all(a.start <= b.start for a, b in zip(stamped, stamped[1:])) and stamped[-1].start < 45.0



def hf_long_form(model, audio: np.ndarray, max_new: int) -> list[tuple]:
    """transformers' sequential long-form generate on the clip's log-mel (runtime.longform.whole_mel's, cut at the
    audio's frames), greedy: [(start s, end s, ids)], the end token dropped, and the timestamp transformers keeps
    after a window's last pair (its mark of "no lone ending"; openai-whisper's segment, and ours, end before it)."""
    from runtime.longform import whole_mel

    mel, content = whole_mel(audio, 80)
    with torch.no_grad():
        out = model.generate(torch.from_numpy(mel[None, :, :content]), attention_mask=torch.ones(1, content).long(),
                             language="en", task="transcribe", return_timestamps=True, return_segments=True,
                             condition_on_prev_tokens=False, temperature=0.0, max_new_tokens=max_new,
                             logprob_threshold=None, no_speech_threshold=None, compression_ratio_threshold=None)
    eos, begin = model.generation_config.eos_token_id, model.generation_config.no_timestamps_token_id + 1
    segments = []
    for s in out["segments"][0]:
        ids = [t for t in s["tokens"].tolist() if t != eos]
        segments.append((round(float(s["start"]), 3), round(float(s["end"]), 3),
                         ids[:-1] if len(ids) >= 2 and min(ids[-2:]) >= begin else ids))
    return segments


def test_long_form_segments_equal_transformers_long_form(whisper):
    """A 75 s clip, 10 new tokens a window (each window then ends inside a timestamp pair): windows start at the
    last timestamp (0, 25, 50 s), and every segment of the windows inside the clip equals transformers' long-form
    generate's. The last window runs past the audio: transformers pads its slice of the log-mel with 0.0,
    runtime.longform (as openai-whisper and faster-whisper do) with the log-mel of silence; decoded from
    transformers' padding, its segments are generate's, their times clamped into the audio (transformers' run past
    its end). A 60 s clip at 12 new tokens a window (each ends with a lone
    timestamp: the next window starts 30 s on) has only full windows: all its segments are equal."""
    from runtime.longform import segments_of, whole_mel

    model, _, _, tr, _, _ = whisper
    rng = np.random.default_rng(5)
    audio = (rng.normal(0, 0.1, 16000 * 75) * np.repeat(rng.uniform(0.2, 1.0, 75), 16000)).astype(np.float32)
    off = dict(temperatures=(0.0,), no_speech_threshold=None, logprob_threshold=None, compression_ratio_threshold=None)
    got = tr.transcribe(audio, language="en", timestamps=True, max_new_tokens=10, **off).segments
    want = hf_long_form(model, audio, 10)
    seeks = sorted({s.seek for s in got})
    assert len(seeks) >= 3 and any(at % 3000 for at in seeks), seeks          # seeks by the last timestamp
    assert len({tuple(s.tokens) for s in got}) >= 4, [s.tokens for s in got]   # the segments vary
    inside = [(s.start, s.end, s.tokens) for s in got if s.seek + 3000 <= 7500]
    assert len([at for at in seeks if at + 3000 > 7500]) == 1 and len(inside) >= 6, seeks   # one partial window
    assert inside == want[:len(inside)]
    mel, content = whole_mel(audio, 80)
    zero = np.pad(mel[:, seeks[-1]:content], ((0, 0), (0, seeks[-1] + 3000 - content)))
    opts = tr.options(tr.prompt("en", "transcribe", True), True, max_new_tokens=10)
    pieces, _ = segments_of(tr, tr.decode_window(zero, opts).tokens, seeks[-1] / 100, content - seeks[-1])
    clamped = [(min(a, 75.0), min(b, 75.0), ids) for a, b, ids in want[len(inside):]]   # ours end in the audio
    assert [(round(a, 3), round(b, 3), ids) for a, b, ids in pieces] == clamped
    full = audio[:16000 * 60]
    got = tr.transcribe(full, language="en", timestamps=True, max_new_tokens=MAX_NEW, **off).segments
    assert sorted({s.seek for s in got}) == [0, 3000]
    assert [(s.start, s.end, s.tokens) for s in got] == hf_long_form(model, full, MAX_NEW)

class EncoderRuns:
    """An engine counting its encoder runs (encode, and start without encoded=); shared=False hides encode, as
    an engine that cannot run its encoder alone (each decode then runs it: the old path)."""

    def __init__(self, engine, shared: bool):
        self.engine, self.shared, self.runs = engine, shared, 0

    def __getattr__(self, name):
        if name == "encode":
            raise AttributeError(name)
        return getattr(self.engine, name)

    @property
    def encode(self):
        if not self.shared:
            raise AttributeError("encode")                             # hasattr(engine, "encode") is then False
        return self.counted_encode

    def counted_encode(self, *args):
        self.runs += 1
        return self.engine.encode(*args)

    def start(self, *args, **kwargs):
        self.runs += kwargs.get("encoded") is None
        return self.engine.start(*args, **kwargs)


def test_each_window_runs_the_encoder_once(whisper):
    """A 45 s clip whose every decode falls back (logprob_threshold 0: three temperatures a window): the encoder
    runs once per window (first step and every temperature share it), and the transcription is the one each
    decode running its own encoder gives."""
    _, _, _, tr, _, _ = whisper
    rng = np.random.default_rng(6)
    audio = (rng.normal(0, 0.1, 16000 * 45) * np.repeat(rng.uniform(0.2, 1.0, 45), 16000)).astype(np.float32)
    kw = dict(language="en", max_new_tokens=MAX_NEW, temperatures=(0.0, 0.5, 1.0), logprob_threshold=0.0,
              no_speech_threshold=None)
    runs = {}
    for shared in (True, False):
        engine = EncoderRuns(tr.engine, shared)
        got = Transcriber.from_engine(engine, tr.tokenizer).transcribe(audio, **kw)
        runs[shared] = engine.runs, [(s.tokens, s.temperature) for s in got.segments]
    assert runs[False][0] == 2 * (1 + 3) and runs[True][0] == 2                 # two windows
    assert runs[True][1] == runs[False][1] and [t for _, t in runs[True][1]] == [1.0, 1.0]


class HeldOutputs(EncoderRuns):
    """An engine noting, at each encoder run, how many of the earlier runs' outputs (the cross K/V) are still alive."""

    def __init__(self, engine):
        super().__init__(engine, shared=True)
        self.refs, self.alive = [], []

    def counted_encode(self, *args):
        self.alive.append(sum(ref() is not None for ref in self.refs))
        outputs = super().counted_encode(*args)
        self.refs += [weakref.ref(t) for pair in outputs for t in (pair if isinstance(pair, tuple) else (pair,))]
        return outputs


def test_a_window_s_encoder_outputs_are_freed_before_the_next_window_s_run(whisper):
    """A 75 s clip, three windows: each encoder run starts with no earlier window's cross K/V alive (base's are 37
    MB a window, small's 111: the memory of two windows at once, benchmarks/RESULTS.md)."""
    _, _, _, tr, _, _ = whisper
    audio = (np.random.default_rng(7).normal(0, 0.1, 16000 * 75)).astype(np.float32)
    engine = HeldOutputs(tr.engine)
    Transcriber.from_engine(engine, tr.tokenizer).transcribe(audio, language="en", max_new_tokens=MAX_NEW,
                                                             temperatures=(0.0,), no_speech_threshold=None)
    assert engine.runs == 3 and engine.refs
    assert engine.alive == [0, 0, 0]


def cli_records(ckpt, paths, *flags):
    result = CliRunner().invoke(main, ["transcribe", str(ckpt), *map(str, paths), "--language", "en", "--format",
                                       "json", "--no-fallback", "--max-new-tokens", str(MAX_NEW), *flags])
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in result.stdout.splitlines()]


@pytest.mark.parametrize("beams", [1, pytest.param(4, marks=pytest.mark.slow)])
def test_cli_ids_are_the_apis(whisper, beams):
    """The command line decodes each file as runtime.Transcriber decodes its features (plumbing: the tiny random
    model gives these audio clips one output, so the parity of ids is the feature tests' above)."""
    _, _, ckpt, tr, paths, _ = whisper
    opts = tr.options(tr.prompt("en", "transcribe", False), False, beams, max_new_tokens=MAX_NEW)
    want = [tr.decode_window(features_for(p)[0], opts).tokens for p in paths]
    got = cli_records(ckpt, paths, "--beam", str(beams))
    assert [rec["segments"][0]["tokens"] for rec in got] == want
    assert [rec["text"] for rec in got] == [tr.text_of(r) for r in want]
    assert all(rec["language"] == "en" and rec["duration"] == 4.0 for rec in got)


def test_cli_detects_and_writes_formats(whisper, tmp_path):
    _, _, ckpt, tr, paths, _ = whisper
    for fmt, head in (("srt", "1\n00:00:"), ("vtt", "WEBVTT\n\n00:00:"), ("txt", "")):
        result = CliRunner().invoke(main, ["transcribe", str(ckpt), str(paths[0]), "--timestamps", "--format", fmt,
                                           "--no-fallback", "--max-new-tokens", str(MAX_NEW)])
        assert result.exit_code == 0, result.output
        assert result.stdout.startswith(head), result.stdout
    result = CliRunner().invoke(main, ["transcribe", str(ckpt), *map(str, paths[:2]), "--format", "vtt",
                                       "--timestamps", "--no-fallback", "--max-new-tokens", str(MAX_NEW),
                                       "--out", str(tmp_path / "subs")])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "subs").iterdir()) == ["clip0.vtt", "clip1.vtt", "transcribe.json"]
    again = CliRunner().invoke(main, ["transcribe", str(ckpt), str(paths[0]), "--out", str(tmp_path / "subs")])
    assert again.exit_code == 2                                        # not replaced without --force
    detected = tr.transcribe(paths[0], timestamps=True, max_new_tokens=MAX_NEW, temperatures=(0.0,),
                             no_speech_threshold=None)
    want = tr.detect_language(features_for(paths[0]))[0]
    assert (detected.language, detected.language_probability) == want
    assert detected.segments and all(s.end >= s.start for s in detected.segments)


def test_errors_are_one_line(whisper, tmp_path):
    _, _, ckpt, _, paths, _ = whisper
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"not audio at all")
    for args, message in (([str(ckpt), str(bad)], "cannot be read as audio"),
                          ([str(ckpt), str(tmp_path / "absent.wav")], "is missing"),
                          ([str(ckpt), str(paths[0]), "--language", "xx"], "give the audio's language")):
        result = CliRunner().invoke(main, ["transcribe", *args])
        assert result.exit_code == 2 and message in result.stderr, result.output
        assert len(result.stderr.strip().splitlines()) == 1
    result = CliRunner().invoke(main, ["init", "--out", str(tmp_path / "text")])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(main, ["transcribe", str(tmp_path / "text"), str(paths[0])])
    assert result.exit_code == 2 and "is not a Whisper model" in result.stderr, result.output


@pytest.mark.slow
def test_an_exported_bundle_transcribes_as_the_checkpoint(whisper):
    _, _, ckpt, _, paths, root = whisper
    result = CliRunner().invoke(main, ["export", str(ckpt), "--out", str(root / "fp32")])
    assert result.exit_code == 0, result.output
    def ids(model):                                                    # scores differ by float rounding only
        return [[(s["start"], s["end"], s["tokens"], s["text"]) for s in rec["segments"]]
                for rec in cli_records(model, paths, "--timestamps")]

    want = ids(ckpt)
    assert ids(root / "fp32") == want and all(want)
    bundle = Transcriber(root / "fp32", provider="cpu")
    runs = SessionRuns(bundle.engine.encoder)
    bundle.engine.encoder = runs
    got = bundle.transcribe(paths[1], language="en", max_new_tokens=MAX_NEW, temperatures=(0.0, 0.5),
                            logprob_threshold=0.0, no_speech_threshold=None)     # every window falls back
    assert runs.runs == 1 and got.segments[0].temperature == 0.5                # one window: one encoder run
    assert bundle.transcribe(paths[1], language="en", max_new_tokens=MAX_NEW, temperatures=(0.0,),
                             no_speech_threshold=None).segments[0].tokens == \
        cli_records(ckpt, paths[1:2])[0]["segments"][0]["tokens"]


class SessionRuns:
    """An ONNX Runtime session counting its runs (plain and IO-bound)."""

    def __init__(self, session):
        self.session, self.runs = session, 0

    def __getattr__(self, name):
        return getattr(self.session, name)

    def run(self, *args, **kwargs):
        self.runs += 1
        return self.session.run(*args, **kwargs)

    def run_with_iobinding(self, *args, **kwargs):
        self.runs += 1
        return self.session.run_with_iobinding(*args, **kwargs)
