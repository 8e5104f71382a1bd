"""Request-level batching: requests that arrive within max_wait decode together, on one decoding thread.

    scheduler = Scheduler(engine, max_batch=32, max_wait_ms=5, max_queue=256)
    scheduler.start()
    future = scheduler.submit(Job(request))             # a runtime.request.Request; Overloaded when the queue is full
    hypotheses = future.result()                        # list[list[Hypothesis]], one list per input
    scheduler.stop()                                    # finishes every accepted job, then the thread ends

The thread takes the oldest waiting job, waits until max_wait has passed since that job arrived or since the
engine became free, whichever is later (or until the batch is full: so the clients whose answers just went out
can come back into the next batch instead of the one after), and decodes it together with every waiting job
that can share its search (equal runtime.request batch keys: every search option equal, except a greedy input's
max_new_tokens, which each input keeps as its limit). A batch holds at most max_batch inputs. One batch runs at a
time: on a CPU the engine already uses every core, and the batch is where requests share the work.

Every submitted job's future is resolved exactly once: with its hypotheses, with an exception, or cancelled (the
client went away: `cancel`). Requests are validated before they are queued (runtime.request), so what fails in a
batch is the engine: where the inputs that caused it are known (a non-finite logit), only their jobs fail and the
others decode again; else every job of the batch fails, and when it shared the batch it learns only the error's
type (the message may quote another request's input). A cancelled job that is still waiting never runs; one that is
decoding gives up its rows at the next step (greedy) or when all its batch is cancelled (beam).

A streamed job (`on_tokens`, greedy or sampling) is handed each token of each of its inputs as it is chosen, with its
position in the output, on the decoding thread, before its future is resolved; a batch decoded again after another
job failed hands the same positions again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from runtime.errors import NumericsError
from runtime.generate import generate
from runtime.request import Request, merge, search_options

log = logging.getLogger("onnxformer.serve")


class Overloaded(Exception):
    """The queue is full: answer 503 and ask the client to retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class Stopped(Exception):
    """The scheduler is draining (the server is shutting down): no new jobs."""


class SharedFailure(Exception):
    """The engine failed on a batch several requests shared, for a reason no one request can be told apart by."""


@dataclass(eq=False)
class Job:
    """One validated request and the future its answer goes to."""

    request: Request
    arrived: float = field(default_factory=time.monotonic)
    future: Future = field(default_factory=Future)
    started: float | None = None                    # when its batch began decoding
    cancelled: bool = False
    on_tokens: Callable[[int, int, int], None] | None = None   # streamed: (input, position, token), each as chosen
    plan: Any = None                                # "split": the toolkit.apps.segment Plan joining its rows' records
    texts: list | None = None                       # ... into one per text of these
    _stop: tuple | None = None                      # (the running batch's stop array, this job's slice of it)

    @property
    def sequences(self) -> list[list[int]]:
        return self.request.sequences

    @property
    def opts(self):
        return self.request.opts

    def key(self) -> tuple:
        """Jobs with equal keys can decode in one search."""
        return self.request.batch_key


def culprits(jobs: list[Job], exc: Exception) -> list[Job] | None:
    """The jobs whose inputs caused `exc` (a NumericsError that names them), or None when that is not known."""
    inputs = (exc.inputs or ()) if isinstance(exc, NumericsError) else ()
    bad = [job for job in jobs if any(job._stop[1].start <= i < job._stop[1].stop for i in inputs)]
    return bad or None


def fail(jobs: list[Job], exc: Exception, known: bool = False) -> None:
    """Resolve the jobs' futures with `exc`. Where the cause is not `known` per job and several shared the batch,
    each gets only its type: its message may quote another request's input (the server's log has it)."""
    if not known and len(jobs) > 1:
        log.error("decoding a batch of %d requests failed: %s: %s", len(jobs), type(exc).__name__, exc)
        exc = SharedFailure(f"the engine failed on a batch this request shared with {len(jobs) - 1} other(s) "
                            f"({type(exc).__name__}); retry the request, and tell the server's operator if it "
                            f"fails again")
    for job in jobs:
        if not job.future.done():
            job.future.set_exception(exc)


class Scheduler:
    """A bounded queue of jobs and the thread that decodes them in batches (request-level batching)."""

    kind = "request-level"
    not_inflight: str | None = None      # serve's --batching auto fell back to this scheduler: why (the one line)

    def __init__(self, engine, max_batch: int = 32, max_wait_ms: float = 5.0, max_queue: int = 256, metrics=None):
        if max_batch < 1 or max_queue < 1 or max_wait_ms < 0:
            raise ValueError("max_batch and max_queue must be at least 1, max_wait_ms at least 0")
        self.engine, self.metrics = engine, metrics
        self.max_batch, self.max_wait, self.max_queue = max_batch, max_wait_ms / 1000.0, max_queue
        self._pending: deque[Job] = deque()
        self._running: list[Job] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._free_since = 0.0                      # when the last batch ended
        self._thread = threading.Thread(target=self._loop, name="onnxformer-scheduler", daemon=True)
        self.batches = 0

    # --- called from the server's threads ---

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> Future:
        with self._cond:
            if self._stopping:
                raise Stopped("the server is shutting down; send the request to another replica or retry later")
            if len(self._pending) + len(self._running) >= self.max_queue:
                raise Overloaded(f"the server's queue is full ({self.max_queue} requests); retry after a second")
            self._pending.append(job)
            self._gauge()
            self._cond.notify()
        return job.future

    def cancel(self, job: Job) -> None:
        """The client went away: drop the job if it waits, stop its rows if it decodes."""
        with self._cond:
            job.cancelled = True
            if job in self._pending:
                self._pending.remove(job)
                job.future.cancel()
                self._gauge()
            elif job._stop is not None:
                stop, rows = job._stop
                stop[rows] = True

    def stop(self, timeout: float | None = None) -> None:
        """Take no new jobs, finish the accepted ones, end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def depth(self) -> int:
        with self._cond:
            return len(self._pending)

    # --- the decoding thread ---

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(len(self._pending))

    def _next_batch(self) -> list[Job] | None:
        """The next jobs to decode together (None: stopping and nothing left)."""
        with self._cond:
            while True:
                while not self._pending and not self._stopping:
                    self._cond.wait()
                if not self._pending:
                    return None
                first = self._pending[0]
                key = first.key()
                deadline = max(first.arrived, self._free_since) + self.max_wait
                while not self._stopping and first in self._pending:
                    ready = sum(len(j.sequences) for j in self._pending if j.key() == key)
                    remaining = deadline - time.monotonic()
                    if ready >= self.max_batch or remaining <= 0:
                        break
                    self._cond.wait(remaining)
                if first not in self._pending:               # cancelled while we waited: start over
                    continue
                batch, rows = [], 0
                for job in list(self._pending):
                    if job.key() == key and rows + len(job.sequences) <= self.max_batch:
                        batch.append(job)
                        rows += len(job.sequences)
                for job in batch:
                    self._pending.remove(job)
                self._running = batch
                self._gauge()
                return batch

    def _loop(self) -> None:
        while (batch := self._next_batch()) is not None:
            try:
                self._decode(batch)
            finally:
                with self._cond:
                    self._running = []
                    self._free_since = time.monotonic()

    def _decode(self, batch: list[Job]) -> None:
        request = merge([job.request for job in batch])
        stop = np.zeros(len(request.sequences), dtype=bool)
        now, start = time.monotonic(), 0
        with self._cond:
            for job in batch:
                rows = slice(start, start + len(job.sequences))
                job._stop, job.started, start = (stop, rows), now, rows.stop
                stop[rows] = job.cancelled
        self.batches += 1
        if self.metrics is not None:
            self.metrics.batch_rows.observe(len(request.sequences))
            self.metrics.active_rows.set(len(request.sequences) * request.opts.beam)
            for job in batch:
                self.metrics.queue_wait.observe(now - job.arrived)
        try:
            hyps = generate(self.engine, request, stop, streamer(batch))
        except Exception as exc:
            bad = culprits(batch, exc)
            fail(bad or batch, exc, known=bad is not None)
            rest = [job for job in batch if bad is not None and job not in bad]
            return self._decode(rest) if rest else None     # the others decode again, without them
        finally:
            if self.metrics is not None:
                self.metrics.active_rows.set(0)
        for job in batch:
            rows = job._stop[1]
            job._stop = None
            if not job.future.done():
                job.future.set_result(hyps[rows])

    def warm_up(self) -> None:
        """Decode a few steps at batch 1 and at the full batch, so the first requests do not pay for first runs (a
        speech model at batch 1 only: its audio routes decode one 30 s window at a time)."""
        speech = getattr(self.engine, "feature_shape", None) is not None
        for rows in sorted({1} if speech else {1, self.max_batch}):
            generate(self.engine, warm_up_request(self.engine, rows, max_new_tokens=min(4, self.engine.max_len)))


def streamer(batch: list[Job]) -> Callable | None:
    """The on_step of a batch's search that hands each streamed job's tokens to it (None: nothing streams)."""
    if not any(job.on_tokens for job in batch):
        return None
    owner = [(job, i) for job in batch for i in range(len(job.sequences))]       # merged input -> (job, its input)

    def on_step(step: int, inputs, tokens) -> None:
        for b, token in zip(inputs.tolist(), tokens.tolist()):
            job, i = owner[b]
            if job.on_tokens is not None:
                job.on_tokens(i, step, token)
    return on_step


def warm_up_request(engine, rows: int, **options) -> Request:
    """`rows` inputs of 4 copies of one ordinary source id (not pad, BOS or EOS) with these search options; for a
    speech model (its encoder reads log-mel features), `rows` silent windows."""
    shape = getattr(engine, "feature_shape", None)
    if shape is not None:
        inputs = [np.zeros(shape, dtype=np.float32)] * rows
    else:
        token = min(engine.src_vocab_size - 1, max(engine.eos_id, engine.pad_id, engine.bos_id) + 1)
        inputs = [[token] * 4] * rows
    return Request.build(engine, inputs, None, search_options(engine, **options))
