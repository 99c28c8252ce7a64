"""The approximate KV cache: which rows refresh at a step (`needs_refresh`, both drivers' rule) and what a cached
step recomputes (`DecodeKVCache`, the eager loop's per-row cache; the engine keeps the same state in its buffers).

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
    """Per-row cache state of one decoding run (B rows, canvas length L)."""

    def __init__(self, mode: str, schedule_kind: str, refresh_every, refresh_shift, *, B: int, L: int, shift: int,
                 needs_taps: bool, device):
        self.mode, self.refresh_every, self.shift, self.needs_taps = mode, refresh_every, shift, needs_taps
        self.canvas_len = L
        self.refresh_shift = trigger_shift(schedule_kind, refresh_shift)
        self.pointer = torch.zeros(B, dtype=torch.long, device=device)  # the commit region's left end at the refresh
        self.since = torch.zeros(B, dtype=torch.long, device=device)  # steps since the last refresh (0 = never)
        self.refreshes = torch.zeros(B, dtype=torch.long, device=device)
        self.split_steps = 0  # steps that ran two forwards (some rows refreshed, some did not)
        self.kv: KVCache | None = None  # every row's keys/values, [B, n_kv, L, hd] per layer
        self.taps: tuple | None = None  # every row's taps (or folded tap inputs) at the refresh, [B, L, X] each

    def step(self, forward, rows, positions, lo, hi, T: int | None):
        """Run one step's forwards for ``rows`` [b] (slots at canvas ``positions`` [b, R], commit regions [lo, hi)
        [b]; the policy reads the taps of [0, T)) and return (head, taps) of all b rows.

        ``forward(rows, positions, tap_positions, **cache_args)`` is `tracelock.decode.step.forward_rows` bound to the
        model and canvas: it returns (head, taps, kv_cache) of the rows it is given.
        """
        need = needs_refresh(self.since[rows], self.pointer[rows], lo, self.refresh_shift, self.refresh_every)
        parts = []
        refresh, cached = need.nonzero().flatten(), (~need).nonzero().flatten()
        if refresh.numel():
            every = (torch.arange(self.canvas_len, device=rows.device).expand(len(refresh), -1) if self.needs_taps
                     else None)
            head, taps, kv = forward(rows[refresh], positions[refresh], every, store_kv=True)
            self._store(rows[refresh], lo[refresh], kv, taps)
            parts.append((refresh, head, None if taps is None else tuple(t[:, :T] for t in taps)))
        if cached.numel():
            g = rows[cached]
            query, fresh = self._query(g, hi[cached], T)
            head, taps, _ = forward(g, positions[cached], fresh, kv_cache=self._kv_of(g), query_positions=query)
            if taps is not None:
                taps = self._with_stored_taps(g, fresh, taps, T)
            parts.append((cached, head, taps))
        self.since[rows] += 1
        self.split_steps += len(parts) - 1
        if len(parts) == 1:
            return parts[0][1:]
        return (_merge([(sub, head) for sub, head, _ in parts], len(rows)),
                _merge([(sub, taps) for sub, _, taps in parts], len(rows)))

    def _store(self, rows, lo, kv: KVCache, taps) -> None:
        if self.kv is None:
            B = self.pointer.shape[0]
            self.kv = KVCache([k.new_zeros((B,) + k.shape[1:]) for k in kv.keys],
                              [v.new_zeros((B,) + v.shape[1:]) for v in kv.values])
            if taps is not None:
                self.taps = tuple(t.new_zeros((B,) + t.shape[1:]) for t in taps)
        self.kv.write(rows, kv)
        if taps is not None:
            for mine, theirs in zip(self.taps, taps):
                mine[rows] = theirs
        self.pointer[rows], self.since[rows] = lo, 0
        self.refreshes[rows] += 1

    def _kv_of(self, rows) -> KVCache:
        # rows come sorted from nonzero(): all of them means every row, in order (no copy)
        return self.kv if len(rows) == self.pointer.shape[0] else self.kv.select(rows)

    def _query(self, rows, hi, T: int | None):
        """(query [b, Q] output rows to recompute, fresh [b, F] canvas positions whose taps they give, None for a
        policy without taps), each row padded by repeating its last position."""
        start = self.pointer[rows]
        end = torch.full_like(hi, self.canvas_len) if self.mode == "prefix" else hi
        query = _span(start - self.shift, end)
        # taps of [pointer, min(end, T)): their output rows (shifted) are all in the query
        fresh = _span(start, end.clamp(max=T)) if self.needs_taps else None
        return query, fresh

    def _with_stored_taps(self, rows, fresh, taps, T: int) -> tuple:
        """The refresh's taps [b, T, X] of ``rows`` with the fresh ones written at ``fresh`` [b, F]."""
        out = []
        for stored, new in zip(self.taps, taps):
            index = fresh[..., None].expand(-1, -1, new.shape[-1])
            out.append(stored[rows, :T].scatter(1, index, new.to(stored.dtype)))
        return tuple(out)


def _span(start, end):
    """[b, W] positions start..end-1 per row, W the widest span; shorter rows repeat their last position."""
    width = int((end - start).max())
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
