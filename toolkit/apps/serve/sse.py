"""Server-sent events: the answer to a POST /v1/generate with "stream": true (greedy or sampling, num_return 1).

    HTTP/1.1 200 OK
    Content-Type: text/event-stream

    data: {"index": 0, "ids": [17], "text": "Mon"}       input 0's new token and the text it makes final
    data: {"index": 1, "ids": [23], "text": ""}          ("" while a word or a character is incomplete; null when
    ...                                                   the model has no tokenizer)
    data: {"index": 0, "ids": [], "text": "day"}         the rest of an input's text, once decoding is over
    data: {"final": true, "outputs": [...], "queue_ms": 1.2, "total_ms": 35.0}   the unstreamed answer

The scheduler's decoding thread hands each token a streamed job's rows choose to the job (Job.on_tokens, greedy or
sampling, request-level or in-flight); `Tokens` moves it onto the event loop (call_soon_threadsafe: in order, and
the job's end after its last token), and `events` turns it into an event whose text piece comes from one
runtime.stream.Detokenizer per input, so an input's ids joined are its output's `ids` and its pieces joined its
`text`. The end token is no id (outputs leave it out). A client that goes away cancels its job: its rows leave the
batch at the next step. An engine failure ends the stream with {"final": true, "error": "..."}.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from runtime.stream import Detokenizer

MEDIA_TYPE = "text/event-stream"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}     # proxies pass each event on at once


class Tokens:
    """A streamed job's tokens, from the decoding thread to the event loop in the order they were chosen; None
    follows the last (the job's future is done)."""

    def __init__(self, job, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()
        job.on_tokens = self.push
        job.future.add_done_callback(lambda _: self._put(None))

    def push(self, index: int, position: int, token: int) -> None:
        """The decoding thread: input `index`'s token at `position` of its output. Never raises."""
        self._put((index, position, token))

    def _put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:                                     # the loop is closed: nobody listens any more
            pass


def event(data: dict) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


async def events(tokens: Tokens, inputs: int, tokenizer, eos: int, finish: Callable[[], dict],
                 cancel: Callable[[], None]) -> AsyncIterator[bytes]:
    """The event stream of a job with `inputs` inputs: a piece per chosen token, the rest of each text, then
    {"final": true, **finish()} once its future is done. Left before that (the client went away): cancel()."""
    detoks = [Detokenizer(tokenizer, eos) if tokenizer is not None else None for _ in range(inputs)]
    sent = [0] * inputs
    done = False
    try:
        while (item := await tokens.queue.get()) is not None:
            i, position, token = item
            if position < sent[i]:                               # a batch decoded again gives the same tokens again
                continue
            sent[i] = position + 1
            ids = [] if token == eos else [int(token)]
            piece = detoks[i].push(token) if detoks[i] is not None else None
            if ids or piece:
                yield event({"index": i, "ids": ids, "text": piece})
        for i, detok in enumerate(detoks):
            rest = detok.flush() if detok is not None else ""
            if rest:
                yield event({"index": i, "ids": [], "text": rest})
        done = True
        yield event({"final": True, **finish()})
    finally:
        if not done:
            cancel()


__all__ = ["Tokens", "events", "event", "MEDIA_TYPE", "HEADERS"]
