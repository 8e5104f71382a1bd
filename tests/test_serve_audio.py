"""OpenAI's audio endpoints (toolkit/apps/serve/audio_routes.py), called with the official `openai` client unchanged.

A tiny random Whisper with timestamp tokens (toolkit/testing/tiny_whisper.py) is exported once for the module and
served beside the dates text model, behind API keys, on 127.0.0.1. Every answer is compared with what
runtime.Transcriber gives for the same file (its own sessions on the same bundle): text, segments, for each
response_format, for translations, a given language, a temperature and a prompt (which changes the answer). The
timestamped transcriptions (srt, vtt, verbose_json: segment times and tokens) vary by clip and by language
(asserted), though little: this random model's logits are nearly flat, so every window's average log-probability
(about -7) falls back to the last temperature, 1.0, whose seeded draw is nearly the same for every clip; the
timestamp rules make the difference. The plain ones
(json, text) are that same draw for every clip: held equal to the Transcriber's all the same, not proven on
outputs that vary.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
sf = pytest.importorskip("soundfile")
import httpx  # noqa: E402

from runtime import subtitles  # noqa: E402
from runtime.transcribe import Transcriber  # noqa: E402
from test_service import serving  # noqa: E402
from toolkit.apps.serve.app import ServeSettings, create_app  # noqa: E402
from toolkit.apps.serve.audio_routes import AudioRefusal, pick, schedule  # noqa: E402
from toolkit.apps.serve.keys import ApiKeys  # noqa: E402
from toolkit.apps.serve.models import ModelSet  # noqa: E402

SEEDS = (0, 1, 4)                                 # clips whose timestamped transcriptions differ (asserted)
CLIPS = len(SEEDS)
LIMIT = 400_000                                   # --max-audio-bytes of the test server: a 4 s clip fits, 20 s not
NAMES = {"en": "english", "de": "german", "fr": "french"}
KEYS = ("id", "seek", "start", "end", "text", "tokens", "temperature", "avg_logprob", "compression_ratio",
        "no_speech_prob")


def noise(path: Path, seconds: float, seed: int) -> Path:
    """A 16 kHz wav of noise under a random spectral envelope (24 knots over 0-8 kHz, log10 amplitude std 3)."""
    rng, n = np.random.default_rng(seed), int(16000 * seconds)
    spectrum, freqs = np.fft.rfft(rng.normal(size=n)), np.fft.rfftfreq(n, 1 / 16000)
    knots = np.linspace(0, 8000, 24)
    audio = np.fft.irfft(spectrum * 10 ** np.interp(freqs, knots, rng.normal(0, 3.0, knots.size)), n)
    sf.write(path, (audio / np.abs(audio).max() * 0.5).astype(np.float32), 16000, subtype="FLOAT")
    return path


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    """(the exported tiny Whisper bundle, a Transcriber on it, the clips)."""
    from exporters.export import export_checkpoint
    from toolkit.reference.importers import import_model
    from toolkit.testing.tiny_whisper import random_whisper

    root = tmp_path_factory.mktemp("serve_audio")
    random_whisper(root / "tiny", timestamps=True)
    bundle = export_checkpoint(import_model(root / "tiny", root / "ckpt"), root / "whisper")
    clips = [noise(root / f"clip{i}.wav", 4, seed) for i, seed in enumerate(SEEDS)]
    return bundle, Transcriber(bundle, provider="cpu"), clips


@pytest.fixture(scope="module")
def server(whisper, dates_bundle, tmp_path_factory):
    """The Whisper bundle and the dates text model in one server with keys: (base URL, an OpenAI client)."""
    keys = tmp_path_factory.mktemp("audio_keys") / "keys"
    keys.write_text("good-key\nslow-key rpm=1\n")
    settings = ServeSettings(provider="cpu", max_batch=4, max_wait_ms=2, max_audio_bytes=LIMIT)
    models = ModelSet.load({"whisper": whisper[0], "dates": dates_bundle}, settings)
    with serving(create_app(models, keys=ApiKeys.load(keys))) as url:
        yield url, openai.OpenAI(base_url=url + "/v1", api_key="good-key", max_retries=0, timeout=60)


def segments(result) -> list[dict]:
    return [{k: getattr(s, k) for k in KEYS} for s in result.segments]


def test_every_response_format_is_the_transcribers(whisper, server):
    _, tr, clips = whisper
    _, client = server
    plain = [tr.transcribe(c) for c in clips]
    stamped = [tr.transcribe(c, timestamps=True) for c in clips]
    assert len({json.dumps(segments(r)) for r in stamped}) == CLIPS      # outputs vary (module docstring)
    assert all(len(r.segments) >= 2 for r in stamped)                    # timestamps cut the windows
    for clip, want, want_stamped in zip(clips, plain, stamped):
        got = client.audio.transcriptions.create(file=clip.open("rb"), model="whisper-1")
        assert got.text == want.text                                      # any name: the lone speech model
        verbose = client.audio.transcriptions.create(file=clip.open("rb"), model="whisper", timestamp_granularities=[
            "segment"], response_format="verbose_json")
        assert (verbose.language, verbose.duration, verbose.text) == (NAMES[want_stamped.language], 4.0,
                                                                       want_stamped.text)
        assert [s.model_dump() for s in verbose.segments] == segments(want_stamped)
    for fmt, want in (("text", subtitles.txt(plain[0])), ("srt", subtitles.srt(stamped[0])),
                      ("vtt", subtitles.vtt(stamped[0]))):
        got = client.audio.transcriptions.create(file=clips[0].open("rb"), model="whisper-1", response_format=fmt)
        assert got == want, fmt


def test_translations_language_and_temperature_are_the_transcribers(whisper, server):
    _, tr, clips = whisper
    _, client = server
    want = tr.transcribe(clips[1], task="translate", timestamps=True)
    got = client.audio.translations.create(file=clips[1].open("rb"), model="whisper-1", response_format="verbose_json")
    assert (got.language, got.text) == ("english", want.text)
    assert [s.model_dump() for s in got.segments] == segments(want)
    given = client.audio.transcriptions.create(file=clips[2].open("rb"), model="whisper-1", language="de",
                                               response_format="verbose_json")
    detected, want = (tr.transcribe(clips[2], language=code, timestamps=True) for code in (None, "de"))
    assert detected.language != "de" and segments(want) != segments(detected)      # the language changes the output
    assert given.language == "german" and [s.model_dump() for s in given.segments] == segments(want)
    hot = client.audio.transcriptions.create(file=clips[0].open("rb"), model="whisper-1", temperature=0.9,
                                             response_format="verbose_json")
    want = tr.transcribe(clips[0], temperatures=(0.9,), timestamps=True)       # 0.9: no higher one to fall back to
    assert {s.temperature for s in hot.segments} == {0.9} and [s.model_dump() for s in hot.segments] == segments(want)


def test_prompt_is_openai_whispers_initial_prompt(whisper, server):
    """OpenAI's `prompt`: the Transcriber's initial_prompt (text before <|startofprev|>, never in the answer)."""
    _, tr, clips = whisper
    _, client = server
    text = "the lazy dog jumps"
    want = tr.transcribe(clips[0], timestamps=True, initial_prompt=text)
    assert segments(want) != segments(tr.transcribe(clips[0], timestamps=True))   # the prompt changes the output
    got = client.audio.transcriptions.create(file=clips[0].open("rb"), model="whisper-1", prompt=text,
                                             response_format="verbose_json")
    assert [s.model_dump() for s in got.segments] == segments(want) and got.text == want.text
    plain = client.audio.transcriptions.create(file=clips[0].open("rb"), model="whisper-1", prompt=text)
    assert plain.text == tr.transcribe(clips[0], initial_prompt=text).text


def error_of(exc_info) -> dict:
    return exc_info.value.body


def test_refusals_are_openai_errors(whisper, server, tmp_path):
    url, client = server
    clip = whisper[2][0]
    cases = [(dict(file=("talk.wav", b"not audio at all")), 400, "invalid_audio", "'talk.wav': 16 bytes of audio "
                                                                                  "cannot be read as audio"),
             (dict(file=("empty.wav", b"")), 400, "invalid_audio", "'empty.wav' is empty"),
             (dict(file=clip.open("rb"), model="dates"), 400, "model_not_speech", "model 'dates' is a text model"),
             (dict(file=clip.open("rb"), response_format="xml"), 400, "unsupported_response_format", "use one of"),
             (dict(file=clip.open("rb"), prompt="<|de|> hello"), 400, "invalid_request", "special token id"),
             (dict(file=clip.open("rb"), timestamp_granularities=["word"], response_format="verbose_json"), 400,
              "unsupported_granularity", "no word timestamps"),
             (dict(file=clip.open("rb"), language="xx"), 400, "invalid_request", "give the audio's language"),
             (dict(file=noise(tmp_path / "long.wav", 20, 1).open("rb")), 413, "file_too_large", f"limit of {LIMIT}")]
    for kwargs, status, code, message in cases:
        with pytest.raises(openai.APIStatusError) as refused:
            client.audio.transcriptions.create(**{"model": "whisper-1", **kwargs})
        error = error_of(refused)
        assert refused.value.status_code == status and error["code"] == code and message in error["message"], error
        assert error["type"] == "invalid_request_error" and set(error) == {"message", "type", "param", "code"}
    raw = httpx.post(url + "/v1/audio/translations", files={"file": clip.read_bytes()}, timeout=60,
                     data={"model": "whisper-1", "language": "en"}, headers={"Authorization": "Bearer good-key"})
    assert raw.status_code == 400 and raw.json()["error"]["param"] == "language"   # translations take no language


def test_keys_guard_the_audio_routes(whisper, server):
    url, _ = server
    clip = whisper[2][0]
    for key, error in (("wrong", openai.AuthenticationError), ("", openai.AuthenticationError)):
        bare = openai.OpenAI(base_url=url + "/v1", api_key=key or "unused", max_retries=0, timeout=60,
                             default_headers={} if key else {"Authorization": ""})
        with pytest.raises(error) as refused:
            bare.audio.transcriptions.create(file=clip.open("rb"), model="whisper-1")
        assert refused.value.body["code"] == "invalid_api_key" and "API key" in refused.value.body["message"]
    slow = openai.OpenAI(base_url=url + "/v1", api_key="slow-key", max_retries=0, timeout=60)
    assert slow.audio.transcriptions.create(file=clip.open("rb"), model="whisper-1", temperature=1.0).text
    with pytest.raises(openai.RateLimitError) as limited:
        slow.audio.transcriptions.create(file=clip.open("rb"), model="whisper-1")
    assert limited.value.body["code"] == "rate_limit_exceeded"
    assert 1 <= int(limited.value.response.headers["Retry-After"]) <= 60


def test_the_model_field_picks_a_speech_model():
    text, a, b = object(), SimpleNamespace(name="a"), SimpleNamespace(name="b")
    models = SimpleNamespace(models={"dates": text, "a": a, "b": b})
    assert pick(models, {"a": a}, "whisper-1") is a and pick(models, {"a": a, "b": b}, "b") is b
    for speech, name, status, message in (({}, "whisper-1", 404, "serves no speech model (it serves dates, a, b)"),
                                          ({"a": a, "b": b}, "whisper-1", 404, "the speech models served are: a, b"),
                                          ({"a": a}, "dates", 400, "'dates' is a text model")):
        with pytest.raises(AudioRefusal) as refused:
            pick(models, speech, name)
        assert refused.value.status == status and message in str(refused.value)


def test_temperature_is_openai_whispers_fallback_schedule():
    assert schedule(None) == (0.0, 0.2, 0.4, 0.6, 0.8, 1.0) and schedule("0.5") == (0.5, 0.7, 0.9)
    assert schedule("1") == (1.0,)
    for bad in ("hot", "1.5", "-0.1", "nan"):
        with pytest.raises(AudioRefusal, match="temperature must be a number from 0 to 1"):
            schedule(bad)


def test_a_speech_bundle_is_served_request_level(whisper):
    """Its audio requests decode on the audio worker: in-flight batching (ids rows) is refused by name, auto falls
    back (the static-cache int8 bundle of examples/whisper showed why: its in-flight warm-up fed ids)."""
    from toolkit.apps.serve.app import Service, ServeError

    with pytest.raises(ServeError, match="a speech \\(Whisper\\) model decodes its audio requests on its own worker"):
        Service.load(whisper[0], ServeSettings(provider="cpu", batching="inflight"))
    service = Service.load(whisper[0], ServeSettings(provider="cpu"))
    assert service.scheduler.kind == "request-level" and "speech" in service.scheduler.not_inflight
