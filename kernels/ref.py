"""Pure-torch references (``*_ref``) for every tracelock op: the executable spec, no triton."""

import math

import torch

from tracelock.states import ACTIVE, EOT, LOCKED


def apply_commits_ref(
    x: torch.Tensor,
    state: torch.Tensor,
    proposal: torch.Tensor,
    commit: torch.Tensor,
    end_ids: torch.Tensor,
    fill_id: int,
    stop_at_eot: bool,
) -> torch.Tensor:
    """Apply one decode step's commits to the canvas, in place; the per-step bookkeeping of the loop.

    Only ACTIVE positions move: ``commit`` at a PROMPT, LOCKED or EOT position is ignored. A committed
    position gets ``x = proposal`` and ``state = EOT`` if the proposal is one of ``end_ids``, else
    ``state = LOCKED``. With ``stop_at_eot``, let ``j`` be the first EOT position of a row after this
    step's commits (EOT states from earlier steps count too); every still-ACTIVE position after ``j``
    becomes EOT with ``x = fill_id``. Without ``stop_at_eot`` nothing else changes.

    Args:
        x (torch.Tensor): [B, L] int64 canvas tokens. Modified in place.
        state (torch.Tensor): [B, L] uint8 position states (``tracelock.states``). Modified in place.
        proposal (torch.Tensor): [B, L] int64 proposed tokens.
        commit (torch.Tensor): [B, L] bool positions chosen by the policy.
        end_ids (torch.Tensor): [E] int64 end tokens (eos and end-of-turn); E may be 0.
        fill_id (int): the pad token written after the first EOT under ``stop_at_eot``.
        stop_at_eot (bool): fill the still-active tail of a row once it holds an EOT.

    Returns:
        first_active (torch.Tensor): [B] int64 index of the first ACTIVE position per row, or L if the
            row has none (the sliding window's left pointer; a row is done when ``first_active == L``).
    """
    B, L = x.shape
    take = commit & (state == ACTIVE)
    is_end = torch.isin(proposal, end_ids)
    new_state = torch.where(take, torch.where(is_end, EOT, LOCKED).to(state.dtype), state)
    # torch.where instead of boolean indexing: no host sync, so the loop stays asynchronous on GPU
    x.copy_(torch.where(take, proposal, x))
    if stop_at_eot:
        # a running count of EOTs marks every position at or after the row's first EOT
        after_eot = (new_state == EOT).cumsum(1) > 0
        fill = after_eot & (new_state == ACTIVE)
        x.masked_fill_(fill, fill_id)
        new_state.masked_fill_(fill, EOT)
    state.copy_(new_state)
    # a sentinel column L keeps the reduction defined for L == 0 and for rows with no active position
    pos = torch.arange(L + 1, device=x.device)
    active = torch.cat([new_state == ACTIVE, torch.ones((B, 1), dtype=torch.bool, device=x.device)], dim=1)
    return torch.where(active, pos, L).amin(1)


def skip_finished_blocks_ref(
    state: torch.Tensor,
    block_idx: torch.Tensor,
    region_step: torch.Tensor,
    region_initial: torch.Tensor,
    steps: torch.Tensor,
    rows: torch.Tensor,
    prompt_len: int,
    block: int,
    num_regions: int,
    steps_per_block: int,
    idle_steps: bool,
) -> None:
    """Move each of ``rows`` past its finished semi-AR blocks, in place; the block schedule's advance.

    Block ``k`` of a row is ``[prompt_len + k·block, prompt_len + (k+1)·block)``. While a selected row's
    block has no ACTIVE position and is not the last one (and, with ``idle_steps``, the row has spent
    ``steps >= (k+1)·steps_per_block`` forwards: the reference release's ``step // steps_per_block``), the row
    moves to the next block: ``block_idx += 1``, ``region_step = 0``, ``region_initial`` = the new block's
    ACTIVE count. Several blocks may be skipped at once (stop-at-EOT fills whole blocks).

    Args:
        state (torch.Tensor): [B, L] uint8 position states (``tracelock.states``).
        block_idx, region_step, region_initial (torch.Tensor): [B] int64 row counters. Modified in place.
        steps (torch.Tensor): [B] int64 forwards spent on each row so far.
        rows (torch.Tensor): [B] bool rows to advance; the others are left as they are.
        prompt_len, block, num_regions, steps_per_block (int): the schedule (num_regions·block positions).
        idle_steps (bool): also wait for the step budget before leaving a block.
    """
    pos = torch.arange(state.shape[1], device=state.device)

    def active_in_block():
        lo = prompt_len + block_idx * block
        inside = (pos >= lo[:, None]) & (pos < lo[:, None] + block)
        return ((state == ACTIVE) & inside).sum(dim=1)

    for _ in range(num_regions):
        empty = rows & (active_in_block() == 0) & (block_idx < num_regions - 1)
        if idle_steps:
            empty &= steps >= (block_idx + 1) * steps_per_block
        if not bool(empty.any()):
            return
        block_idx += empty.long()
        region_step.masked_fill_(empty, 0)
        region_initial.copy_(torch.where(empty, active_in_block(), region_initial))


def tap_project_ref(h1: torch.Tensor, h2: torch.Tensor, h3: torch.Tensor, A: torch.Tensor,
                    c: torch.Tensor) -> torch.Tensor:
    """Project the three hidden-state taps straight to controller inputs: ``h1 @ A[0] + h2 @ A[1] + h3 @ A[2] + c``.

    Linear encoders fold into ``A``: with code matrices ``E_h`` and ``E_d``, the codes
    ``[h1 E_h, h2 E_h, h3 E_h, (h2 - h1) E_d, (h3 - h2) E_d]`` are this projection with ``A[0] = [E_h, 0, 0, -E_d, 0]``,
    ``A[1] = [0, E_h, 0, E_d, -E_d]``, ``A[2] = [0, 0, E_h, 0, E_d]`` (N = 832 at the reference widths), and any
    further linear layer (the controller's input projection) multiplies into ``A`` and ``c`` as well.
    Everything is computed in fp32 from upcast inputs.

    Args:
        h1, h2, h3 (torch.Tensor): [T, D] taps (h_{n-2}, h_{n-1}, norm_f(h_n)), fp32, fp16 or bf16.
        A (torch.Tensor): [3, D, N] folded weights, fp32 (fp16/bf16 accepted).
        c (torch.Tensor): [N] bias.

    Returns:
        out (torch.Tensor): [T, N] fp32.
    """
    out = c.float().expand(h1.shape[0], -1).clone()
    for h, a in zip((h1, h2, h3), A):
        out += h.float() @ a.float()
    return out


def window_logits_stats_ref(hidden: torch.Tensor, weight: torch.Tensor, eos_id: int | None) -> tuple:
    """The LM head on the given rows and the greedy signals of ``tracelock.signals.compute_signals``
    (temperature 0) on ``logits = hidden @ weight.T``, in fp32 from upcast inputs.

    The proposal is the argmax (ties to the lowest index); ``max_prob`` and ``second_prob`` are the two largest
    probabilities (equal when the top logits tie), so ``margin = max_prob - second_prob``; ``neg_entropy`` is
    ``sum p log p``. Probabilities come from max-shifted exponentials. This spec materialises the [R, V] logits;
    the Triton kernel computes the same in one online pass over the vocabulary.

    Args:
        hidden (torch.Tensor): [R, D] final-normed hidden states of the rows to score, fp32, fp16 or bf16.
        weight (torch.Tensor): [V, D] LM-head weight, fp32, fp16 or bf16.
        eos_id (int, optional): token whose probability goes into ``eos_prob`` (zeros when None).

    Returns:
        (proposal [R] int64, max_prob [R], second_prob [R], neg_entropy [R], eos_prob [R]), the last four fp32.
    """
    logits = hidden.float() @ weight.float().T
    proposal = logits.argmax(dim=-1)
    top = logits.topk(min(2, logits.shape[-1]), dim=-1).values
    d = logits - top[:, :1]
    q = d.exp()
    z = q.sum(dim=-1)
    neg_entropy = torch.where(q > 0, q * d, 0.0).sum(dim=-1) / z - z.log()
    max_prob = 1 / z
    second_prob = (top[:, 1] - top[:, 0]).exp() / z if top.shape[-1] > 1 else torch.zeros_like(z)
    eos_prob = torch.zeros_like(z) if eos_id is None else d[:, eos_id].exp() / z
    return proposal, max_prob, second_prob, neg_entropy, eos_prob


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> tuple:
    """The residual add and the RMSNorm after it, as the backbone computes them (``models.backbone.RMSNorm``).

    ``summed = x + residual`` in x's dtype (``x`` itself when ``residual`` is None); with ``s = summed`` upcast to
    fp32 for the statistics, ``normed = weight * (s * rsqrt(mean(s², -1) + eps)).to(x.dtype)``: normalised in fp32,
    cast back, *then* scaled in the input dtype (as LLaDA, Llama and Qwen2 do), so the scale rounds once more.

    Args:
        x (torch.Tensor): [M, D] rows, fp32, fp16 or bf16.
        residual (torch.Tensor, optional): [M, D] in x's dtype; None: no add.
        weight (torch.Tensor): [D] the norm's scale (the model's dtype).
        eps (float): added to the mean square.

    Returns:
        (normed [M, D] in x's dtype (torch's promotion of x's and weight's), summed [M, D] in x's dtype).
    """
    summed = x if residual is None else x + residual
    s32 = summed.float()
    y = s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype), summed


def _rotate_half(t: torch.Tensor) -> torch.Tensor:
    t1, t2 = t.chunk(2, dim=-1)
    return torch.cat((-t2, t1), dim=-1)


def rope_qkv_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int, n_kv: int, head_dim: int,
                 rope_fp32: bool, k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
                 index: torch.Tensor | None = None) -> tuple:
    """Split the fused q/k/v projection's output into heads, apply RoPE to q and k as the backbone does
    (``models.backbone.apply_rope``, half-split / NeoX), and with a KV cache write k and v into it in place.

    RoPE is ``t * cos + rotate_half(t) * sin`` with ``rotate_half(t) = [-t2, t1]``: with ``rope_fp32`` (LLaDA) in fp32
    from upcast t, then cast to the dtype; else (Dream) with cos and sin cast to the dtype first and every product and
    the sum rounded to it. With ``k_cache``/``v_cache``, ``k_cache[b, :, index[b, j]] = k[b, :, j]`` (likewise v)
    and the caches themselves are returned as k and v; duplicate positions of a row must carry equal values (a padded
    query repeating its last position).

    Args:
        qkv (torch.Tensor): [B, Q, (n_heads + 2·n_kv)·head_dim], fp32, fp16 or bf16: q's heads, then k's, then v's.
        cos, sin (torch.Tensor): [B, Q, head_dim] fp32 (``models.backbone.rope_cos_sin``).
        n_heads, n_kv, head_dim (int): query heads, key/value heads, head width (even).
        rope_fp32 (bool): rotate in fp32 (LLaDA) or in the dtype (Dream).
        k_cache, v_cache (torch.Tensor, optional): [B, n_kv, Lc, head_dim] in qkv's dtype. Modified in place.
        index (torch.Tensor, optional): [B, Q] int64 cache positions of the rows, in [0, Lc); with the caches.

    Returns:
        (q [B, n_heads, Q, head_dim], k and v [B, n_kv, Q, head_dim] contiguous, or the caches), qkv's dtype.
    """
    B, Q, _ = qkv.shape
    q, k, v = qkv.view(B, Q, n_heads + 2 * n_kv, head_dim).transpose(1, 2).split((n_heads, n_kv, n_kv), dim=1)
    cos, sin = cos[:, None], sin[:, None]
    if rope_fp32:
        q32, k32 = q.float(), k.float()
        q = (q32 * cos + _rotate_half(q32) * sin).to(qkv.dtype)
        k = (k32 * cos + _rotate_half(k32) * sin).to(qkv.dtype)
    else:
        cos, sin = cos.to(qkv.dtype), sin.to(qkv.dtype)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    if k_cache is None:
        return q.contiguous(), k.contiguous(), v.contiguous()
    where = index[:, None, :, None].expand(B, n_kv, Q, head_dim)
    return q.contiguous(), k_cache.scatter_(2, where, k), v_cache.scatter_(2, where, v)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's elementwise half: ``silu(gate) * up`` in the dtype, from the fused gate/up projection's output (gate
    columns first). torch's silu computes ``x / (1 + exp(-x))`` in fp32 and rounds it to the dtype; the product
    rounds again.

    Args:
        gate_up (torch.Tensor): [M, 2F], fp32, fp16 or bf16.

    Returns:
        out (torch.Tensor): [M, F] in gate_up's dtype.
    """
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def commit_margin_threshold(theta: float, inclusive: bool = False) -> float:
    """The fp32 ``t`` with ``m > t  <=>  sigmoid(m) > theta`` (``>= theta`` when ``inclusive``) for every fp32
    margin ``m``, sigmoid in exact arithmetic: ``logit(theta)`` rounded down to fp32, one fp32 step lower when
    ``inclusive`` and ``logit(theta)`` is itself an fp32 value. Deciding on the margin keeps ``exp`` rounding out of
    the commit rule, so every implementation commits the same slots bit for bit, and margins above ~17, whose fp32
    sigmoid is 1.0, stay ordered. theta = 0 gives -inf (every finite margin passes), theta = 1 gives +inf (none).

    The reference release's inclusive rule is ``fp32 sigmoid(m) >= theta``: the exact form here differs from it only
    where fp32 rounds the sigmoid across theta, for margins within about 1e-5 of ``logit(theta)``.
    """
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0.0 <= theta <= 1.0:
        raise ValueError(f"theta must be a probability in [0, 1], got {theta!r}")
    if theta in (0.0, 1.0):
        return -math.inf if theta == 0.0 else math.inf
    t = math.log(theta) - math.log1p(-theta)
    t32 = torch.tensor(t, dtype=torch.float64).float()
    if t32.double() > t or (inclusive and t32.double() == t):
        t32 = torch.nextafter(t32, torch.tensor(-math.inf))
    return float(t32)


def commit_select_ref(m: torch.Tensor, live: torch.Tensor, margin_threshold: float, cap: int,
                      fallback_score: torch.Tensor | None = None, held: torch.Tensor | None = None) -> torch.Tensor:
    """The selection half of the commit rule: which slots of each row commit at this step. `commit_step_ref` and
    every policy whose rule this is (`TraceLockPolicy.select`) call this one function, so the kernel and the torch
    path are one rule.

    A slot is *eligible* when ``live``, not ``held`` and its margin ``m`` is not NaN (NaN never commits). Eligible
    slots with ``m > margin_threshold`` pass (`commit_margin_threshold` turns ``sigmoid(m) > theta`` into it). With
    ``cap > 0`` only the ``cap`` passing slots of highest ``m`` stay, ties to the lowest slot. When no slot passes,
    the eligible slot of highest ``fallback_score`` commits (the margin when None; a NaN score never wins), ties to
    the lowest slot; a row with no eligible slot commits nothing. Held slots (an end-of-text proposal waiting for the
    text left of it, ``policies.base.held_ends``) neither pass nor fall back.

    Args:
        m (torch.Tensor): [B, R] fp32 margins ``score - tau``.
        live (torch.Tensor): [B, R] bool slots that may commit (active, ACTIVE on the canvas).
        margin_threshold (float): pass when ``m > margin_threshold``.
        cap (int): most passing slots per row; 0 = no cap.
        fallback_score (torch.Tensor, optional): [B, R] what the fallback maximises (upcast to fp32); None: ``m``.
        held (torch.Tensor, optional): [B, R] bool slots kept masked this step; None: none.

    Returns:
        commit (torch.Tensor): [B, R] bool.
    """
    R = m.shape[1]
    eligible = live & ~m.isnan()
    if held is not None:
        eligible &= ~held
    passing = eligible & (m > margin_threshold)
    slot = torch.arange(R, device=m.device)
    if cap > 0:
        # beats[b, j, i]: slot j outranks slot i (higher m, or equal m at a lower slot)
        beats = (m[:, :, None] > m[:, None, :]) | ((m[:, :, None] == m[:, None, :]) & (slot[:, None] < slot[None, :]))
        rank = (beats & passing[:, :, None]).sum(1)
        passing &= rank < cap
    f = m if fallback_score is None else fallback_score.float()
    candidate = eligible & ~f.isnan()
    # the lowest slot among the candidates of highest f (equality, not argmax, so a candidate f = -inf counts)
    best_f = torch.where(candidate, f, -math.inf).amax(1, keepdim=True)
    best = torch.where(candidate & (f == best_f), slot, R).amin(1, keepdim=True)
    return passing | ((slot == best) & ~passing.any(1, keepdim=True))


def commit_step_ref(
    score: torch.Tensor,
    tau: torch.Tensor,
    active: torch.Tensor,
    proposal: torch.Tensor,
    positions: torch.Tensor,
    x: torch.Tensor,
    state: torch.Tensor,
    end_ids: torch.Tensor,
    theta: float,
    cap: int,
    fallback_score: torch.Tensor | None = None,
    held: torch.Tensor | None = None,
    inclusive: bool = False,
    fill_id: int = 0,
    stop_at_eot: bool = False,
) -> tuple:
    """One step's commit rule over the window's slots, in place on the canvas, with no host sync.

    The margin is ``m = score - tau`` (fp32). A slot is *live* when ``active`` and its position lies in [0, L) and is
    ACTIVE on the canvas (only ACTIVE ever moves). Which live slots commit is `commit_select_ref` with the margin
    threshold ``commit_margin_threshold(theta, inclusive)``: ``sigmoid(m) > theta`` (``>=`` when ``inclusive``, the
    reference release's rule), at most ``cap`` by highest ``m``, and when none passes the best by ``fallback_score``
    (the margin when None: the paper's rule; the backbone's confidence or neg-entropy: the shipped rule), never a
    ``held`` slot. A committed slot writes ``x = proposal`` at its position and ``state = EOT`` if the proposal is
    one of ``end_ids``, else LOCKED. Then, with ``stop_at_eot``, as `apply_commits_ref`: every still-ACTIVE position
    after the row's first EOT (this step's or an earlier one's) becomes EOT with ``x = fill_id``. The live slots of
    a row must have distinct positions (a window's slots do); R >= 1 and L >= 1.

    Args:
        score (torch.Tensor): [B, R] controller score ``a`` at the slots, fp32 (fp16/bf16 are upcast).
        tau (torch.Tensor): [B] per-row threshold ``tau``, fp32 (upcast likewise).
        active (torch.Tensor): [B, R] bool slots that may commit.
        proposal (torch.Tensor): [B, R] int64 proposed tokens.
        positions (torch.Tensor): [B, R] int64 canvas position of each slot (outside [0, L): not live).
        x (torch.Tensor): [B, L] int64 canvas tokens. Modified in place.
        state (torch.Tensor): [B, L] uint8 position states (``tracelock.states``). Modified in place.
        end_ids (torch.Tensor): [E] int64 end tokens; E may be 0.
        theta (float): commit probability threshold in [0, 1].
        cap (int): most commits per row per step; 0 = no cap.
        fallback_score (torch.Tensor, optional): [B, R] the fallback's score, fp32 (fp16/bf16 upcast); None: ``m``.
        held (torch.Tensor, optional): [B, R] bool slots that may not commit this step; None: none.
        inclusive (bool): ``sigmoid(m) >= theta`` instead of ``>``.
        fill_id (int): the pad token written after the first EOT under ``stop_at_eot``.
        stop_at_eot (bool): fill the still-active tail of a row once it holds an EOT.

    Returns:
        first_active (torch.Tensor): [B] int64 first ACTIVE position per row after the commits, or L if none
            (the window's new left pointer).
        committed (torch.Tensor): [B] int64 slots committed per row (the fill not counted).
    """
    B, L = x.shape
    m = score.float() - tau.float()[:, None]
    in_canvas = (positions >= 0) & (positions < L)
    pos = positions.clamp(0, L - 1)
    live = active & in_canvas & (state.gather(1, pos) == ACTIVE)
    commit = commit_select_ref(m, live, commit_margin_threshold(theta, inclusive), cap, fallback_score, held)
    new_state = torch.where(torch.isin(proposal, end_ids), EOT, LOCKED).to(state.dtype)
    # scatter through a sentinel column L: slots that do not commit all write there, so they never collide with
    # a committed slot's position, and no boolean indexing (a host sync) is needed
    idx = torch.where(commit, pos, L)
    x_ext = torch.cat([x, x.new_zeros((B, 1))], dim=1).scatter_(1, idx, proposal)
    state_ext = torch.cat([state, state.new_zeros((B, 1))], dim=1).scatter_(1, idx, new_state)
    x.copy_(x_ext[:, :L])
    state.copy_(state_ext[:, :L])
    if stop_at_eot:
        fill = ((state == EOT).cumsum(1) > 0) & (state == ACTIVE)
        x.masked_fill_(fill, fill_id)
        state.masked_fill_(fill, EOT)
    still = torch.cat([state == ACTIVE, torch.ones((B, 1), dtype=torch.bool, device=x.device)], dim=1)
    first_active = torch.where(still, torch.arange(L + 1, device=x.device), L).amin(1)
    return first_active, commit.sum(1)


def linear_rows_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    residual: torch.Tensor | None = None, activation: str | None = None) -> torch.Tensor:
    """A decode step's matrix product with its epilogue: ``y = x @ weight.T + bias``, then with ``activation =
    "silu_mul"`` ``y = silu(y[:, :F]) * y[:, F:]`` (weight is the fused gate/up ``[2F, K]``, gate rows first), then
    ``y + residual``; everything in fp32 from upcast inputs, rounded once to x's dtype at the end. (Unfused torch in
    16-bit rounds after the product and again after each add: within the 16-bit tolerance of this spec.)

    Args:
        x (torch.Tensor): [M, K] rows, fp32, fp16 or bf16; rows may be strided, each row contiguous.
        weight (torch.Tensor): [N, K] in x's dtype (nn.Linear's layout); [2F, K] with ``"silu_mul"``.
        bias (torch.Tensor, optional): [N] added before the activation (the fused linear's bias). Default: None.
        residual (torch.Tensor, optional): [M, N] (``[M, F]`` with ``"silu_mul"``), added last. Default: None.
        activation (str, optional): None or ``"silu_mul"``. Default: None.

    Returns:
        out (torch.Tensor): [M, N] (``[M, F]`` with ``"silu_mul"``) in x's dtype.
    """
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    if activation == "silu_mul":
        F = weight.shape[0] // 2
        y = torch.nn.functional.silu(y[:, :F]) * y[:, F:]
    if residual is not None:
        y = y + residual.float()
    return y.to(x.dtype)


# ---- the vocabulary-wide passes of the rules that remember across steps (tracelock.policies: credit, klass, less)


def credit_fuse_ref(logits: torch.Tensor, credit: torch.Tensor, boost: torch.Tensor, fresh: torch.Tensor,
                    alpha: float, gamma: float, beta: float) -> tuple:
    """CreditDecoding's step (dInfer's ``CreditThresholdParallelDecoder``): decay a slot's credit over the vocabulary,
    boost its current top-1 token, fuse the credit into the logits, and score the fused logits.

    Per row: ``C = 0`` if ``fresh`` (the region's first step) else ``beta * C``; with ``v1`` the argmax of the logits
    (ties to the lowest index) and ``p1`` its probability (fp32), ``C[v1] += p1 ** gamma`` where ``boost`` (only masked
    slots add credit; every slot decays); ``fused = logits + alpha * log(C + 1)`` (fp32); the proposal is
    ``argmax(fused)`` (ties to the lowest index) and the confidence ``softmax(fused)[proposal]``.

    Args:
        logits (torch.Tensor): [N, V] the slots' logits, any float dtype.
        credit (torch.Tensor): [N, V] fp32 credit of each slot. Updated in place.
        boost (torch.Tensor): [N] bool, the slot is masked (its top-1 token gains credit).
        fresh (torch.Tensor): [N] bool, the credit restarts from zero instead of decaying.
        alpha (float): the fusion weight (dInfer's ``credit_alpha``).
        gamma (float): the boost exponent (``boost_gamma``).
        beta (float): the decay (``decay_beta``).

    Returns:
        (proposal [N] int64, confidence [N] fp32).
    """
    x = logits.float()
    c = torch.where(fresh[:, None], torch.zeros_like(credit), credit * beta)
    # the top-1 by logit, not by probability: two logits a rounding apart can share a probability
    v1 = x.argmax(dim=-1)
    p1 = x.softmax(dim=-1).gather(1, v1[:, None]).squeeze(1)
    c.scatter_add_(1, v1[:, None], (p1.pow(gamma) * boost.to(p1.dtype))[:, None])
    credit.copy_(c)
    fused = x + alpha * torch.log(c + 1)
    proposal = fused.argmax(dim=-1)
    confidence = fused.softmax(dim=-1).gather(1, proposal[:, None]).squeeze(1)
    return proposal, confidence


def step_kl_ref(logits: torch.Tensor, prev: torch.Tensor) -> tuple:
    """KLASS's step: each slot's distribution, its step-to-step KL against the stored previous one, which it replaces.

    ``p = softmax(logits)`` in float64; ``kl = sum_v p (log(p + 1e-12) - log(prev + 1e-12))`` (a slot with no previous
    pass holds zeros, so its KL is large, as in KLASS); ``prev <- p``.

    Args:
        logits (torch.Tensor): [N, V] the slots' logits, any float dtype.
        prev (torch.Tensor): [N, V] the previous step's distribution (fp64 here; the Triton kernel keeps fp32).
            Updated in place.

    Returns:
        (proposal [N] int64 argmax, confidence [N] max probability, kl [N]), the last two in ``prev``'s dtype.
    """
    p = logits.double().softmax(dim=-1)
    eps = 1e-12
    kl = (p * (torch.log(p + eps) - torch.log(prev.double() + eps))).sum(dim=-1)
    confidence, proposal = p.max(dim=-1)
    prev.copy_(p)
    return proposal, confidence.to(prev.dtype), kl.to(prev.dtype)


def topk_js_ref(logits: torch.Tensor, prev_ids: torch.Tensor, prev_probs: torch.Tensor,
                has_prev: torch.Tensor) -> tuple:
    """LESS's drift: each slot's top-K distribution and its Jensen-Shannon divergence from the previous step's.

    A top-K distribution is the K most probable tokens of ``softmax(logits)`` (fp32; chosen by logit, ties to the
    lowest index, then listed by probability, ties to the lowest index) with their probabilities, plus one bucket for
    the rest of the mass. Two of them are compared over the union of their
    ids and the rest bucket: a token outside a distribution's own K counts 0 there, and each rest bucket holds
    ``1 - sum`` of its own K. ``js = (KL(P || M) + KL(Q || M)) / 2``, ``M = (P + Q) / 2``, natural log, ``0 log 0 =
    0``; a slot without a previous pass (``has_prev`` False) has drift 1.

    Args:
        logits (torch.Tensor): [N, V] the slots' logits, any float dtype.
        prev_ids (torch.Tensor): [N, K] int64 the previous step's top-K ids.
        prev_probs (torch.Tensor): [N, K] fp32 their probabilities.
        has_prev (torch.Tensor): [N] bool, the slot had a previous pass.

    Returns:
        (ids [N, K] int64, probs [N, K] fp32, js [N] fp32): this step's top-K (descending; ``ids[:, 0]`` is the
        argmax and ``probs[:, 0]`` its probability) and the drift.
    """
    K = prev_ids.shape[1]
    x = logits.float()
    # the K largest logits, ties at the K-th to the lowest indices (a full stable sort does the same, slower)
    kth = x.topk(K, dim=-1).values[:, -1:]
    above = x > kth
    tied = (x == kth) & ((x == kth).cumsum(-1) <= K - above.sum(-1, keepdim=True))
    # the chosen columns, lowest first (distinct keys, so topk is exact; no host sync)
    col = torch.arange(x.shape[-1], 0, -1, device=x.device)
    ids = torch.where(above | tied, col, 0).topk(K, dim=-1).values.neg().add(x.shape[-1])
    ids = ids.gather(1, x.gather(1, ids).sort(dim=-1, descending=True, stable=True).indices)
    probs = x.softmax(dim=-1).gather(1, ids)
    # listed by probability (logits a rounding apart can share one), ties to the lowest index
    by_index = ids.sort(dim=-1, stable=True)
    order = probs.gather(1, by_index.indices).sort(dim=-1, descending=True, stable=True).indices
    ids = by_index.values.gather(1, order).contiguous()
    probs = probs.gather(1, by_index.indices).gather(1, order).contiguous()
    # P: the previous distribution, Q: this one, over [prev ids | this step's ids not among them | rest]
    in_cur = prev_ids[:, :, None] == ids[:, None, :]  # [N, K, K]
    q_at_prev = (in_cur.float() * probs[:, None, :]).sum(-1)
    new = ~(ids[:, :, None] == prev_ids[:, None, :]).any(-1)
    P = torch.cat([prev_probs.float(), torch.zeros_like(probs), (1 - prev_probs.float().sum(-1, keepdim=True))], 1)
    Q = torch.cat([q_at_prev, torch.where(new, probs, 0.0), (1 - probs.sum(-1, keepdim=True))], 1)
    P, Q = P.clamp(min=0), Q.clamp(min=0)
    M = (P + Q) / 2

    def kl(a):
        return torch.where(a > 0, a * (torch.log(a) - torch.log(M.clamp(min=1e-30))), 0.0).sum(-1)

    js = torch.where(has_prev, (kl(P) + kl(Q)) / 2, 1.0)
    return ids, probs, js


# ---- the same passes fused into the LM head: hidden rows and the head weight in place of the logits


def head_credit_fuse_ref(hidden: torch.Tensor, weight: torch.Tensor, credit: torch.Tensor, boost: torch.Tensor,
                         fresh: torch.Tensor, alpha: float, gamma: float, beta: float) -> tuple:
    """``credit_fuse_ref`` on the LM head's logits ``hidden.float() @ weight.float().T``: the same outputs, the
    credit updated in place. The Triton kernel never writes the [R, V] logits.

    Args:
        hidden (torch.Tensor): [R, D] final-normed hidden states of the slots, fp32, fp16 or bf16.
        weight (torch.Tensor): [V, D] LM-head weight, fp32, fp16 or bf16.
        credit, boost, fresh, alpha, gamma, beta: as ``credit_fuse_ref`` (credit [R, V] fp32, in place).

    Returns:
        (proposal [R] int64, confidence [R] fp32).
    """
    return credit_fuse_ref(hidden.float() @ weight.float().T, credit, boost, fresh, alpha, gamma, beta)


def head_topk_js_ref(hidden: torch.Tensor, weight: torch.Tensor, prev_ids: torch.Tensor, prev_probs: torch.Tensor,
                     has_prev: torch.Tensor) -> tuple:
    """``topk_js_ref`` on the LM head's logits ``hidden.float() @ weight.float().T``: the same contract. The Triton
    kernel never writes the [R, V] logits.

    Args:
        hidden (torch.Tensor): [R, D] final-normed hidden states of the slots, fp32, fp16 or bf16.
        weight (torch.Tensor): [V, D] LM-head weight, fp32, fp16 or bf16.
        prev_ids, prev_probs, has_prev: as ``topk_js_ref`` ([R, K] int64, [R, K] fp32, [R] bool).

    Returns:
        (ids [R, K] int64, probs [R, K] fp32, js [R] fp32).
    """
    return topk_js_ref(hidden.float() @ weight.float().T, prev_ids, prev_probs, has_prev)


def head_step_kl_ref(hidden: torch.Tensor, weight: torch.Tensor, prev_logits: torch.Tensor,
                     prev_lse: torch.Tensor) -> tuple:
    """KLASS's step on the LM head's logits ``x = hidden.float() @ weight.float().T``, its memory kept as the previous
    step's logits and their log-normalizer instead of a distribution, so a kernel writes no softmax.

    ``p = softmax(x)``, ``p_prev = exp(prev_logits - prev_lse)`` (0 where ``prev_lse`` is +inf: a slot with no
    previous pass, whose ``prev_logits`` are not read, as ``step_kl_ref``'s zeros); ``kl = sum_v p (log p -
    log(p_prev + 1e-12))``, in float64; then ``prev_logits <- x`` and ``prev_lse <- logsumexp(x)``. It differs from
    ``step_kl_ref`` (on ``x`` and that ``p_prev``) only in dropping the 1e-12 inside the current distribution's own
    log: ``sum_v p log(1 + 1e-12 / p) <= V * 1e-12`` apart. Without that eps the KL separates under online-softmax
    rescaling, ``kl = (1 / z) sum_v exp(x - m) (x - m - log(p_prev + eps)) - log z``, which the kernel accumulates.
    The proposal is the argmax of ``x`` (ties to the lowest index).

    Args:
        hidden (torch.Tensor): [R, D] final-normed hidden states of the slots, fp32, fp16 or bf16.
        weight (torch.Tensor): [V, D] LM-head weight, fp32, fp16 or bf16.
        prev_logits (torch.Tensor): [R, V] fp32 the previous step's logits. Updated in place.
        prev_lse (torch.Tensor): [R] fp32 their logsumexp, +inf for no previous pass (fp64 here keeps the KL's fp64
            digits). Updated in place.

    Returns:
        (proposal [R] int64, confidence [R] max probability, kl [R]), the last two in ``prev_lse``'s dtype.
    """
    x = hidden.float() @ weight.float().T
    lse = torch.logsumexp(x.double(), dim=-1)
    log_p = x.double() - lse[:, None]
    none = prev_lse[:, None] == float("inf")
    p_prev = torch.where(none, 0.0, (prev_logits.double() - torch.where(none, 0.0, prev_lse.double()[:, None])).exp())
    kl = (log_p.exp() * (log_p - torch.log(p_prev + 1e-12))).sum(dim=-1)
    proposal = x.argmax(dim=-1)
    confidence = log_p.gather(1, proposal[:, None]).squeeze(1).exp()
    prev_logits.copy_(x)
    prev_lse.copy_(lse)
    return proposal, confidence.to(prev_lse.dtype), kl.to(prev_lse.dtype)
