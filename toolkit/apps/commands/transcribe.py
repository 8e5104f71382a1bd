"""onnxformer transcribe: speech to text with a Whisper bundle (ONNX Runtime) or checkpoint (PyTorch)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from runtime.session import PROVIDER_CHOICES
from runtime.subtitles import FORMATS
from toolkit.apps.commands._common import friendly

MARKER = "transcribe.json"          # what a --out directory of ours holds besides one file per audio


def out_name(audio: Path, fmt: str, taken: set[str]) -> str:
    """AUDIO's stem with the format's suffix, numbered where two audio files share a stem."""
    name, n = f"{audio.stem}.{fmt}", 1
    while name in taken:
        n += 1
        name = f"{audio.stem}-{n}.{fmt}"
    taken.add(name)
    return name


@click.command("transcribe")
@click.argument("model", type=click.Path(path_type=Path))
@click.argument("audio", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--language", help="the audio's language code (e.g. en), or auto to detect it [default: auto on "
              "multilingual models]")
@click.option("--task", type=click.Choice(["transcribe", "translate"]), default="transcribe", show_default=True,
              help="translate: into English")
@click.option("--timestamps", is_flag=True, help="segments with start and end times from the timestamp tokens")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="txt", show_default=True)
@click.option("--beam", default=1, show_default=True, help="beam width at temperature 0 (1 = greedy)")
@click.option("--max-new-tokens", type=int, help="most tokens per 30 s window [default: half the model's max_len]")
@click.option("--prompt", help="text the audio follows (names, spelling, style), given to the decoder before each "
              "clip's first 30 s window after <|startofprev|> (openai-whisper's initial_prompt); never in the output")
@click.option("--condition-on-previous-text/--no-condition-on-previous-text", default=False, show_default=True,
              help="give each window the text of the windows before it as its prompt (reset after a window decoded "
              "above temperature 0.5)")
@click.option("--carry-prompt", is_flag=True, help="put --prompt before every window's prompt, not only the first's "
              "(openai-whisper's carry_initial_prompt)")
@click.option("--no-fallback", is_flag=True, help="decode each window once at temperature 0 (no temperature "
              "fallback, no no-speech skip)")
@click.option("--out", type=click.Path(path_type=Path), help="write one file per AUDIO (STEM.FORMAT) into this "
              "directory instead of printing")
@click.option("--force", is_flag=True, help="replace an --out directory this command wrote")
@click.option("--provider", type=click.Choice(PROVIDER_CHOICES), default="auto", show_default=True)
@click.option("--threads", type=int, help="intra-op threads (default: the library's choice)")
@friendly
def command(model, audio, language, task, timestamps, fmt, beam, max_new_tokens, prompt, condition_on_previous_text,
            carry_prompt, no_fallback, out, force, provider, threads):
    """Transcribe (or translate into English) each AUDIO file (WAV, FLAC, OGG, MP3) with the Whisper MODEL (a
    bundle or a checkpoint). Prints each transcript (txt: its text; json: one record a line; srt, vtt: subtitles),
    or writes them into --out."""
    from runtime.errors import InputError
    from runtime.subtitles import write
    from runtime.transcribe import Transcriber

    if carry_prompt and prompt is None:
        raise InputError("--carry-prompt carries --prompt into every window; give --prompt too (or drop it)")
    from toolkit.apps.engines import open_model

    opened = open_model(model, provider=provider, threads=threads)
    transcriber = Transcriber.from_engine(opened.engine, opened.tokenizer, str(model))
    extra = dict(temperatures=(0.0,), compression_ratio_threshold=None, logprob_threshold=None,
                 no_speech_threshold=None) if no_fallback else {}
    extra.update(initial_prompt=prompt, condition_on_previous_text=condition_on_previous_text,
                 carry_initial_prompt=carry_prompt)
    results = [(path, transcriber.transcribe(path, language=language, task=task, timestamps=timestamps, beam=beam,
                                             max_new_tokens=max_new_tokens, **extra)) for path in audio]
    if out is None:
        for _, result in results:
            click.echo(write(result, fmt), nl=False)
        return
    from toolkit.reference.outdir import OutputKind, listed_files, staged_output

    kind = OutputKind("transcripts", listed_files(MARKER), "'onnxformer transcribe --out'")
    taken: set[str] = set()
    with staged_output(out, force, kind) as tmp:
        for path, result in results:
            (Path(tmp) / out_name(path, fmt, taken)).write_text(write(result, fmt), encoding="utf-8")
        (Path(tmp) / MARKER).write_text(json.dumps({"files": sorted(taken)}, indent=2) + "\n")
    click.echo(f"wrote {len(results)} transcript(s) to {out}", err=True)
