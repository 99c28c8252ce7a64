"""The engine's runner: the static buffers of a fixed set of rows and the graphs that step them (`DecodeEngine` is
the slot API over it; see tracelock/decode/engine.py for a step's three graphs).

Every tensor has a shape fixed per runner: ``slots`` rows, a canvas of ``prompt_len + gen_length`` positions, a
commit region of ``R`` slots, the KV cache of every row's canvas, and a sink row (index ``slots``) that the padding
rows of a forward write to. The graphs run the eager loop's verbs (`tracelock.decode.step`) on every row.
"""

import types
import warnings
from functools import partial

import torch

from tracelock import states
from tracelock.decode import step as verbs
from tracelock.decode.canvas import Canvas
from tracelock.decode.context import allocate_memory, memory_width
from tracelock.decode.kv_cache import DecodeKVCache
from tracelock.decode.schedule import RowCounters
from tracelock.kernels.ref import commit_margin_threshold
from tracelock.signals import Signals

# the packed flags of a step: live rows, rows that refresh, rows that take a cached step (16 bits each)
BITS = 16


def row_bucket(n: int, slots: int) -> int:
    """Rows a forward runs for ``n`` rows that need it: the next power of two, at most ``slots``."""
    return min(slots, 1 << max(0, n - 1).bit_length())


def _own_code(method, *args):
    """``method`` (bound) with ``args`` as the defaults of its parameters, as a function with a code object of its
    own, to call without arguments. torch.compile keeps compiled graphs, and counts recompiles against its limit, per
    code object (a ``functools.partial`` would share its wrapper's): each graph of each engine gets its own, so
    engines of other settings (or the other row counts of this one) never evict or crowd out this one's graph."""
    func = method.__func__
    copy = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, args or func.__defaults__,
                              func.__closure__)
    return types.MethodType(copy, method.__self__)


class _CapturedStep:
    """A step function replayed from a CUDA graph: its first call runs it (on a side stream, as CUDA graph capture
    wants: lazy device moves and allocator warm-up happen there), its second captures and replays it."""

    def __init__(self, fn, pool):
        self.fn, self.pool, self.graph, self.out, self.warm = fn, pool, None, None, False

    def __call__(self):
        if self.graph is None:
            if not self.warm:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    out = self.fn()
                torch.cuda.current_stream().wait_stream(side)
                self.warm = True
                return out
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.out = self.fn()
            self.graph = graph
        # capturing records without running: this call's work is the replay
        self.graph.replay()
        return self.out


class EngineRunner:
    """The buffers and graphs of ``slots`` rows decoding with the run context ``ctx`` (`start_run` over an op set a
    graph can hold) on a canvas of ``prompt_len`` + gen_length positions; ``compile`` / ``backend`` as
    `DecodeEngine` takes them."""

    def __init__(self, ctx, slots: int, prompt_len: int, compile=False, backend=None):
        self.context, self.model, self.spec, self.device = ctx, ctx.model, ctx.spec, ctx.model.device
        self.policy, self.schedule, self.settings = ctx.policy, ctx.schedule, ctx.settings
        self.num_slots, self.prompt_len, self.gen_length = slots, prompt_len, ctx.settings.gen_length
        self.length = prompt_len + self.gen_length
        self.schedule.bind(prompt_len, ctx.steps_per_region)
        self.budget = verbs.step_budget(self.schedule, ctx.steps_per_region)
        self._allocate()
        self._compile(compile, backend)

    # ---- setup --------------------------------------------------------------------------------------------------

    def _allocate(self):
        N, L, dev, spec, ctx = self.num_slots, self.length, self.device, self.spec, self.context
        long = dict(dtype=torch.long, device=dev)
        # every row empty (`Canvas.release`'s state): padding, prompt positions, nothing masked out
        self.canvas = Canvas(x=torch.full((N, L), spec.pad_id, **long),
                             state=torch.full((N, L), states.PROMPT, dtype=torch.uint8, device=dev),
                             attention_mask=torch.ones((N, L), dtype=torch.bool, device=dev),
                             prompt_len=self.prompt_len, gen_length=self.gen_length)
        self.first_active = torch.full((N,), L, **long)  # L: the row has nothing to decode (free or finished)
        self.counters = RowCounters(*(torch.zeros(N, **long) for _ in range(4)))
        self.commit_log = torch.zeros((N, self.budget + 1), dtype=torch.int32, device=dev)
        # the forwards write the rows they ran into these (row N is the sink of padding rows)
        width = self.schedule.width + ctx.lookahead
        self.signal_buffers = (torch.zeros((N + 1, width), **long),) + tuple(
            torch.zeros((N + 1, width), device=dev) for _ in range(4))
        # a rule's memory across steps (row N, the sink, takes padding rows') and its vocabulary pass's outputs
        self.memory = allocate_memory(ctx, N + 1)
        self.vocab_buffers = {name: torch.zeros((N + 1, memory_width(ctx)), dtype=dtype, device=dev)
                              for name, dtype in self.policy.vocab_fields().items()}
        layout = ctx.tap_layout
        self.taps = None if layout is None else tuple(
            torch.zeros((N + 1, L, layout[1]), dtype=layout[2], device=dev) for _ in range(layout[0]))
        # the KV cache's state, as the eager loop keeps it (its sink row N and spare position L take padding rows')
        self.kv = None if self.settings.cache is None else DecodeKVCache(ctx, N, L)
        # one forward of some rows: `verbs.forward_rows` on the runner's canvas
        self._forward = partial(verbs.forward_rows, ctx, self.canvas)

    def _compile(self, compile, backend):
        if compile not in (False, True, "cudagraphs"):
            raise ValueError(f"compile={compile!r} must be False, True (torch.compile) or 'cudagraphs' (CUDA graphs "
                             "of the uncompiled step, captured at once)")
        if compile == "cudagraphs" and self.device.type != "cuda":
            raise ValueError("compile='cudagraphs' captures CUDA graphs and needs a model on CUDA; on a CPU use "
                             "compile=True (torch.compile)")
        if compile and self.context.generator is not None:
            warnings.warn("compile=True: sampling (temperature > 0) and stochastic policies draw from a "
                          "torch.Generator, which a compiled graph cannot take; this engine runs its steps uncompiled",
                          stacklevel=4)
            compile = False
        self.compiled = bool(compile)
        # the step functions, each called without arguments: ``wrap(method, *args)``
        if compile is True:
            # a pure function of theta (host-side float arithmetic on CPU tensors): a compiled step takes its value
            # as a constant (marked here, not where it is defined, so importing the specs never imports dynamo)
            torch._dynamo.assume_constant_result(commit_margin_threshold)
            backend = backend or "inductor"
            # CUDA graphs on CUDA: a step's kernels replay without a launch each
            mode = "reduce-overhead" if self.device.type == "cuda" and backend == "inductor" else None
            compile_fn = partial(torch.compile, fullgraph=True, dynamic=False, mode=mode, backend=backend)
            self._wrap = lambda method, *args: compile_fn(_own_code(method, *args))
        elif compile == "cudagraphs":
            pool = torch.cuda.graph_pool_handle()
            self._wrap = lambda method, *args: _CapturedStep(partial(method, *args), pool)
        else:
            self._wrap = partial
        if self.device.type == "cuda" and compile is True:
            # CUDA graphs replay fixed addresses: the runner's state must stay where it is
            for t in self._state_tensors():
                torch._dynamo.mark_static_address(t)
        self.graphs = {}  # (kind, rows) -> a forward's graph
        self._prepare = self._wrap(self._prepare_body)
        self._finish = self._wrap(self._finish_body)

    def _state_tensors(self):
        c, n = self.canvas, self.counters
        out = [c.x, c.state, c.attention_mask, self.first_active, n.block_idx, n.region_step, n.region_initial,
               n.steps, self.commit_log, *self.signal_buffers, *(self.taps or ()), *self.memory.values(),
               *self.vocab_buffers.values()]
        return out + ([] if self.kv is None else self.kv.state_tensors())

    # ---- rows ---------------------------------------------------------------------------------------------------

    def admit(self, row: int, ids: torch.Tensor) -> None:
        """Start decoding prompt ``ids`` [n] in ``row``: its canvas, schedule counters, commit log, memory and cache."""
        self.canvas.admit(row, ids, self.spec)
        self.first_active[row] = self.prompt_len
        self.schedule.admit(self.counters, row)
        self.commit_log[row] = 0
        for buf in self.memory.values():  # a rule's memory starts empty with each prompt
            buf[row] = 0
        if self.kv is not None:
            self.kv.reset(row)

    def release(self, row: int) -> None:
        """Stop decoding ``row`` at once (finished or not)."""
        self.canvas.release(row, self.spec)
        self.first_active[row] = self.length

    # ---- a step -------------------------------------------------------------------------------------------------

    def prepare(self) -> tuple:
        """(live, refreshing, cached) row counts of the next step: the step's one host read."""
        flags, mask = int(self._prepare()), (1 << BITS) - 1
        return flags & mask, (flags >> BITS) & mask, (flags >> 2 * BITS) & mask

    def forward(self, kind: str, rows: int) -> None:
        """The forward of the ``kind`` rows ("plain", "refresh" or "cached") that need one, ``rows`` of them."""
        k = row_bucket(rows, self.num_slots)
        if (kind, k) not in self.graphs:
            method = {"plain": self._forward_plain, "refresh": self._forward_refresh,
                      "cached": self._forward_cached}[kind]
            self.graphs[kind, k] = self._wrap(method, k)
        self.graphs[kind, k]()

    def finish(self) -> None:
        """Close the step of every row from what the forwards stored."""
        self._finish()

    # ---- the graphs' bodies ---------------------------------------------------------------------------------

    def _region(self, rows=slice(None)) -> verbs.Region:
        return verbs.commit_region(self.schedule, self.counters.block_idx[rows], self.first_active[rows], self.length,
                                   self.context.lookahead)

    def _row_groups(self):
        """[num_slots] bool each: live rows, rows that refresh at this step, rows that take a cached step."""
        live = self.first_active < self.length
        if self.kv is None:
            return live, None, None
        return (live, *self.kv.plan(slice(None), self._region().lo, live))

    def _prepare_body(self):
        live, need, cached = self._row_groups()
        packed = live.sum()
        if need is not None:
            packed = packed + (need.sum() << BITS) + (cached.sum() << 2 * BITS)
        return packed

    def _rows(self, k: int, mask):
        """(rows [k], valid [k], target [k]): the first k rows of ``mask`` in slot order (padded with others), which
        of them are in ``mask``, and where their outputs go (row num_slots, the sink, for padding rows)."""
        if k == self.num_slots:
            rows = torch.arange(self.num_slots, device=mask.device)
        else:
            rows = torch.sort((~mask).to(torch.uint8), stable=True).indices[:k]
        valid = mask[rows]
        return rows, valid, torch.where(valid, rows, self.num_slots)

    def _store_outputs(self, target, head, taps, rows=None, region=None):
        """Write the signals of a forward's ``head`` (and its taps) into the buffers at ``target`` rows; for a rule
        that remembers, run its vocabulary pass on the ``rows`` (their `region`) and store their memory too."""
        if self.policy.reads_vocab:
            memory = {k: v[rows] for k, v in self.memory.items()}
            vocab = verbs.vocab_pass(self.context, head, memory, region, self.canvas.state[rows],
                                     self.counters.region_step[rows])
            for name, value in memory.items():
                self.memory[name].index_copy_(0, target, value)
            for name, value in vocab.items():
                self.vocab_buffers[name].index_copy_(0, target, value.to(self.vocab_buffers[name].dtype))
        signals = verbs.step_signals(self.context, head)
        fields = (signals.proposal, signals.confidence, signals.margin, signals.neg_entropy, signals.eos_prob)
        for buf, value in zip(self.signal_buffers, fields):
            buf.index_copy_(0, target, value.to(buf.dtype))
        if taps is not None:
            for buf, value in zip(self.taps, taps):
                buf.index_copy_(0, target, value.to(buf.dtype))

    def _tap_positions(self, k):
        return torch.arange(self.length, device=self.device).expand(k, -1) if self.policy.needs_taps else None

    def _forward_plain(self, k: int):
        live, _, _ = self._row_groups()
        rows, _, target = self._rows(k, live)
        region = self._region(rows)
        head, taps, _ = self._forward(rows, region.query(), self._tap_positions(k))
        self._store_outputs(target, head, taps, rows, region)

    def _forward_refresh(self, k: int):
        _, need, _ = self._row_groups()
        rows, _, target = self._rows(k, need)
        region = self._region(rows)
        head, taps = self.kv.refresh(self._forward, rows, region.query(), self._tap_positions(k), target)
        self._store_outputs(target, head, taps, rows, region)

    def _forward_cached(self, k: int):
        _, _, cached = self._row_groups()
        rows, valid, target = self._rows(k, cached)
        region = self._region(rows)
        query = region.query()
        # padding rows (not cached this step) span from their first slot (a finished row's slots sit at L - 1, left
        # of its region's start L), so the positions they ask for are there too
        start = torch.where(valid, self.kv.pointer[rows], query[:, 0])
        head, taps = self.kv.cached_step(self._forward, rows, query, start, region.hi, width=self.kv.width,
                                         valid=valid)
        self._store_outputs(target, head, taps, rows, region)

    def _finish_body(self):
        """Close the step of every row from the buffers the forwards filled: the shared `verbs.close_step`, the
        block advance, the cache bookkeeping and the commit log."""
        N, c = self.num_slots, self.canvas
        live, need, _ = self._row_groups()
        region = self._region()
        signals = Signals(*(buf[:N] for buf in self.signal_buffers))
        taps = None if self.taps is None else tuple(t[:N] for t in self.taps)
        step = verbs.StepRows(torch.arange(N, device=self.device), c.x, c.state, c.attention_mask, self.counters)
        inp = verbs.step_input(self.context, signals, region, step, taps,
                               {k: v[:N] for k, v in self.vocab_buffers.items()})
        first_active, committed = verbs.close_step(self.context, inp, region, step, live=live)
        self.first_active.copy_(first_active)
        # the row's commit count at its step index (a finished row writes into the spare last column)
        at = torch.where(live, self.counters.steps, self.budget).clamp(max=self.budget)
        self.commit_log.scatter_(1, at[:, None], committed.to(torch.int32)[:, None])
        self.schedule.advance(c.state, self.counters, live)
        if self.kv is not None:
            self.kv.advance(slice(None), need, region.lo, live.long())
