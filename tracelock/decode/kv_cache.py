"""The approximate KV cache: which rows refresh at a step (`needs_refresh`, both drivers' rule) and what a cached
step recomputes (`DecodeKVCache`: one implementation, static buffers, which the eager loop and the engine share).

Two modes, Fast-dLLM v1's generalised to the sliding window (docs/kv-cache.md):
- ``"prefix"``: positions left of the row's *refresh pointer* reuse the keys and values of its last refresh; every
  position from the pointer to the end of the canvas is recomputed at every step;
- ``"dual"``: only the positions from the pointer to the end of the commit region are recomputed; keys and values
  on both sides come from the last refresh.
The refresh pointer is the left end of the commit region at the last refresh (the block start for semi-AR blocks,
the first active position for the window). Everything left of it was already committed when the refresh ran, so
the cache never holds a position as a mask that has since been committed; positions committed after the refresh
are recomputed until the next one.

A *refresh* is an ordinary step run as a full forward that also stores every position's keys and values (and, for
a policy that reads taps, every position's taps): it commits like any other step and counts as one. A row
refreshes at its first step, then
- semi-AR blocks: whenever its block changes (Fast-dLLM's per-block refresh, NFE per block = 1 + k);
- window / full region: when the commit region's left end has moved ``refresh_shift`` positions past the pointer;
- with ``refresh_every=S`` (any schedule): also once S steps have run since its last refresh.

Rows decide alone, so a step may run two forwards (the rows that refresh, the rows that do not), and a row
decodes as it would alone. The family's logit shift is respected: a cached step recomputes output rows from
``pointer - shift``, so Dream's logit for the first position after the pointer is exact (Fast-dLLM's Dream
variant instead commits each block's first token unconditionally from the refresh).

The controller's context for a cached position is the refresh's: its taps are stored at the refresh and the
step's fresh taps replace only the recomputed positions.
"""

import torch

from tracelock.models.backbone import KVCache
from tracelock.models.query import CacheQuery

CACHE_MODES = ("prefix", "dual")


def validate_cache(cache, refresh_every, refresh_shift, schedule_kind: str, cfg_scale: float) -> None:
    if cache is None:
        if refresh_every is not None or refresh_shift is not None:
            raise ValueError("refresh_every / refresh_shift set the KV cache's refresh; pass cache='prefix' or "
                             "cache='dual' with them, or drop them")
        return
    if cache not in CACHE_MODES:
        raise ValueError(f"cache={cache!r} must be None, 'prefix' or 'dual'")
    for name, value in (("refresh_every", refresh_every), ("refresh_shift", refresh_shift)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}={value!r} must be a positive int (or None)")
    if refresh_shift is not None and schedule_kind == "block":
        raise ValueError("refresh_shift moves a sliding window's refresh; semi-AR blocks refresh at every block "
                         "start (Fast-dLLM): drop refresh_shift, or use window=N instead of block=N")
    if cfg_scale:
        raise ValueError("the KV cache does not run classifier-free guidance (the unconditional half would need a "
                         "cache of its own): pass cfg_scale=0 or cache=None")


def default_refresh_shift(window: int) -> int:
    """A window's refresh when the pointer has moved half a window (docs/kv-cache.md; the sweep that chose it is
    in docs/history.md)."""
    return max(1, window // 2)


def trigger_shift(schedule_kind: str, refresh_shift: int | None) -> int | None:
    """How far the commit region's left end moves past the pointer before a row refreshes: blocks refresh when
    the block start moves at all."""
    return 1 if schedule_kind == "block" else refresh_shift


def needs_refresh(since, pointer, lo, shift: int | None, refresh_every: int | None):
    """The refresh rule, [b] bool: a row refreshes at its first step (``since`` 0), when its commit region's left
    end ``lo`` is ``shift`` (`trigger_shift`) past its ``pointer``, and ``refresh_every`` steps after its last
    refresh."""
    need = since == 0
    if shift is not None:
        need |= lo - pointer >= shift
    if refresh_every is not None:
        need |= since >= refresh_every
    return need


class DecodeKVCache:
    """The KV state of a decode (``ctx``: its settings' cache and refresh rule) over ``rows`` batch rows (slots)
    and a canvas of ``length`` positions, in static buffers: the eager loop (`DecodeKVCache.step`, on its live rows)
    and the engine (the same verbs inside its graphs, on every slot) both keep it here.

    Buffers: every row's keys and values ``kv`` [rows + 1, n_kv, length + 1, hd] per layer and, for a policy that
    reads taps, every row's taps at its refresh ``taps`` [rows + 1, length, X] each (the context's ``tap_layout``:
    (count, X, dtype)). The extra row (index ``rows``) and the extra position (``length``) are sinks: the engine's
    padding rows write what they compute there. Per row: ``pointer`` (the commit region's left end at the refresh),
    ``since`` (steps since the refresh, 0 = never refreshed) and ``refreshes``.
    """

    def __init__(self, ctx, rows: int, length: int):
        settings, schedule, spec = ctx.settings, ctx.schedule, ctx.spec
        dtype, device = ctx.model.dtype, ctx.model.device
        self.mode, self.refresh_every, self.shift = settings.cache, settings.refresh_every, spec.logit_shift
        self.canvas_len, self.gen_length = length, schedule.gen_length
        self.refresh_shift = trigger_shift(schedule.kind, settings.effective_refresh_shift)
        self.width = self._query_width(schedule.width)
        long = dict(dtype=torch.long, device=device)
        self.pointer, self.since, self.refreshes = (torch.zeros(rows, **long) for _ in range(3))
        self.split_steps = 0  # eager steps that ran two forwards (some rows refreshed, some did not)
        shape = (rows + 1, spec.num_kv_heads, length + 1, spec.head_dim)
        self.kv = KVCache([torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)],
                          [torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)])
        self.taps = None
        if (layout := ctx.tap_layout) is not None:
            count, width, tap_dtype = layout
            self.taps = tuple(torch.zeros((rows + 1, length, width), dtype=tap_dtype, device=device)
                              for _ in range(count))

    def _query_width(self, region_width: int) -> int:
        """Query rows of a cached step: the widest span [pointer - shift, end) a cached row can have, which
        `needs_refresh` bounds (a cached row's region starts less than ``refresh_shift`` past its pointer)."""
        if self.mode == "prefix":
            span = self.gen_length  # the pointer is at least the prompt's end; the span runs to the canvas's end
        else:
            moved = self.gen_length if self.refresh_shift is None else self.refresh_shift - 1
            span = min(self.gen_length, moved + region_width)
        return span + self.shift

    def state_tensors(self) -> list:
        """Every buffer (an engine marks them static for CUDA graphs)."""
        return [self.pointer, self.since, self.refreshes, *self.kv.keys, *self.kv.values, *(self.taps or ())]

    # ---- the verbs, on batch rows ``rows`` ([b] indices, or a slice) ---------------------------------------------

    def reset(self, rows) -> None:
        """A new prompt in ``rows``: never refreshed (its first step refreshes)."""
        self.pointer[rows] = self.since[rows] = self.refreshes[rows] = 0

    def plan(self, rows, lo, live=None) -> tuple:
        """([b] rows that refresh at this step, [b] rows that take a cached step) of ``rows`` whose commit regions
        start at ``lo`` [b] (`needs_refresh`); with ``live`` [b] only among those."""
        need = needs_refresh(self.since[rows], self.pointer[rows], lo, self.refresh_shift, self.refresh_every)
        return (need, ~need) if live is None else (need & live, ~need & live)

    def refresh(self, forward, rows, positions, tap_positions, target) -> tuple:
        """A refresh of ``rows``: their forward at ``positions`` (and taps at ``tap_positions``) storing every
        position's keys/values (and taps) into rows ``target``; returns (head, taps)."""
        head, taps, kv = forward(rows, positions, tap_positions, cache=CacheQuery(store=True))
        self.store(target, kv, taps)
        return head, taps

    def cached_step(self, forward, rows, positions, start, end, *, T=None, width=None, valid=None) -> tuple:
        """A cached step of ``rows``: their forward at ``positions``, recomputing what `recompute` gives from
        ``start`` to ``end`` [b] (``T``, ``width`` as there) against their cache, whose fresh keys/values are written
        in place; returns (head, the taps with the stored ones around the fresh). ``valid`` [b] (the engine's padded
        row groups): the rows that are real; the others write their keys/values to the spare position."""
        query, fresh = self.recompute(rows, start, end, T, width)
        write = None if valid is None else torch.where(valid[:, None], query, self.canvas_len)
        # the engine's positions lie in the query by construction: no host check of them then
        cache = CacheQuery(self.rows_cache(rows), query, kv_positions=write, check_query=valid is None)
        head, taps, _ = forward(rows, positions, fresh, cache=cache)
        return head, None if taps is None else self.with_stored_taps(rows, fresh, taps, T)

    def store(self, target, kv: KVCache, taps) -> None:
        """A refresh: every position's keys/values (and taps, when the policy reads them) of the forward's rows go
        to rows ``target`` [b] (the sink row for padding)."""
        for mine, theirs in zip(self.kv.keys + self.kv.values, kv.keys + kv.values):
            mine[:, :, :self.canvas_len].index_copy_(0, target, theirs)
        if taps is not None:
            for mine, theirs in zip(self.taps, taps):
                mine.index_copy_(0, target, theirs.to(mine.dtype))

    def recompute(self, rows, start, end, T: int | None = None, width: int | None = None):
        """(query [b, Q], fresh [b, F] or None): the output rows a cached step of ``rows`` recomputes and the canvas
        positions whose taps it gives (None for a policy without taps), each row padded by repeating its last
        position. ``start`` [b] is each row's pointer (a padding row may give another position), ``end`` [b] its
        commit region's right end (a prefix cache recomputes to the canvas's end), ``T`` the right end of the taps
        the policy reads (None: all), ``width`` the query's width (None: the widest row's span, and the taps' the
        widest row's span left of ``T``)."""
        L = self.canvas_len
        if self.mode == "prefix":
            end = torch.full_like(end, L)
        # taps of [pointer, min(end, T)): their output rows (shifted) are all in the query
        last = None if self.taps is None else (end if T is None else end.clamp(max=T))
        if width is None:
            tip = end if last is None else last
            width, tap_width = (torch.stack([end, tip]) - start).amax(dim=1).tolist()  # one host sync for both
            width += self.shift
        else:
            tap_width = width - self.shift
        query = _span(start - self.shift, end, width).clamp(0, L - 1)
        fresh = None if last is None else _span(start, last, tap_width).clamp(0, L - 1)
        return query, fresh

    def rows_cache(self, rows) -> KVCache:
        """The cache of ``rows`` [b] for a cached forward: with every row (in order, as nonzero() and the engine's
        full buffers give them) the buffers themselves, so the fresh keys/values are written in place (no copy)."""
        if len(rows) == self.pointer.shape[0]:
            return KVCache([t[:len(rows)] for t in self.kv.keys], [t[:len(rows)] for t in self.kv.values])
        return self.kv.select(rows)

    def with_stored_taps(self, rows, fresh, taps, T: int | None = None) -> tuple:
        """The refresh's taps [b, T, X] of ``rows`` with the fresh ones written at ``fresh`` [b, F]."""
        out = []
        for stored, new in zip(self.taps, taps):
            index = fresh[..., None].expand(-1, -1, new.shape[-1])
            out.append(stored[rows, :T].scatter(1, index, new.to(stored.dtype)))
        return tuple(out)

    def advance(self, rows, need, lo, stepped) -> None:
        """After a step of ``rows``: the rows in ``need`` [b] refreshed (their pointer is now ``lo`` [b]); the rows in
        ``stepped`` ([b] bool, or True) took a step."""
        self.pointer[rows] = torch.where(need, lo, self.pointer[rows])
        self.refreshes[rows] += need.long()
        self.since[rows] = torch.where(need, 0, self.since[rows]) + stepped

    # ---- the eager loop's step -----------------------------------------------------------------------------------

    def step(self, forward, rows, positions, lo, hi, T: int | None):
        """Run one step's forwards for ``rows`` [b] (slots at canvas ``positions`` [b, R], commit regions [lo, hi)
        [b]; the policy reads the taps of [0, T)) and return (head, taps) of all b rows.

        ``forward(rows, positions, tap_positions, cache=None)`` is `tracelock.decode.step.forward_rows` bound to the
        model and canvas: it returns (head, taps, kv_cache) of the rows it is given.
        """
        need, cached = self.plan(rows, lo)
        parts = []
        refresh, cached = need.nonzero().flatten(), cached.nonzero().flatten()
        if refresh.numel():
            every = (torch.arange(self.canvas_len, device=rows.device).expand(len(refresh), -1)
                     if self.taps is not None else None)
            head, taps = self.refresh(forward, rows[refresh], positions[refresh], every, rows[refresh])
            parts.append((refresh, head, None if taps is None else tuple(t[:, :T] for t in taps)))
        if cached.numel():
            g = rows[cached]
            head, taps = self.cached_step(forward, g, positions[cached], self.pointer[g], hi[cached], T=T)
            parts.append((cached, head, taps))
        self.advance(rows, need, lo, 1)
        self.split_steps += len(parts) - 1
        if len(parts) == 1:
            return parts[0][1:]
        return (_merge([(sub, head) for sub, head, _ in parts], len(rows)),
                _merge([(sub, taps) for sub, _, taps in parts], len(rows)))


def _span(start, end, width: int):
    """[b, width] positions start.. per row, each past its row's ``end - 1`` repeating that last position."""
    return (start[:, None] + torch.arange(width, device=start.device)).minimum(end[:, None] - 1)


def _merge(parts, b: int):
    """Join the parts' outputs, (local rows [b_i], a tensor [b_i, ...] or a tuple of them or None), into b rows."""
    first = parts[0][1]
    if first is None:
        return None
    if isinstance(first, tuple):
        return tuple(_merge([(sub, value[i]) for sub, value in parts], b) for i in range(len(first)))
    out = first.new_empty((b,) + first.shape[1:])
    for sub, value in parts:
        out[sub] = value
    return out
