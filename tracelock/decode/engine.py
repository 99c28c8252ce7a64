"""A decode engine over static shapes: a fixed set of batch slots that prompts fill and free between steps.

`fused_generate(..., compile=True)` runs on it, and so can a server with continuous batching (admit a prompt into
a free slot between steps, let a finished row leave at once, cancel a row). Every tensor has a shape fixed per
engine: ``slots`` rows, a canvas of ``prompt_len + gen_length`` positions (prompts left-padded to the engine's
prompt bucket), a commit region of ``R`` slots, a KV cache of every slot's full canvas. A step is

1. *prepare* (one graph over every slot): which rows are live, which refresh their KV cache, which take a cached
   step; packed into **one int64 scalar, the only host read of the step**;
2. one or two *forwards* (graphs per row count): the rows that need the forward, gathered in slot order and padded
   to a power-of-two row count (`row_bucket`), so a batch whose rows finish at different times does not keep
   paying for the finished ones, as the eager loop drops them;
3. *finish* (one graph over every slot): the step closed by the eager loop's own verbs (`tracelock.decode.step`:
   `step_input`, `close_step`, the schedule's advance), then the cache bookkeeping and each row's commit count,
   logged on the device.

A row decodes exactly as `fused_generate` decodes its prompt alone with the same settings (tokens, steps, commits
per step, refreshes; fp32 CPU), tested in tests/test_decode_engine.py. With ``compile=True`` each graph goes
through ``torch.compile(fullgraph=True)``: inductor on CPU, CUDA graphs (``mode="reduce-overhead"``) on CUDA;
``compile="cudagraphs"`` (CUDA) captures the uncompiled graphs as CUDA graphs instead.

Fixed per engine: the model, the policy and its arguments, the schedule (gen_length, block / window), the cache and
its refresh rule, stop_at_eot, idle_steps, temperature and seed, the slot count and the prompt bucket. Per slot: the
prompt. Sampling (``temperature > 0``) and stochastic policies draw from one generator for all slots, so a sampled
row depends on its slot mates (as in `fused_generate`'s batches); they run uncompiled.
"""

import time
import types
import warnings
from functools import partial

import torch

from tracelock import ops, states
from tracelock.decode import step as verbs
from tracelock.decode.canvas import Canvas, check_prompt_ids
from tracelock.decode.context import allocate_memory, check_model, memory_width, start_run
from tracelock.decode.kv_cache import DecodeKVCache
from tracelock.decode.schedule import RowCounters
from tracelock.decode.settings import DecodeSettings, settings_from
from tracelock.kernels.ref import commit_margin_threshold
from tracelock.models.query import CacheQuery
from tracelock.signals import Signals

# the packed flags of a step: live rows, rows that refresh, rows that take a cached step (16 bits each)
_BITS = 16


def prompt_bucket(prompt_len: int, gen_length: int, max_positions: int) -> int:
    """The padded prompt length of an engine for prompts up to ``prompt_len`` tokens: ``prompt_len`` rounded up to a
    multiple of 16 (up to 128), of 64 (up to 1024), else of 256, so prompts of similar lengths share shapes (and
    compiled graphs); at most what the model allows beside ``gen_length``."""
    room = max_positions - gen_length
    if isinstance(prompt_len, bool) or not isinstance(prompt_len, int) or prompt_len < 1:
        raise ValueError(f"prompt_len={prompt_len!r} must be a positive int")
    if prompt_len > room:
        raise ValueError(f"prompt ({prompt_len} tokens) + gen_length ({gen_length}) exceeds the model's "
                         f"{max_positions} positions; shorten the prompt or lower gen_length")
    step = 16 if prompt_len <= 128 else 64 if prompt_len <= 1024 else 256
    return min(-(-prompt_len // step) * step, room)


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


class DecodeEngine:
    """A fixed set of decoding slots over static shapes (see the module docstring).

    Args:
        model (DiffusionBackbone): from `tracelock.load_model`.
        settings (DecodeSettings): the decoding settings, fixed for every slot of the engine, or its fields as
            keywords (``cfg_scale`` is not supported; an ``observer`` neither: use `fused_generate`).
        slots (int): batch rows. Default: 1.
        prompt_len (int): the prompt bucket: every prompt is left-padded to this length; longer ones are refused.
            Use `prompt_bucket` to pick it. Default: 64.
        compile (bool | str): True runs the graphs through ``torch.compile(fullgraph=True)`` (inductor; on CUDA
            with CUDA graphs, ``mode="reduce-overhead"``); "cudagraphs" (CUDA only) captures the uncompiled step
            functions as CUDA graphs, no compile time. Sampling and stochastic policies cannot (their draws come from
            a ``torch.Generator``): they warn and run uncompiled. Default: False.
        backend (str | callable, optional): the torch.compile backend with ``compile=True``. Default: inductor.
        backbone (str): the backbone's per-layer ops (`tracelock.ops.op_set`): "kernels", each op's
            default (the Triton kernels on CUDA: fused residual add + RMSNorm, rotary with the K/V write, SiLU x mul;
            their specs on a CPU), with cuBLAS's matrix products; "specs", the plain-PyTorch specs (a compiled step
            lets inductor fuse them itself); "kernels+matmul", the Triton kernels and the Triton weight-streaming
            products (`ops.linear_rows`). Default: "kernels".

    Examples::

        engine = DecodeEngine(model, slots=8, gen_length=64, block=16, policy="threshold", cache="dual")
        slot = engine.admit(prompt_ids)
        while not engine.finished(slot):
            engine.step()
        tokens, stats = engine.result(slot)
        engine.release(slot)
    """

    def __init__(self, model, settings: DecodeSettings | None = None, *, slots=1, prompt_len=64, compile=False,
                 backend=None, backbone="kernels", **fields):
        check_model(model)
        settings = settings_from(settings, fields, "DecodeEngine")
        if settings.cfg_scale:
            raise ValueError("an engine does not run classifier-free guidance (cfg_scale > 0); use fused_generate, "
                             "which runs it on the eager loop")
        if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots < 1 << _BITS:
            raise ValueError(f"slots={slots!r} must be an int in [1, {(1 << _BITS) - 1}] (the batch rows)")
        # the ops as a graph can hold them: each op's default implementation where it is traceable (Triton and the
        # CUDA commits on CUDA, the C++ ops or the torch specs on CPU; no host sync), the torch bookkeeping under
        # inductor
        self.ops = ops.op_set(model.device, "inductor" if compile is True else "graph", backbone=backbone)
        # the run's fixed parts, built once: the verbs of every step read them (a deterministic run has no generator)
        self.context = ctx = start_run(model, settings, self.ops)
        schedule, self.policy = ctx.schedule, ctx.policy
        gen_length = settings.gen_length
        spec = model.spec
        if isinstance(prompt_len, bool) or not isinstance(prompt_len, int) or prompt_len < 1:
            raise ValueError(f"prompt_len={prompt_len!r} must be a positive int (the prompt bucket)")
        if prompt_len + gen_length > spec.max_positions:
            raise ValueError(f"prompt_len ({prompt_len}) + gen_length ({gen_length}) exceeds the model's "
                             f"{spec.max_positions} positions; use prompt_bucket() or lower gen_length")
        self.model, self.spec, self.device = model, spec, model.device
        if not isinstance(self.policy.name, str) or self.policy.name == "oracle":
            raise ValueError("the oracle policy indexes a reference canvas by fused_generate's batch rows, which an "
                             "engine's slots are not; run it with fused_generate (the eager loop)")
        self.schedule = schedule
        self.num_slots, self.prompt_len, self.gen_length = slots, prompt_len, gen_length
        self.length = prompt_len + gen_length  # the canvas: prompt bucket + generation
        self.width = schedule.width  # the commit region's slots
        self.steps_per_region = ctx.steps_per_region
        schedule.bind(prompt_len, self.steps_per_region)
        self.settings, self.cache = settings, settings.cache
        self.record = ctx.record  # what `DecodeStats.settings` reports
        self.stochastic = ctx.generator is not None
        self.budget = verbs.step_budget(schedule, self.steps_per_region)
        self.lookahead = ctx.lookahead
        self._allocate()
        self.forwards = 0  # batched forward calls so far (a step that refreshes some rows and not others runs two)
        self._occupied = [False] * slots
        self._admitted_at = [0] * slots  # the engine's step count and wall clock when each slot's prompt came in
        self._started = [0.0] * slots
        self._prompts = [None] * slots
        self._steps = 0
        self.last_step = (0, 0, 0)
        self._compile(compile, backend)

    # ---- setup --------------------------------------------------------------------------------------------------

    def _allocate(self):
        N, L, dev, spec = self.num_slots, self.length, self.device, self.spec
        long = dict(dtype=torch.long, device=dev)
        self.x = torch.full((N, L), spec.pad_id, **long)
        self.state = torch.full((N, L), states.PROMPT, dtype=torch.uint8, device=dev)
        self.attention_mask = torch.ones((N, L), dtype=torch.bool, device=dev)
        self.first_active = torch.full((N,), L, **long)  # L: the slot has nothing to decode (free or finished)
        self.block_idx, self.region_step = torch.zeros(N, **long), torch.zeros(N, **long)
        self.region_initial, self.steps = torch.zeros(N, **long), torch.zeros(N, **long)
        self.commit_log = torch.zeros((N, self.budget + 1), dtype=torch.int32, device=dev)
        # the forwards write the rows they ran into these (row N is the sink of padding rows)
        width = self.width + self.lookahead
        self.signal_buffers = (torch.zeros((N + 1, width), **long),) + tuple(
            torch.zeros((N + 1, width), device=dev) for _ in range(4))
        # a rule's memory across steps (row N, the sink, takes padding rows') and its vocabulary pass's outputs
        self.memory = allocate_memory(self.context, N + 1)
        self.vocab_buffers = {name: torch.zeros((N + 1, memory_width(self.context)), dtype=dtype, device=dev)
                              for name, dtype in self.policy.vocab_fields().items()}
        layout = self.context.tap_layout
        self.taps = None if layout is None else tuple(
            torch.zeros((N + 1, L, layout[1]), dtype=layout[2], device=dev) for _ in range(layout[0]))
        # the KV cache's state, as the eager loop keeps it (its sink row N and spare position L take padding rows')
        self.kv = None if self.cache is None else DecodeKVCache(self.context, N, L)

    def _compile(self, compile, backend):
        if compile not in (False, True, "cudagraphs"):
            raise ValueError(f"compile={compile!r} must be False, True (torch.compile) or 'cudagraphs' (CUDA graphs "
                             "of the uncompiled step, captured at once)")
        if compile == "cudagraphs" and self.device.type != "cuda":
            raise ValueError("compile='cudagraphs' captures CUDA graphs and needs a model on CUDA; on a CPU use "
                             "compile=True (torch.compile)")
        if compile and self.stochastic:
            warnings.warn("compile=True: sampling (temperature > 0) and stochastic policies draw from a "
                          "torch.Generator, which a compiled graph cannot take; this engine runs its steps uncompiled",
                          stacklevel=3)
            compile = False
        self.compile_mode, self.compiled = compile, bool(compile)
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
            # CUDA graphs replay fixed addresses: the engine's state must stay where it is
            for t in self._state_tensors():
                torch._dynamo.mark_static_address(t)
        self._forward_fns = {}
        self._prepare = self._wrap(self._prepare_body)
        self._finish = self._wrap(self._finish_body)

    def _state_tensors(self):
        out = [self.x, self.state, self.attention_mask, self.first_active, self.block_idx, self.region_step,
               self.region_initial, self.steps, self.commit_log, *self.signal_buffers, *(self.taps or ()),
               *self.memory.values(), *self.vocab_buffers.values()]
        return out + ([] if self.kv is None else self.kv.state_tensors())

    def _forward_fn(self, kind: str, k: int):
        key = kind, k
        if key not in self._forward_fns:
            method = {"plain": self._forward_plain, "refresh": self._forward_refresh,
                      "cached": self._forward_cached}[kind]
            self._forward_fns[key] = self._wrap(method, k)
        return self._forward_fns[key]

    # ---- slots --------------------------------------------------------------------------------------------------

    def free_slots(self) -> list:
        """Slots that hold no prompt (admit fills them)."""
        return [i for i, busy in enumerate(self._occupied) if not busy]

    def admit(self, prompt, slot: int | None = None) -> int:
        """Put a prompt (token ids) into a free slot; it decodes from the next `step`. Returns the slot."""
        ids = torch.as_tensor(prompt, dtype=torch.long).flatten()
        n = ids.numel()
        check_prompt_ids(self.spec, ids[None], torch.ones((1, n), dtype=torch.bool))
        if n > self.prompt_len:
            raise ValueError(f"the prompt has {n} tokens but this engine's prompt bucket is {self.prompt_len}; build "
                             f"an engine with prompt_len=prompt_bucket({n}, ...) for it")
        if slot is not None:
            self._check_slot(slot)
        if slot is None:
            free = self.free_slots()
            if not free:
                raise RuntimeError(f"all {self.num_slots} slots are busy; call step() until a row finishes and "
                                   "release() it")
            slot = free[0]
        elif self._occupied[slot]:
            raise RuntimeError(f"slot {slot} is busy; release() it first or pass slot=None for any free slot")
        P = self.prompt_len
        self.x[slot] = self.spec.pad_id
        self.x[slot, P - n:P] = ids.to(self.device)
        self.x[slot, P:] = self.spec.mask_id
        self.state[slot, :P] = states.PROMPT
        self.state[slot, P:] = states.ACTIVE
        self.attention_mask[slot, :P - n] = False
        self.attention_mask[slot, P - n:] = True
        self.first_active[slot] = P
        self.block_idx[slot] = self.region_step[slot] = self.steps[slot] = 0
        self.commit_log[slot] = 0
        for buf in self.memory.values():  # a rule's memory starts empty with each prompt
            buf[slot] = 0
        # the schedule region's active count when it begins (LLaDA's M): the first block, or the whole generation
        self.region_initial[slot] = self.schedule.block if self.schedule.kind == "block" else self.gen_length
        if self.kv is not None:
            self.kv.pointer[slot] = self.kv.since[slot] = self.kv.refreshes[slot] = 0
        self._occupied[slot], self._prompts[slot] = True, ids
        self._admitted_at[slot], self._started[slot] = self._steps, time.perf_counter()
        return slot

    def release(self, slot: int) -> None:
        """Free a slot, finished or not (a cancelled row stops decoding at once)."""
        self._check_slot(slot)
        self.state[slot] = states.PROMPT
        self.x[slot] = self.spec.pad_id
        self.attention_mask[slot] = True
        self.first_active[slot] = self.length
        self._occupied[slot], self._prompts[slot] = False, None

    cancel = release

    def reset(self) -> None:
        """Free every slot and restart the generator from the engine's seed (a fresh run on the same graphs)."""
        for slot in range(self.num_slots):
            if self._occupied[slot]:
                self.release(slot)
        # a policy object may have been set up for other settings since (setup is cheap and idempotent)
        self.policy.setup(gen_length=self.gen_length, num_regions=self.schedule.num_regions)
        if self.context.generator is not None:
            self.context.generator.manual_seed(self.settings.seed)

    def run(self, prompts) -> list:
        """Decode ``prompts`` (token-id lists, at most ``slots`` of them) from a fresh start (`reset`), all admitted
        at once: [(tokens, DecodeStats)] per prompt, as `result` gives them."""
        self.reset()
        slots = [self.admit(p) for p in prompts]
        while self.step():
            pass
        return [self.result(s) for s in slots]

    def _check_slot(self, slot):
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot={slot!r} must be an int in [0, {self.num_slots})")

    def busy_slots(self) -> list:
        """Slots that hold a prompt, decoding or finished (not yet released)."""
        return [i for i, busy in enumerate(self._occupied) if busy]

    def finished_slots(self) -> list:
        """Busy slots whose row is done (one host read for all of them): release them to free the slot."""
        done = (self.first_active == self.length).tolist()
        return [i for i in self.busy_slots() if done[i]]

    def finished(self, slot: int) -> bool:
        """The slot's row has no masked position left (reads one scalar from the device)."""
        self._check_slot(slot)
        if not self._occupied[slot]:
            raise ValueError(f"slot {slot} holds no prompt")
        return int(self.first_active[slot]) == self.length

    def prefix(self, slot: int) -> list:
        """The committed left-to-right prefix of the slot's generation: the generated tokens before its first
        still-masked position, cut before the first end token (what a stream may already send)."""
        self._check_slot(slot)
        gen = self.x[slot, self.prompt_len:int(self.first_active[slot])].tolist()
        ends = set(self.spec.end_ids)
        cut = next((i for i, t in enumerate(gen) if t in ends), len(gen))
        return gen[:cut]

    def result(self, slot: int):
        """(tokens [1, n + gen_length], DecodeStats) of the slot's row: what `fused_generate` returns for its prompt
        alone with the engine's settings (``forwards`` = the row's steps; ``seconds`` since its admission)."""
        self._check_slot(slot)
        if not self._occupied[slot]:
            raise ValueError(f"slot {slot} holds no prompt")
        prompt = self._prompts[slot]
        n = prompt.numel()
        tokens = self.x[slot:slot + 1, self.prompt_len - n:].clone()
        steps = int(self.steps[slot])
        stats = verbs.run_stats(self.context, tokens[:, n:], [self.commit_log[slot, :steps].tolist()], steps,
                                time.perf_counter() - self._started[slot],
                                None if self.kv is None else self.kv.refreshes[slot:slot + 1])
        return tokens, stats

    # ---- one step -------------------------------------------------------------------------------------------

    def step(self) -> bool:
        """One decoding step of every live slot. Returns False (and runs nothing) when no slot is live.

        The only host read is the packed count of live, refreshing and cached rows."""
        with torch.no_grad():
            packed = self._prepare()
            flags = int(packed)
            mask = (1 << _BITS) - 1
            live, refresh, cached = flags & mask, (flags >> _BITS) & mask, (flags >> 2 * _BITS) & mask
            self.last_step = live, refresh, cached  # rows that ran, refreshed, took a cached step
            if live == 0:
                return False
            self._check_budget()
            if self.cache is None:
                self._forward_fn("plain", row_bucket(live, self.num_slots))()
                self.forwards += 1
            else:
                if refresh:
                    self._forward_fn("refresh", row_bucket(refresh, self.num_slots))()
                if cached:
                    self._forward_fn("cached", row_bucket(cached, self.num_slots))()
                self.forwards += bool(refresh) + bool(cached)
            self._finish()
        self._steps += 1
        return True

    def _check_budget(self):
        """The eager loop's error for a policy that never commits, checked on the host from admission times (the
        device is read only once a slot is past its budget)."""
        old = [i for i in self.busy_slots() if self._steps - self._admitted_at[i] >= self.budget]
        if old and any(int(self.first_active[i]) < self.length for i in old):
            raise verbs.budget_error(self.policy, self.budget)

    def _region(self, rows=slice(None)) -> verbs.Region:
        return verbs.commit_region(self.schedule, self.block_idx[rows], self.first_active[rows], self.length,
                                   self.lookahead)

    def _row_groups(self):
        """[num_slots] bool each: live rows, rows that refresh at this step, rows that take a cached step."""
        live = self.first_active < self.length
        if self.kv is None:
            return live, None, None
        need = self.kv.need(slice(None), self._region().lo) & live
        return live, need, live & ~need

    def _prepare_body(self):
        live, need, cached = self._row_groups()
        packed = live.sum()
        if need is not None:
            packed = packed + (need.sum() << _BITS) + (cached.sum() << 2 * _BITS)
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
            vocab = verbs.vocab_pass(self.context, head, memory, region, self.state[rows], self.region_step[rows])
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

    def _canvas(self, rows):
        return Canvas(x=self.x[rows], state=self.state[rows], attention_mask=self.attention_mask[rows],
                      prompt_len=self.prompt_len, gen_length=self.gen_length)

    def _tap_positions(self, k):
        return torch.arange(self.length, device=self.device).expand(k, -1) if self.policy.needs_taps else None

    def _forward(self, rows, query, tap_positions, cache=None):
        return verbs.forward_rows(self.context, self._canvas(rows), slice(None), query, tap_positions, cache)

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
        head, taps, kv = self._forward(rows, region.query(), self._tap_positions(k), cache=CacheQuery(store=True))
        self.kv.store(target, kv, taps)
        self._store_outputs(target, head, taps, rows, region)

    def _forward_cached(self, k: int):
        _, need, cached = self._row_groups()
        rows, valid, target = self._rows(k, cached)
        region = self._region(rows)
        query = region.query()
        # padding rows (not cached this step) span from their first slot (a finished row's slots sit at L - 1, left
        # of its region's start L), so the positions they ask for are there too
        start = torch.where(valid, self.kv.pointer[rows], query[:, 0])
        recompute, fresh = self.kv.recompute(rows, start, region.hi, width=self.kv.width)
        # the fresh keys/values go into the cache in place; padding rows write theirs to the spare position L
        write = torch.where(valid[:, None], recompute, self.length)
        # the positions lie in the query by construction: no check
        cache = CacheQuery(self.kv.rows_cache(rows), recompute, kv_positions=write, check_query=False)
        head, taps, _ = self._forward(rows, query, fresh, cache=cache)
        if taps is not None:
            taps = self.kv.with_stored_taps(rows, fresh, taps)
        self._store_outputs(target, head, taps, rows, region)

    def _finish_body(self):
        """Close the step of every slot from the buffers the forwards filled: the shared `verbs.close_step`, the
        block advance, the cache bookkeeping and the commit log."""
        N = self.num_slots
        live, need, _ = self._row_groups()
        region = self._region()
        counters = RowCounters(self.block_idx, self.region_step, self.region_initial, self.steps)
        signals = Signals(*(buf[:N] for buf in self.signal_buffers))
        taps = None if self.taps is None else tuple(t[:N] for t in self.taps)
        step = verbs.StepRows(torch.arange(N, device=self.device), self.x, self.state, self.attention_mask, counters)
        inp = verbs.step_input(self.context, signals, region, step, taps,
                               {k: v[:N] for k, v in self.vocab_buffers.items()})
        first_active, committed = verbs.close_step(self.context, inp, region, step, live=live)
        self.first_active.copy_(first_active)
        # the row's commit count at its step index (a finished row writes into the spare last column)
        at = torch.where(live, self.steps, self.budget).clamp(max=self.budget)
        self.commit_log.scatter_(1, at[:, None], committed.to(torch.int32)[:, None])
        self.schedule.advance(self.state, counters, live)
        if self.kv is not None:
            self.kv.advance(slice(None), need, region.lo, live.long())
