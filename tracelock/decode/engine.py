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

The engine is the slot API (admit, step, result, release) and its host bookkeeping; the tensors and the graphs
belong to its runner (`tracelock.decode.runner.EngineRunner`), the KV orchestration to `DecodeKVCache` (the same
`plan`, `refresh` and `cached_step` the eager loop calls), a slot's canvas and counters to `Canvas.admit` and
`Schedule.admit`.

Fixed per engine: the model, the policy and its arguments, the schedule (gen_length, block / window), the cache and
its refresh rule, stop_at_eot, idle_steps, temperature and seed, the slot count and the prompt bucket. Per slot: the
prompt. Sampling (``temperature > 0``) and stochastic policies draw from one generator for all slots, so a sampled
row depends on its slot mates (as in `fused_generate`'s batches); they run uncompiled.
"""

import time

import torch

from tracelock import ops
from tracelock.decode import step as verbs
from tracelock.decode.canvas import check_prompt_ids
from tracelock.decode.context import check_model, start_run
from tracelock.decode.runner import BITS, EngineRunner
from tracelock.decode.settings import DecodeSettings, settings_from


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
        if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots < 1 << BITS:
            raise ValueError(f"slots={slots!r} must be an int in [1, {(1 << BITS) - 1}] (the batch rows)")
        if isinstance(prompt_len, bool) or not isinstance(prompt_len, int) or prompt_len < 1:
            raise ValueError(f"prompt_len={prompt_len!r} must be a positive int (the prompt bucket)")
        if prompt_len + settings.gen_length > model.spec.max_positions:
            raise ValueError(f"prompt_len ({prompt_len}) + gen_length ({settings.gen_length}) exceeds the model's "
                             f"{model.spec.max_positions} positions; use prompt_bucket() or lower gen_length")
        # the ops as a graph can hold them: each op's default implementation where it is traceable (Triton and the
        # CUDA commits on CUDA, the C++ ops or the torch specs on CPU; no host sync), the torch bookkeeping under
        # inductor
        self.ops = ops.op_set(model.device, "inductor" if compile is True else "graph", backbone=backbone)
        # the run's fixed parts, built once: the verbs of every step read them (a deterministic run has no generator)
        self.context = start_run(model, settings, self.ops)
        if not isinstance(self.context.policy.name, str) or self.context.policy.name == "oracle":
            raise ValueError("the oracle policy indexes a reference canvas by fused_generate's batch rows, which an "
                             "engine's slots are not; run it with fused_generate (the eager loop)")
        self.spec, self.settings, self.policy = model.spec, settings, self.context.policy
        self.num_slots, self.prompt_len, self.length = slots, prompt_len, prompt_len + settings.gen_length
        # the buffers and graphs: every tensor the steps touch
        self.runner = EngineRunner(self.context, slots, prompt_len, compile, backend)
        self.compiled = self.runner.compiled
        self.forwards = 0  # batched forward calls so far (a step that refreshes some rows and not others runs two)
        self._occupied = [False] * slots
        self._admitted_at = [0] * slots  # the engine's step count and wall clock when each slot's prompt came in
        self._started = [0.0] * slots
        self._prompts = [None] * slots
        self._steps = 0
        self.last_step = (0, 0, 0)

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
        self.runner.admit(slot, ids)
        self._occupied[slot], self._prompts[slot] = True, ids
        self._admitted_at[slot], self._started[slot] = self._steps, time.perf_counter()
        return slot

    def release(self, slot: int) -> None:
        """Free a slot, finished or not (a cancelled row stops decoding at once)."""
        self._check_slot(slot)
        self.runner.release(slot)
        self._occupied[slot], self._prompts[slot] = False, None

    cancel = release

    def reset(self) -> None:
        """Free every slot and restart the generator from the engine's seed (a fresh run on the same graphs)."""
        for slot in range(self.num_slots):
            if self._occupied[slot]:
                self.release(slot)
        # a policy object may have been set up for other settings since (setup is cheap and idempotent)
        self.policy.setup(gen_length=self.settings.gen_length, num_regions=self.context.schedule.num_regions)
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
        done = (self.runner.first_active == self.length).tolist()
        return [i for i in self.busy_slots() if done[i]]

    def finished(self, slot: int) -> bool:
        """The slot's row has no masked position left (reads one scalar from the device)."""
        self._check_slot(slot)
        if not self._occupied[slot]:
            raise ValueError(f"slot {slot} holds no prompt")
        return int(self.runner.first_active[slot]) == self.length

    def prefix(self, slot: int) -> list:
        """The committed left-to-right prefix of the slot's generation: the generated tokens before its first
        still-masked position, cut before the first end token (what a stream may already send)."""
        self._check_slot(slot)
        gen = self.runner.canvas.x[slot, self.prompt_len:int(self.runner.first_active[slot])].tolist()
        ends = set(self.spec.end_ids)
        cut = next((i for i, t in enumerate(gen) if t in ends), len(gen))
        return gen[:cut]

    def result(self, slot: int):
        """(tokens [1, n + gen_length], DecodeStats) of the slot's row: what `fused_generate` returns for its prompt
        alone with the engine's settings (``forwards`` = the row's steps; ``seconds`` since its admission)."""
        self._check_slot(slot)
        if not self._occupied[slot]:
            raise ValueError(f"slot {slot} holds no prompt")
        n, runner = self._prompts[slot].numel(), self.runner
        tokens = runner.canvas.x[slot:slot + 1, self.prompt_len - n:].clone()
        steps = int(runner.counters.steps[slot])
        stats = verbs.run_stats(self.context, tokens[:, n:], [runner.commit_log[slot, :steps].tolist()], steps,
                                time.perf_counter() - self._started[slot],
                                None if runner.kv is None else runner.kv.refreshes[slot:slot + 1])
        return tokens, stats

    # ---- one step -------------------------------------------------------------------------------------------

    def step(self) -> bool:
        """One decoding step of every live slot. Returns False (and runs nothing) when no slot is live.

        The only host read is the packed count of live, refreshing and cached rows."""
        with torch.no_grad():
            live, refresh, cached = self.last_step = self.runner.prepare()  # rows that run, refresh, take a cached step
            if live == 0:
                return False
            self._check_budget()
            if self.runner.kv is None:
                self.runner.forward("plain", live)
            for kind, rows in (("refresh", refresh), ("cached", cached)):
                if rows:
                    self.runner.forward(kind, rows)
            self.forwards += 1 if self.runner.kv is None else bool(refresh) + bool(cached)
            self.runner.finish()
        self._steps += 1
        return True

    def _check_budget(self):
        """The eager loop's error for a policy that never commits, checked on the host from admission times (the
        device is read only once a slot is past its budget)."""
        budget = self.runner.budget
        old = [i for i in self.busy_slots() if self._steps - self._admitted_at[i] >= budget]
        if old and any(int(self.runner.first_active[i]) < self.length for i in old):
            raise verbs.budget_error(self.policy, budget)
