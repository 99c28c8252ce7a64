"""Per-step cost: the bare backbone forward vs a TraceLock step (taps + controller + commit), in one group.

Both rows spend the same number of forwards n (the TraceLock decode's): ``bare-forward`` runs n plain forwards of
the decode's canvas with the LM head on the window's slots (the least any decoder does per step), ``tracelock``
the fused decode itself, so their medians divide to the per-step ratio.
"""

import pytest
import torch

import tracelock
from tracelock.decode.canvas import prepare_canvas


def _bare_forwards(model, prompts, gen_length, width, n):
    canvas = prepare_canvas(model.spec, prompts, None, gen_length, model.device)
    positions = (canvas.prompt_len + torch.arange(width, device=model.device)).expand(len(prompts), -1)
    out = None
    for _ in range(n):
        out = model.predict(canvas.x, positions, canvas.attention_mask)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("row", ["bare-forward", "tracelock"])
def test_step(request, benchmark, target, controller, machine, decoded, policy_kwargs, row):
    kwargs = policy_kwargs("tracelock")
    # check before timing: the fused TraceLock decode equals the reference loop's (fp32) and fixes n
    ref_tokens, ref_stats = decoded("reference", "tracelock")
    tokens, stats = decoded("fused", "tracelock")
    if target.float32:
        assert torch.equal(tokens, ref_tokens) and stats.steps == ref_stats.steps
    n = stats.forwards
    if row == "bare-forward":
        out = _bare_forwards(target.model, target.prompts, target.gen_length, target.block, 1)
        assert out.logits.shape == (target.batch, target.block, target.model.spec.vocab_size)
        body = lambda: _bare_forwards(target.model, target.prompts, target.gen_length, target.block, n)  # noqa: E731
    else:
        body = lambda: tracelock.fused_generate(target.model, target.prompts, **kwargs)  # noqa: E731

    if benchmark.disabled:
        return  # smoke run: both bodies just ran above (one forward; the checked decode); --benchmark times them
    B = target.batch
    benchmark.group = f"step-{target.name}-B{B}-gen{target.gen_length}-window{target.block}-forwards{n}"
    benchmark.extra_info.update(machine, row=row, forwards=n, items=B, controller=controller[1])
    benchmark.pedantic(body, rounds=request.config.getoption("--bench-rounds"), warmup_rounds=1)
