"""Continuous batching at step granularity: one decode thread, static-shape decode engines, slots that rows fill
and free between steps.

A `tracelock.decode.engine.DecodeEngine` runs one decode setting for a fixed set of slots; a row decodes in it
exactly as `fused_generate` decodes its prompt alone. The scheduler keeps one engine (a *lane*) per decode setting
and prompt bucket in use (`DecodeSetting`: policy, generation length, temperature, seed; `lane_bucket`), and one
thread steps them all:

1. take new requests and cancellations from the event loop (a lock and a condition, nothing else is shared);
2. admit waiting requests, oldest first, into a free slot of their lane while fewer than ``max_batch`` rows run in
   all lanes together (``--max-batch`` is a total: the lanes share one device, its memory and its step time);
3. step every lane that has rows, once; a row whose answer is final (done decoding, a stop string, more than
   ``max_tokens`` committed) leaves its slot at once, and a cancelled one (its client went away) before the step.

Results go back to each request's asyncio queue with ``loop.call_soon_threadsafe``, so the event loop never waits
for a step. Lanes without rows are kept for reuse (their graphs and buffers) up to ``max_engines``; beyond it the
least recently used idle lane is dropped.

Engines are built per shape, not per request: a sampled setting (``temperature > 0``, a seed of its own) takes an
idle engine of the same shape (policy, generation length, temperature, prompt bucket) and restarts its generator
from its own seed, which decodes exactly as a fresh engine would. Building an engine for each sampled request, and
dropping others to make room, grew the server's memory without bound (docs/serving.md, the soak test): an engine
refers to itself through its step functions, so a dropped one is freed only by Python's cyclic collector, and a
full collection came about once per hundred thousand surviving objects. A dropped engine is now collected at
once, and the objects made before serving (the modules, the model, the tokenizer) are frozen out of the collector
when the decode thread starts, so a full collection looks only at what serving made (about 12,000 objects in the
soak instead of 370,000; a full collection of the latter took half a second on the 2-core test machine).

Limits and faults:
- `submit` refuses a request (returns False) while ``max_batch + max_waiting`` requests are already in the server,
  so a flood is answered at once (429 with a retry hint) instead of waiting without bound.
- A step that raises cannot say which row made it fail, so its lane is dropped and each of its rows starts again
  alone, in a one-slot lane of its own (greedy rows decode the same tokens again; a stream's text already sent is
  not sent twice). A row that fails alone is answered with an error; the other rows, and every other lane, go on.
  A failure in one row's own bookkeeping (its text, its result) fails that row only.
"""

import dataclasses
import gc
import math
import threading
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from tracelock.serve.config import DecodeSetting, ServedPolicy
from tracelock.serve.memory import release_free_memory
from tracelock.serve.protocol import APIError
from tracelock.serve.stream import Answer, TextStream


def lane_bucket(prompt_len: int, gen_length: int, max_positions: int) -> int:
    """The prompt bucket of a request's lane: its length rounded up to a power of two (at least 32), then to the
    engine's own bucket (`prompt_bucket`), at most what fits beside ``gen_length``. Coarser than the engine's buckets
    (multiples of 16 up to 128) on purpose: prompts of mixed lengths then share an engine and its batch, which saves
    more steps than the extra padding costs."""
    from tracelock.decode.engine import prompt_bucket

    room = max_positions - gen_length
    return prompt_bucket(min(max(32, 1 << (prompt_len - 1).bit_length()), max(room, prompt_len)), gen_length,
                         max_positions)


@dataclass
class Result:
    """What a finished request returns: its answer and what decoding it cost."""

    answer: Answer
    prompt_tokens: int
    gen_length: int
    steps: int


@dataclass
class Submission:
    """One request as the scheduler sees it. ``emit`` is called from the decode thread with ("delta", text),
    ("done", Result) or ("error", APIError); it must be thread-safe (the app passes ``call_soon_threadsafe``)."""

    prompt: list
    setting: DecodeSetting
    policy: ServedPolicy
    max_tokens: int
    stops: list
    stream: bool
    emit: object
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    lane: object = None
    slot: int | None = None
    text: TextStream | None = None
    alone: bool = False  # decode in a one-slot lane of its own (its lane's step raised: find the failing row)

    @property
    def watches_prefix(self) -> bool:
        """Whether the row's committed prefix is read after every step: to stream it, or to end the row early at a
        stop string or at max_tokens."""
        return self.stream or bool(self.stops) or self.max_tokens < self.setting.gen_length


class Lane:
    """One decode engine and the submissions in its slots."""

    def __init__(self, engine, key):
        self.engine, self.key = engine, key
        self.rows = {}  # slot -> Submission

    @property
    def shape(self):
        """What its engine is built for: the setting without the seed (set when the engine restarts), the prompt
        bucket; None for a lane of one row (``alone``), which is never reused."""
        return None if len(self.key) == 3 else (dataclasses.replace(self.key[0], seed=0), self.key[1])


class Scheduler:
    """See the module docstring.

    Args:
        model, tokenizer: the served backbone and its tokenizer.
        max_batch (int): rows decoding at once, over all lanes.
        metrics (tracelock.serve.metrics.Metrics): updated by the decode thread.
        controller, l2p: TraceLock's controller folder and Learn2PD's filters, for those policies.
        compile (bool | str): `DecodeEngine`'s ``compile``: False, True (torch.compile) or "cudagraphs".
        max_engines (int): lanes kept at most (idle ones are dropped first). Default: 8.
        max_waiting (int): requests that may wait for a slot beyond the ``max_batch`` decoding; more are refused
            by `submit`. Default: 256.
    """

    def __init__(self, model, tokenizer, *, max_batch, metrics, controller=None, l2p=None, compile=False,
                 max_engines=8, max_waiting=256):
        self.model, self.tokenizer, self.max_batch, self.metrics = model, tokenizer, max_batch, metrics
        self.controller, self.l2p, self.compile, self.max_engines = controller, l2p, compile, max_engines
        self.max_waiting = max_waiting
        self._cv = threading.Condition()
        self._inbox, self._cancels, self._stopping = [], [], False
        self._in_server = 0  # accepted requests not yet answered or dropped (under _cv)
        self._departures = deque(maxlen=32)  # time.monotonic() of the last requests to leave, for the retry hint
        self._waiting = deque()
        self._lanes = OrderedDict()  # (setting, prompt bucket) -> Lane, least recently used first
        self._dropped = False  # a lane was dropped since the last collection (see _collect)
        self._thread = None
        self.error = None  # the exception that stopped the decode thread, if any

    # ---- the event loop's side (thread-safe) -----------------------------------------------------------------

    def start(self) -> None:
        # what exists now lives as long as the server: out of the cyclic collector's way (see the module docstring)
        gc.collect()
        gc.freeze()
        self._thread = threading.Thread(target=self._run, name="tracelock-decode", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join()
            gc.unfreeze()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, sub: Submission) -> bool:
        """Queue a request; False (and nothing queued) when ``max_batch + max_waiting`` requests are already in."""
        sub.text = TextStream(self.tokenizer, sub.max_tokens, sub.stops)
        with self._cv:
            if self._in_server >= self.max_batch + self.max_waiting:
                return False
            self._in_server += 1
            self._inbox.append(sub)
            self._cv.notify()
        return True

    def retry_after(self) -> int:
        """Seconds a refused client should wait: about when the next request leaves the server and frees a place
        (the mean gap between the last departures), at least 1 and at most 60."""
        with self._cv:
            times = list(self._departures)
        if len(times) < 2:
            return 1
        gap = (max(times[-1], time.monotonic()) - times[0]) / (len(times) - 1)
        return min(60, max(1, math.ceil(gap)))

    def _left(self) -> None:
        """A request is out of the server (answered, failed or dropped): count it out once."""
        with self._cv:
            self._in_server -= 1
            self._departures.append(time.monotonic())

    def _fail(self, sub: Submission, error: APIError) -> None:
        self._left()
        sub.emit(("error", error))

    def cancel(self, sub: Submission) -> None:
        """Drop a request (its client went away): it leaves its slot, or the queue, before the next step."""
        with self._cv:
            self._cancels.append(sub)
            self._cv.notify()

    # ---- the decode thread -----------------------------------------------------------------------------------

    def _running(self) -> int:
        return sum(len(lane.rows) for lane in self._lanes.values())

    def _has_work(self) -> bool:
        """Anything for the decode thread to do (under the lock): a stop, new or cancelled requests, rows running or
        waiting."""
        return bool(self._stopping or self._inbox or self._cancels or self._running() or self._waiting)

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    # waiting rows with none running: rows a failed step sent back (see _isolate)
                    if not self._has_work():
                        release_free_memory()  # going idle: return the freed heap pages
                    while not self._has_work():
                        self._cv.wait()
                    if self._stopping:
                        break
                    inbox, self._inbox = self._inbox, []
                    cancels, self._cancels = self._cancels, []
                self._waiting.extend(inbox)
                for sub in cancels:
                    self._drop(sub)
                self._admit()
                for lane in list(self._lanes.values()):
                    if lane.rows:
                        self._step(lane)
                    if len(lane.key) == 3 and not lane.rows and lane.key in self._lanes:  # a row's own lane: done
                        self._drop_lane(lane.key)
                self._collect()
                self.metrics.set_batch(self._running(), len(self._waiting), len(self._lanes))
        except BaseException as err:  # the thread is gone: say so to every request and to /health
            self.error = err
            for sub in [*self._waiting, *(s for lane in self._lanes.values() for s in lane.rows.values())]:
                sub.emit(("error", APIError(500, f"the decode thread stopped: {err!r}", type="server_error")))
            raise

    def _drop_lane(self, key) -> None:
        del self._lanes[key]
        self._dropped = True

    def _collect(self) -> None:
        """Free the engines of the lanes dropped since the last call now: each refers to itself through its step
        functions, so only the cyclic collector frees it."""
        if self._dropped:
            self._dropped = False
            gc.collect()

    def _lane(self, sub: Submission):
        """The lane of a submission's setting and prompt bucket: its own, else an idle lane of the same shape (a
        sampled setting of another seed) taken over, else a new one (dropping the least recently used idle lane when
        at ``max_engines``); None when every lane is busy and no other may be made."""
        from tracelock.decode.engine import DecodeEngine
        from tracelock.eval.runner import PolicySpec, build_policy

        setting = sub.setting
        bucket = lane_bucket(len(sub.prompt), setting.gen_length, self.model.spec.max_positions)
        key = (setting, bucket, sub.id) if sub.alone else (setting, bucket)
        if key in self._lanes:
            self._lanes.move_to_end(key)
            return self._lanes[key]
        if not sub.alone:
            shape = (dataclasses.replace(setting, seed=0), bucket)
            same = next((lane for lane in self._lanes.values() if not lane.rows and lane.shape == shape), None)
            if same is not None:  # restarted from this setting's seed when its first row comes in (_admit)
                del self._lanes[same.key]
                same.key = key
                self._lanes[key] = same
                return same
        if len(self._lanes) >= self.max_engines:
            idle = next((k for k, lane in self._lanes.items() if not lane.rows), None)
            if idle is None:
                return None
            self._drop_lane(idle)
        served = sub.policy
        # a policy object per engine: an engine sets it up for its own generation length
        args = served.policy_args(setting.gen_length)
        policy = build_policy(PolicySpec(served.label, served.name, args), self.model, controller=self.controller,
                              l2p=self.l2p)
        engine = DecodeEngine(self.model, policy=policy, gen_length=setting.gen_length,
                              slots=1 if sub.alone else self.max_batch, prompt_len=bucket,
                              temperature=setting.temperature, seed=setting.seed, top_p=setting.top_p,
                              top_k=setting.top_k, compile=self.compile,
                              **served.decode)
        self.metrics.inc("engines_built_total")
        self._lanes[key] = Lane(engine, key)
        return self._lanes[key]

    def _admit(self) -> None:
        """Waiting requests into free slots, oldest first, while fewer than max_batch rows run; a request whose
        lane cannot be made yet waits without holding up the ones behind it."""
        running, kept = self._running(), deque()
        while self._waiting:
            sub = self._waiting.popleft()
            try:
                lane = self._lane(sub) if running < self.max_batch else None
            except Exception as err:  # an engine or policy that cannot be built fails its request, not the thread
                self._fail(sub, APIError(500, f"cannot decode this request: {err}", type="server_error"))
                continue
            if lane is None:
                kept.append(sub)
                continue
            if not lane.rows:  # an idle engine starts afresh: a sampled request alone draws as it did before
                lane.engine.reset()
                # from its setting's seed: the engine may have been built for another (a lane of the same shape)
                if lane.engine.context.generator is not None:  # a deterministic engine draws nothing
                    lane.engine.context.generator.manual_seed(lane.key[0].seed)
            try:
                sub.slot = lane.engine.admit(sub.prompt)
            except ValueError as err:  # the handler checks prompts first; this is the engine's word on the rest
                self._fail(sub, APIError(400, str(err), "prompt"))
                continue
            sub.lane = lane
            lane.rows[sub.slot] = sub
            running += 1
        self._waiting = kept

    def _drop(self, sub: Submission) -> None:
        if sub.lane is not None and sub.lane.rows.get(sub.slot) is sub:
            sub.lane.engine.release(sub.slot)
            del sub.lane.rows[sub.slot]
            self._left()
        elif sub in self._waiting:
            self._waiting.remove(sub)
            self._left()

    def _step(self, lane: Lane) -> None:
        engine = lane.engine
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            engine.step()
            finished = set(engine.finished_slots())  # one device read for every slot
        except Exception as err:  # e.g. a policy that stopped committing, on one row or on all of them
            self._isolate(lane, err)
            return
        self.metrics.observe_step(time.perf_counter() - start, len(lane.rows), time.thread_time() - cpu)
        for slot, sub in list(lane.rows.items()):
            try:
                if slot in finished:
                    self._finish(lane, slot, sub)
                elif sub.watches_prefix:
                    delta = sub.text.update(engine.prefix(slot))
                    if delta and sub.stream:
                        sub.emit(("delta", delta))
                    if sub.text.answer is not None:  # a stop string, or past max_tokens: leave the batch now
                        self._finish(lane, slot, sub)
            except Exception as err:  # this row's own text or result: it fails alone
                if lane.rows.get(slot) is sub:
                    engine.release(slot)
                    del lane.rows[slot]
                self._fail(sub, APIError(500, f"decoding failed: {err!r}", type="server_error"))

    def _isolate(self, lane: Lane, err: Exception) -> None:
        """A lane's step raised: drop the lane (its state may be half-updated); a row that was alone is answered
        with the error, the others start again, each alone, ahead of the waiting requests."""
        self.metrics.inc("step_failures_total")
        self._drop_lane(lane.key)
        rows = [lane.rows[slot] for slot in sorted(lane.rows)]
        lane.rows.clear()
        for sub in reversed(rows):
            sub.lane = sub.slot = None
            if sub.alone or len(rows) == 1:
                self._fail(sub, APIError(500, f"decoding failed: {err!r}", type="server_error"))
            else:
                sub.alone = True
                self._waiting.appendleft(sub)

    def _finish(self, lane: Lane, slot: int, sub: Submission) -> None:
        from tracelock.text import answer_ids

        tokens, stats = lane.engine.result(slot)
        lane.engine.release(slot)
        del lane.rows[slot]
        if sub.text.answer is None:
            generated = tokens[0, len(sub.prompt):].tolist()
            answer = answer_ids(generated, self.model.spec.end_ids)
            delta = sub.text.update(answer, complete=True, ended=len(answer) < len(generated))
            if delta and sub.stream:
                sub.emit(("delta", delta))
        answer = sub.text.answer
        self.metrics.inc("prompt_tokens_total", len(sub.prompt))
        self.metrics.inc("generated_tokens_total", len(answer.token_ids))
        self._left()
        sub.emit(("done", Result(answer, len(sub.prompt), sub.setting.gen_length, stats.steps[0])))
