"""`onnxformer parity WHISPER_DIR CHECKPOINT` finishes where transformers' Whisper generate never does.

The precondition, built: a tiny random Whisper with timestamps whose first two ids after <|notimestamps|> are
<|0.00|> <|0.00|> for every input, its later ones varying (toolkit.testing.tiny_whisper.zero_pair_whisper; the
speech-trained tiny Whisper does the same on some held-out clips). On it WhisperForConditionalGeneration.generate
(transformers 5.25) runs its seek loop for a 30 s window, moves the seek to that pair's time, 0 frames, and decodes
the window again, forever: asserted by its own monitor_progress. The parity reference (toolkit.parity.
original_whisper.whisper_generate: transformers' search over the one window) returns, under a SIGALRM deadline so that
a loop that never ends fails the test instead of hanging the suite, and its greedy and beam-4 ids equal the imported
checkpoint's; the command line exits 0. Where generate's seek does end, the two references agree: see
tests/test_families_whisper.py.
"""

from __future__ import annotations


import pytest
import torch
from click.testing import CliRunner

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from runtime.generate import generate_ids  # noqa: E402
from runtime.search import SearchOptions  # noqa: E402
from runtime.speech import prompt_ids  # noqa: E402
from toolkit.apps.cli import main  # noqa: E402
from toolkit.parity.original_whisper import whisper_generate, whisper_prompt  # noqa: E402
from toolkit.reference.checkpoint import load_checkpoint  # noqa: E402
from toolkit.reference.torch_engine import TorchEngine  # noqa: E402
from toolkit.testing.tiny_whisper import zero_pair_whisper  # noqa: E402

from test_fuzz import no_hang as deadline  # noqa: E402 (TimeoutError after its seconds: a loop fails, never waits)

INPUTS = 8
MAX_NEW = 10
DEADLINE_S = 300            # far above a run's seconds on a loaded machine; a loop that never ends reaches it


@pytest.fixture(scope="module")
def stuck(tmp_path_factory):
    """(transformers model, its features [8, 80, 3000], the checkpoint `onnxformer import` wrote, source dir)."""
    root = tmp_path_factory.mktemp("whisper-zero-pair")
    model, features = zero_pair_whisper(root / "tiny", inputs=INPUTS)
    result = CliRunner().invoke(main, ["import", str(root / "tiny"), "--out", str(root / "ckpt")])
    assert result.exit_code == 0, result.output
    return model, features, load_checkpoint(root / "ckpt"), root / "tiny"


class Looped(Exception):
    pass


def test_the_precondition_generate_never_moves_its_seek(stuck):
    model, features, _, _ = stuck
    seeks = []

    def monitor(progress):                                   # [batch, 2]: seek, max_frames, once a pass
        seeks.append(progress[:, 0].tolist())
        if len(seeks) == 3:
            raise Looped

    with deadline(DEADLINE_S), torch.no_grad(), pytest.raises(Looped):
        model.generate(features[:1], language="en", task="transcribe", max_new_tokens=MAX_NEW,
                       monitor_progress=monitor)
    assert seeks == [[0], [0], [0]]                          # the same window, decoded again and again


@pytest.mark.parametrize("beams", [1, 4])
def test_the_reference_returns_and_equals_the_checkpoints_ids(stuck, beams):
    model, features, ckpt, _ = stuck
    stamp0 = model.generation_config.no_timestamps_token_id + 1                      # <|0.00|>
    prefix = tuple(prompt_ids(ckpt.tokenizer, "en"))
    with deadline(DEADLINE_S):
        ref = whisper_generate(model, features.numpy(), whisper_prompt(model.generation_config, "en"), beams, MAX_NEW)
    assert all(r[:2] == [stamp0, stamp0] for r in ref), ref                          # the pair, every input
    assert len({tuple(r) for r in ref}) >= 4, ref                                    # and outputs that vary
    opts = SearchOptions(max_new_tokens=MAX_NEW, beam=beams, prefix_ids=(prefix,) * len(features))
    got = [h[0].tokens[len(prefix):] for h in generate_ids(TorchEngine(ckpt.model), list(features.numpy()), opts)]
    assert got == ref


def test_onnxformer_parity_finishes_and_passes(stuck):
    _, _, ckpt, src = stuck
    with deadline(DEADLINE_S):
        result = CliRunner().invoke(main, ["parity", str(src), str(ckpt.path), "--samples", str(INPUTS),
                                           "--max-new-tokens", str(MAX_NEW)])
    assert result.exit_code == 0, result.output
    assert "parity with the original ok" in result.output, result.output
