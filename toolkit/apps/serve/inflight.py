"""In-flight (continuous) batching for the server: greedy and sampling requests join the running batch at the next step.

    scheduler = InflightScheduler(engine, max_batch=32, max_queue=256)   # same interface as Scheduler
    scheduler.start(); future = scheduler.submit(Job(request)); scheduler.stop()

One decoding thread drives a runtime.inflight.InflightBatch of max_batch slots. Before every step it admits
waiting greedy and sampling jobs, whatever their options (each row keeps its request's: InflightBatch.request_rows;
a sample takes a row), oldest first, while their rows fit in the free slots (the encoder runs for the joiners
only); after the step, rows that finished leave at once and a job whose rows are all done gets its answer, so a
short request never waits for a long one. Beam search jobs (and a job with more rows than the batch has slots)
keep request-level batching: when the oldest waiting job is one, admission stops until the running rows are done,
then its batch (equal batch keys) decodes as in Scheduler.

The guarantees are Scheduler's: the queue (waiting + decoding jobs) is bounded by max_queue, every accepted
job's future is resolved exactly once, a cancelled job that waits never runs, one that decodes gives up its rows
at the next step (their slots go to the next joiners), and stop() drains every accepted job first. A failure
fails only the jobs it can be traced to: the joiners when their encoder run fails, the rows' jobs when a step
gives them a non-finite logit (the other rows run the step again); anything else fails every live job. A streamed
job's rows hand it each new token after the step that chose it (Job.on_tokens), before its future is resolved.
"""

from __future__ import annotations

import time

from runtime.errors import NumericsError
from runtime.inflight import InflightBatch, answer, check_engine
from runtime.search import SearchOptions, rows_per_input
from toolkit.apps.serve.scheduler import Job, Scheduler, fail, warm_up_request


class InflightScheduler(Scheduler):
    """Scheduler whose greedy and sampling jobs decode in one in-flight batch (runtime/inflight.py)."""

    kind = "in-flight"

    def __init__(self, engine, max_batch: int = 32, max_wait_ms: float = 5.0, max_queue: int = 256, metrics=None):
        check_engine(engine)                                     # InputError (one line) where it cannot run
        super().__init__(engine, max_batch, max_wait_ms, max_queue, metrics)
        self.batch = InflightBatch(engine, slots=max_batch)
        self._rows: dict[Job, list] = {}                         # decoding in-flight jobs -> their rows
        self.steps = 0

    def in_flight(self, job: Job) -> bool:
        """Whether the job's rows decode in the in-flight batch (else: request-level): greedy search or sampling,
        with any decoding controls (each row keeps its own), in at most max_batch rows (a sample takes one)."""
        return job.opts.beam == 1 and self.rows_of(job) <= self.max_batch

    @staticmethod
    def rows_of(job: Job) -> int:
        return len(job.sequences) * rows_per_input(job.opts)

    def warm_up(self) -> None:
        """Request-level warm-up, then a few steps with every slot in use."""
        super().warm_up()
        warm = InflightBatch(self.engine, slots=self.max_batch, opts=SearchOptions(ignore_eos=True))
        request = warm_up_request(self.engine, self.max_batch, max_new_tokens=min(3, self.engine.max_len))
        warm.join(request.sequences, request.limits)
        while warm.live:
            warm.step()

    def cancel(self, job: Job) -> None:
        super().cancel(job)                                      # drops a waiting job; stops a beam batch's rows
        with self._cond:
            rows = self._rows.get(job)
        for row in rows or ():
            self.batch.stop(row)                                 # it leaves before the next step

    # --- the decoding thread ---

    def _admit(self) -> tuple[list[Job], list[Job] | None]:
        """Under the lock: greedy jobs that join now, or a beam batch to decode once no row is live (None: stop)."""
        with self._cond:
            while not self._pending and not self._rows and not self._stopping:
                self._cond.wait()
            if not self._pending and not self._rows:
                return [], None                                  # stopping, nothing left
            joining, free = [], self.batch.free
            for job in list(self._pending):
                if not self.in_flight(job):
                    break                                        # a request-level job waits its turn: none passes it
                if self.rows_of(job) > free:
                    break                                        # oldest first: later jobs wait behind it
                joining.append(job)
                free -= self.rows_of(job)
                self._pending.remove(job)
            beam = None
            if not joining and not self._rows and self._pending and not self.in_flight(self._pending[0]):
                first = self._pending[0]
                beam, rows = [], 0
                for job in list(self._pending):
                    if job.key() == first.key() and rows + len(job.sequences) <= self.max_batch:
                        beam.append(job)
                        rows += len(job.sequences)
                for job in beam:
                    self._pending.remove(job)
                self._running = list(beam)
            for job in joining:
                self._rows[job] = []
            self._running = list(self._rows) if beam is None else self._running
            self._gauge()
            return joining, beam or []

    def _loop(self) -> None:
        while True:
            joining, beam = self._admit()
            if beam is None:
                return
            if beam:
                try:
                    self._decode(beam)                           # request-level, as Scheduler
                finally:
                    with self._cond:
                        self._running = []
                continue
            try:
                self._join(joining)
            except Exception as exc:                             # their encoder run: the live rows are untouched
                self._drop(joining, exc, known=False)
            try:
                self._step()
            except Exception as exc:
                self._failed_step(exc)

    def _join(self, jobs: list[Job]) -> None:
        """Every admitted job's inputs join in one InflightBatch.join: one encoder run for all of them."""
        if not jobs:
            return
        now = time.monotonic()
        parts = [self.batch.request_rows(job.request) for job in jobs]     # each row with its request's options
        sequences, limits, controls = ([x for part in parts for x in part[i]] for i in range(3))
        keys = [(job, r) for job, part in zip(jobs, parts) for r in range(len(part[0]))]
        rows = iter(self.batch.join(sequences, limits, controls, keys, [job.opts.shortlist for job, _ in keys]))
        for job, part in zip(jobs, parts):
            job.started = now
            self._rows[job] = [next(rows) for _ in part[0]]
            for row in self._rows[job]:
                row.ignore_eos, row.forced_eos = job.opts.ignore_eos, bool(job.opts.forced_eos)
                if job.cancelled:
                    self.batch.stop(row)
            if self.metrics is not None:
                self.metrics.queue_wait.observe(now - job.arrived)
            self._finish_if_done(job)
        if self.metrics is not None:
            self.metrics.joined_rows.observe(len(sequences))

    def _step(self) -> None:
        if not self.batch.live:
            return
        if self.metrics is not None:
            self.metrics.batch_rows.observe(self.batch.live)
            self.metrics.active_rows.set(self.batch.live)
        streamed = [(row, len(row.tokens)) for row in self.batch.rows if row.key[0].on_tokens is not None]
        left = self.batch.step()
        self.steps += 1
        for row, before in streamed:                             # streamed jobs get each new token (not a stopped row)
            if len(row.tokens) > before:
                row.key[0].on_tokens(row.key[1], before, row.tokens[-1])
        self.batches = self.steps
        for job in {row.key[0] for row in left}:
            self._finish_if_done(job)
        if self.metrics is not None:
            self.metrics.active_rows.set(self.batch.live)

    def _finish_if_done(self, job: Job) -> None:
        rows = self._rows.get(job)
        if rows is None or any(r.limit > 0 and not r.left for r in rows):
            return
        with self._cond:
            del self._rows[job]
            self._running = list(self._rows)
        if not job.future.done():
            job.future.set_result(answer(rows, rows_per_input(job.opts)))

    def _failed_step(self, exc: Exception) -> None:
        """A step raised before any row moved on: fail the jobs of the rows that caused it (a NumericsError names
        them; the others run the step again) or, when that is not known, every live job on a fresh batch."""
        if isinstance(exc, NumericsError) and exc.rows:
            self._drop(list(dict.fromkeys(self.batch.rows[i].key[0] for i in exc.rows)), exc, known=True)
            for job in list(self._rows):                         # rows that left before the failed step
                self._finish_if_done(job)
            return
        with self._cond:
            jobs = list(self._rows)
        self._drop(jobs, exc, known=False)
        self.batch = InflightBatch(self.engine, slots=self.max_batch)    # a fresh batch for the next jobs

    def _drop(self, jobs: list[Job], exc: Exception, known: bool) -> None:
        """The jobs fail with `exc` (scheduler.fail) and give up their rows, which leave at the next step."""
        with self._cond:
            for job in jobs:
                for row in self._rows.pop(job, ()):
                    self.batch.stop(row)
            self._running = list(self._rows)
        fail(jobs, exc, known)


__all__ = ["InflightScheduler"]
