"""Streaming: the text of one output, piece by piece, as its tokens are generated (greedy or sampling).

    for piece in stream(bundle.engine, bundle.tokenizer, "text", SearchOptions(max_new_tokens=32)):
        print(piece, end="", flush=True)

The pieces joined are the text `generate` gives for the same input and options. Beam search is refused: it knows
its best hypothesis only at the end. A piece is sent once no later token can change it (`Detokenizer`).
"""

from __future__ import annotations

from collections.abc import Iterator

from runtime.errors import InputError
from runtime.generate import Engine, start_search
from runtime.request import Request
from runtime.search import GreedySearch, SearchOptions, start_token

PENDING = "\ufffd"                   # what a decoder gives for the bytes of a character not complete yet


class Detokenizer:
    """Incremental detokenization: push token ids one at a time, get the new text that is final.

    The whole text is decoded again at each token and what is new is sent, holding back
    - a trailing run of U+FFFD: byte-level pieces of a UTF-8 character whose later bytes are still to come;
    - for tokenizers that clean up spaces around punctuation (SentencePiece models as transformers decodes them:
      "word ." -> "word."), the text after the last space: a later token may remove that space, so pieces end at
      SentencePiece word boundaries.
    `flush()` gives the rest at the end. Decoding all the ids each time keeps the pieces equal to one decode.
    """

    def __init__(self, tokenizer, eos: int):
        self.tokenizer, self.eos = tokenizer, eos
        self.ids: list[int] = []
        self.sent = ""
        self.word_level = bool(getattr(tokenizer, "clean_up", False))

    def push(self, token: int) -> str:
        if token == self.eos:
            return ""
        self.ids.append(int(token))
        text = self.tokenizer.decode(self.ids).rstrip(PENDING)
        if self.word_level:
            text = text[: max(text.rfind(" "), 0)]
        return self._send(text)

    def flush(self) -> str:
        return self._send(self.tokenizer.decode(self.ids))

    def _send(self, text: str) -> str:
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        piece, self.sent = text[len(self.sent):], text
        return piece


def check_streamable(opts: SearchOptions) -> None:
    """Refuse options a stream cannot follow (InputError, one line): beam search, several outputs an input."""
    if opts.beam != 1:
        raise InputError(f"streaming sends tokens as they are chosen, but beam search (beam {opts.beam}) knows its "
                         f"best hypothesis only at the end; use beam 1 (greedy or sample)")
    if opts.num_return != 1:
        raise InputError(f"streaming sends one output per input; use num_return 1 (got {opts.num_return})")


def stream(engine: Engine, tokenizer, source: str | list[int], opts: SearchOptions) -> Iterator[str]:
    """Text pieces of the output for one input (text, or token ids) as the search generates it. The request is
    checked (and the encoder run) here, before the first piece is asked for."""
    check_streamable(opts)
    if tokenizer is None:
        raise InputError("streaming sends text, but this model has no tokenizer (tokenizer.json); use generate")
    request = Request.build(engine, [source], tokenizer, opts)
    state, opts = start_search(engine, request), request.opts
    if state is None:                                                   # max_new_tokens 0: no text
        return iter(())
    search = GreedySearch(state, 1, start_token(opts, engine.bos_id), engine.eos_id, opts)
    return _pieces(search, Detokenizer(tokenizer, engine.eos_id))


def _pieces(search: GreedySearch, detok: Detokenizer) -> Iterator[str]:
    for _, tokens in search.steps():
        piece = detok.push(int(tokens[0]))
        if piece:
            yield piece
    rest = detok.flush()
    if rest:
        yield rest
