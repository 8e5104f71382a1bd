"""optimize --gate-audio FILES|DIR: an audio bundle's gate judged on the given clips' log-mel features (the speech
proof, on a trained tiny Whisper, is tests/test_whisper_speech.py, slow); here the reading and the refusals."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

sf = pytest.importorskip("soundfile")
pytest.importorskip("soxr")

from runtime.errors import AudioError, InputError  # noqa: E402
from toolkit.apps.cli import main  # noqa: E402
from toolkit.parity.inputs import audio_files, audio_inputs  # noqa: E402
from toolkit.reference.config import preset  # noqa: E402

AUDIO = preset("tiny", encoder_input="features")


def tone(path, hz: float, seconds: float, rate: int = 16000):
    t = np.arange(int(seconds * rate)) / rate
    sf.write(path, (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32), rate)
    return path


@pytest.fixture
def clips(tmp_path):
    folder = tmp_path / "clips"
    folder.mkdir()
    tone(folder / "b.wav", 440, 0.5)
    tone(folder / "a.flac", 880, 1.0, rate=22050)
    (folder / "notes.txt").write_text("not audio")
    (folder / "sub").mkdir()
    tone(folder / "sub" / "c.wav", 220, 0.3)
    return folder


def test_a_directory_gives_its_audio_files_by_name(clips):
    assert [p.name for p in audio_files([clips])] == ["a.flac", "b.wav"]          # not notes.txt, not sub/
    assert [p.name for p in audio_files([clips / "sub" / "c.wav", clips])] == ["c.wav", "a.flac", "b.wav"]


def test_the_clips_features_are_the_gates_inputs(clips):
    from runtime.audio import features_for

    inputs = audio_inputs(AUDIO, [clips], samples=100)
    assert inputs.representative and inputs.note is None
    assert inputs.source == "2 given audio clips' log-mel features"
    assert [x.shape for x in inputs.seqs] == [(80, 3000)] * 2
    np.testing.assert_array_equal(inputs.seqs[1], features_for(clips / "b.wav")[0])
    assert not np.array_equal(inputs.seqs[0], inputs.seqs[1])
    assert len(audio_inputs(AUDIO, [clips], samples=1).seqs) == 1                  # the first --samples


def test_bad_clips_are_refused_by_name(tmp_path, clips):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InputError, match=r"--gate-audio .*empty holds no audio files"):
        audio_inputs(AUDIO, [empty])
    (tmp_path / "broken.wav").write_bytes(b"RIFF not really a wave file")
    with pytest.raises(AudioError, match=r"^--gate-audio: .*broken\.wav cannot be read as audio"):
        audio_inputs(AUDIO, [tmp_path / "broken.wav"])
    with pytest.raises(InputError, match="is for an audio \\(Whisper\\) bundle, and this one reads text"):
        audio_inputs(preset("tiny"), [clips])
    with pytest.raises(InputError, match=r"^--audio .*empty holds no audio files"):       # parity's flag
        audio_inputs(AUDIO, [empty], option="--audio")
    with pytest.raises(InputError, match="--samples must be at least 1"):
        audio_inputs(AUDIO, [clips], samples=0)


def test_optimize_refuses_gate_audio_for_a_text_bundle(dates_bundle, clips, tmp_path):
    texts = tmp_path / "texts.txt"
    texts.write_text("12 March 2004\n")
    for extra, message in (([], "is for an audio (Whisper) bundle"),
                           (["--input", str(texts)], "--gate-audio and --input both give the gate's inputs")):
        out = tmp_path / "out"
        result = CliRunner().invoke(main, ["optimize", str(dates_bundle), "--out", str(out), "--gate-audio",
                                           str(clips), *extra])
        assert result.exit_code == 2, result.output
        assert message in result.output and "Traceback" not in result.output
        assert not out.exists()
