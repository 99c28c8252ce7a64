"""The vocabulary-wide passes of the rules that remember across steps (credit, klass, less), on logits or fused
into the LM head."""

import torch

from tracelock.ops.checks import FLOATS, check_arg, check_dims, check_finite, check_head
from tracelock.ops.chooser import call, pick

# the Triton topk_js keeps the running top-K and a [K, K] comparison tile in registers
MAX_TOPK = 64


def _check_logits(logits: torch.Tensor) -> tuple:
    """[N, V] logits of any float dtype, V >= 1, rows may be strided (each row contiguous); returns (N, V)."""
    check_arg("logits", logits, FLOATS + (torch.float64,), strided_rows=True)
    check_dims("logits", logits, "[N, V]")
    if logits.shape[1] == 0:
        raise ValueError(f"logits must be [N, V] with V >= 1 (the vocabulary), got shape {list(logits.shape)}")
    return tuple(logits.shape)



def credit_fuse(logits: torch.Tensor, credit: torch.Tensor, boost: torch.Tensor, fresh: torch.Tensor, alpha: float,
                gamma: float, beta: float, *, impl: str | None = None) -> tuple:
    """CreditDecoding's step (spec: ``credit_fuse_ref``): decay (or, ``fresh``, restart) each slot's credit, add
    ``p1 ** gamma`` at its top-1 token where ``boost``, and score ``logits + alpha * log(credit + 1)``. The Triton
    path reads a row's logits twice in one launch and writes neither softmax nor fused logits.

    Args:
        logits (torch.Tensor): [N, V] the slots' logits, fp32, fp16, bf16 or fp64; rows may be strided (each row
            contiguous).
        credit (torch.Tensor): [N, V] fp32 credit, contiguous. Updated in place.
        boost, fresh (torch.Tensor): [N] bool: the slot is masked (its top-1 gains credit); its credit restarts.
        alpha, gamma, beta (float): the fusion weight, the boost exponent, the decay (finite numbers).
        impl (str, optional): "torch" or "triton". Default: ``TRACELOCK_IMPL``, else the fastest available.

    Returns:
        (proposal [N] int64 argmax of the fused logits, confidence [N] fp32 its fused probability).
    """
    N, V = _check_logits(logits)
    like = ("logits", logits)
    _check_credit(credit, boost, fresh, (N, V), like, alpha=alpha, gamma=gamma, beta=beta)
    return call("credit_fuse", impl, pick("credit_fuse", impl, logits.device), logits, credit, boost, fresh,
                float(alpha), float(gamma), float(beta))


def step_kl(logits: torch.Tensor, prev: torch.Tensor, *, impl: str | None = None) -> tuple:
    """KLASS's step (spec: ``step_kl_ref``): each slot's softmax, its KL against ``prev`` (zeros for a slot with no
    previous pass), and ``prev`` overwritten with it. The Triton path computes in prev's dtype (fp32 on a GPU).

    Args:
        logits (torch.Tensor): [N, V] the slots' logits, fp32, fp16, bf16 or fp64; rows may be strided (each row
            contiguous).
        prev (torch.Tensor): [N, V] fp32 or fp64 previous distribution, contiguous. Updated in place.
        impl (str, optional): "torch" or "triton". Default: ``TRACELOCK_IMPL``, else the fastest available.

    Returns:
        (proposal [N] int64 argmax, confidence [N] max probability, kl [N]), the last two in prev's dtype.
    """
    N, V = _check_logits(logits)
    check_arg("prev", prev, (torch.float32, torch.float64), (N, V), ("logits", logits))
    return call("step_kl", impl, pick("step_kl", impl, logits.device), logits, prev)


def topk_js(logits: torch.Tensor, prev_ids: torch.Tensor, prev_probs: torch.Tensor, has_prev: torch.Tensor, *,
            impl: str | None = None) -> tuple:
    """LESS's drift (spec: ``topk_js_ref``): each slot's top-K distribution (plus a rest bucket) and its
    Jensen-Shannon divergence from the previous step's; 1 for a slot without a previous pass. The Triton path reads
    a row's logits once.

    Args:
        logits (torch.Tensor): [N, V] the slots' logits, fp32, fp16, bf16 or fp64; rows may be strided (each row
            contiguous).
        prev_ids (torch.Tensor): [N, K] int64 the previous top-K ids, 1 <= K <= V (at most `MAX_TOPK` for Triton).
        prev_probs (torch.Tensor): [N, K] fp32 their probabilities.
        has_prev (torch.Tensor): [N] bool, the slot had a previous pass.
        impl (str, optional): "torch" or "triton". Default: ``TRACELOCK_IMPL``, else the fastest available.

    Returns:
        (ids [N, K] int64 descending (ties to the lowest index), probs [N, K] fp32, js [N] fp32).
    """
    N, V = _check_logits(logits)
    _check_topk_memory(prev_ids, prev_probs, has_prev, ("logits", logits), f"[N, K] with N = {N} (logits' rows) and "
                       f"1 <= K <= V = {V}", N, V)
    chosen = pick("topk_js", impl, logits.device)
    _check_topk_limit("topk_js", chosen, prev_ids)
    return call("topk_js", impl, chosen, logits, prev_ids, prev_probs, has_prev)


def _check_credit(credit, boost, fresh, shape: tuple, like: tuple, **knobs) -> None:
    """CreditDecoding's memory: [N, V] fp32 credit, [N] bool boost and fresh; its knobs finite numbers."""
    check_arg("credit", credit, (torch.float32,), shape, like)
    check_arg("boost", boost, (torch.bool,), shape[:1], like)
    check_arg("fresh", fresh, (torch.bool,), shape[:1], like)
    check_finite(**knobs)


def _check_topk_memory(prev_ids, prev_probs, has_prev, like: tuple, shape_text: str, rows: int, V: int) -> None:
    """LESS's memory: [rows, K] int64 ids (1 <= K <= V), their [rows, K] fp32 probabilities, [rows] bool has_prev."""
    check_arg("prev_ids", prev_ids, (torch.int64,), like=like)
    if prev_ids.dim() != 2 or prev_ids.shape[0] != rows or not 1 <= prev_ids.shape[1] <= V:
        raise ValueError(f"prev_ids must be {shape_text}, got shape {list(prev_ids.shape)}")
    check_arg("prev_probs", prev_probs, (torch.float32,), tuple(prev_ids.shape), like)
    check_arg("has_prev", has_prev, (torch.bool,), (rows,), like)


def _check_topk_limit(op: str, chosen: str, prev_ids: torch.Tensor) -> None:
    """The Triton top-K kernels keep the top-K in registers: at most `MAX_TOPK`."""
    if chosen == "triton" and prev_ids.shape[1] > MAX_TOPK:
        raise ValueError(f"prev_ids has K = {prev_ids.shape[1]}; the Triton {op} keeps the top-K in registers, at "
                         f"most {MAX_TOPK}: use impl='torch'")


# ---- the same passes fused into the LM head: hidden rows and the head weight in place of the logits


def head_credit_fuse(hidden: torch.Tensor, weight: torch.Tensor, credit: torch.Tensor, boost: torch.Tensor,
                     fresh: torch.Tensor, alpha: float, gamma: float, beta: float, *, impl: str | None = None) -> tuple:
    """`credit_fuse` on the LM head's logits ``hidden @ weight.T`` (spec: ``head_credit_fuse_ref``). The Triton path
    computes the head tile by tile over splits of the vocabulary and never writes the [R, V] logits.

    Args:
        hidden (torch.Tensor): [R, D] final-normed hidden states of the slots, fp32, fp16 or bf16; rows may be
            strided (each row contiguous).
        weight (torch.Tensor): [V, D] LM-head weight, fp32, fp16 or bf16 (the hidden dtype for the tensor-core path).
        credit, boost, fresh, alpha, gamma, beta, impl: as `credit_fuse`'s, with R rows (credit [R, V]).

    Returns:
        (proposal [R] int64 argmax of the fused logits, confidence [R] fp32 its fused probability).
    """
    R, V = check_head(hidden, weight)
    _check_credit(credit, boost, fresh, (R, V), ("hidden", hidden), alpha=alpha, gamma=gamma, beta=beta)
    return call("head_credit_fuse", impl, pick("head_credit_fuse", impl, hidden.device), hidden, weight, credit,
                boost, fresh, float(alpha), float(gamma), float(beta))


def head_topk_js(hidden: torch.Tensor, weight: torch.Tensor, prev_ids: torch.Tensor, prev_probs: torch.Tensor,
                 has_prev: torch.Tensor, *, impl: str | None = None) -> tuple:
    """`topk_js` on the LM head's logits ``hidden @ weight.T`` (spec: ``head_topk_js_ref``). The Triton path computes
    the head tile by tile over splits of the vocabulary and never writes the [R, V] logits.

    Args:
        hidden (torch.Tensor): [R, D] final-normed hidden states of the slots, fp32, fp16 or bf16; rows may be
            strided (each row contiguous).
        weight (torch.Tensor): [V, D] LM-head weight, fp32, fp16 or bf16 (the hidden dtype for the tensor-core path).
        prev_ids, prev_probs, has_prev, impl: as `topk_js`'s, with R rows.

    Returns:
        (ids [R, K] int64 descending (ties to the lowest index), probs [R, K] fp32, js [R] fp32).
    """
    R, V = check_head(hidden, weight)
    _check_topk_memory(prev_ids, prev_probs, has_prev, ("hidden", hidden), f"[R, K] with R = {R} (hidden's rows) and "
                       f"1 <= K <= V = {V} (weight's rows)", R, V)
    chosen = pick("head_topk_js", impl, hidden.device)
    _check_topk_limit("head_topk_js", chosen, prev_ids)
    return call("head_topk_js", impl, chosen, hidden, weight, prev_ids, prev_probs, has_prev)


def head_step_kl(hidden: torch.Tensor, weight: torch.Tensor, prev_logits: torch.Tensor, prev_lse: torch.Tensor, *,
                 impl: str | None = None) -> tuple:
    """KLASS's step on the LM head's logits ``hidden @ weight.T`` with the memory kept as the previous step's logits
    and their logsumexp (spec: ``head_step_kl_ref``; ``step_kl`` within V·1e-12). The Triton path computes the head
    tile by tile over splits of the vocabulary and writes no distribution, only this step's logits into the memory.

    Args:
        hidden (torch.Tensor): [R, D] final-normed hidden states of the slots, fp32, fp16 or bf16; rows may be
            strided (each row contiguous).
        weight (torch.Tensor): [V, D] LM-head weight, fp32, fp16 or bf16 (the hidden dtype for the tensor-core path).
        prev_logits (torch.Tensor): [R, V] fp32 the previous step's logits, contiguous. Overwritten in place.
        prev_lse (torch.Tensor): [R] fp32 their logsumexp, +inf for a slot with no previous pass (its logits are not
            read). Overwritten in place.
        impl (str, optional): "torch" or "triton". Default: ``TRACELOCK_IMPL``, else the fastest available.

    Returns:
        (proposal [R] int64 argmax, confidence [R] fp32 max probability, kl [R] fp32).
    """
    R, V = check_head(hidden, weight)
    like = ("hidden", hidden)
    check_arg("prev_logits", prev_logits, (torch.float32,), (R, V), like)
    check_arg("prev_lse", prev_lse, (torch.float32,), (R,), like)
    return call("head_step_kl", impl, pick("head_step_kl", impl, hidden.device), hidden, weight, prev_logits,
                prev_lse)
