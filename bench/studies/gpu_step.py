"""One decode step on one GPU: where its time goes, the two Triton kernels against their roofline, and TraceLock's own
step against the bare step (bench/studies/gpu_step_session.sh runs it; quantized weights: bench/studies/gpu_quant.py).

At a released model's shape (``--shape``, default LLaDA-8B) with random bf16 weights, B = 1, gen 256, blocks of 32,
Fast-dLLM's threshold 0.9 with the dual cache (the setting of bench/studies/gpu_decode.py), three stages, each guarded
(an error is recorded in its place and the next stage runs) and each skipped, with the reason, when the time budget
(``--budget`` seconds) has less left than it needs:

1. ``profile``: torch.profiler around one refresh step and one cached step of the engine run uncompiled (every kernel
   launched on its own, so each is seen; a CUDA-graph replay runs the same kernels without the launch gaps): per
   kernel its time, calls, the bytes its launching op reads where they follow from the op's input shapes (matrix
   products, attention, the Triton head), the achieved GB/s and share of the card's bandwidth, its share of the
   step's kernel time; the same table as markdown in ``profile-<shape>.md``. Beside it the steps' medians with the
   steps captured as CUDA graphs, so kernel time and step time can be compared;
2. ``kernels``: ``window_logits_stats`` (R = B x 32 window rows against the whole LM head) and ``tap_project``
   (T = B x 384 canvas rows, a controller fold of the shipped architecture) at B = 1, 8, 32: time per call, bytes and
   FLOPs each must move, the roofline time (the larger of bytes / bandwidth and FLOPs / bf16 peak: which bound),
   the share of it reached, the autotune config chosen; cuBLAS's ``hidden @ weight.T`` at the head's shape beside it;
3. ``tracelock_step``: an untrained controller of the shipped architecture (hidden 4096 at LLaDA-8B) in the engine,
   window 32 with the dual cache, under the shipped commit rule (hold_end, confidence fallback; the paper's rule
   beside it), against the confidence rule's bare step on the same engine setting (CUDA graphs; goal 1.05x), and
   the commit kernel's own time per step (checked against its spec first).

``--dry-run`` runs every stage on the CPU at the micro checkpoint's shape (no bandwidth; the Triton kernels under
``TRITON_INTERPRET=1``, else their torch specs; CPU ops in place of kernels in the profile):
tests/test_gpu_decode_script.py. The JSON (``gpu-step-<shape>.json``) is rewritten atomically after every stage, so
a run cut off keeps what it measured.

    python bench/studies/gpu_step.py --out DIR [--shape llada-8b|dream-7b] [--budget SECONDS] [--dry-run]
"""

import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import gpu_decode  # noqa: E402  (bench/studies/gpu_decode.py)
from gpu_stages import (  # noqa: E402
    Budget,
    ceilings,
    log,
    roofline,
    run_stage,
    study_parser,
    time_call,
    timed_steps,
)
from profile_table import kernel_rows, kernel_table, markdown  # noqa: E402

from tracelock import ops  # noqa: E402
from tracelock.atomic import atomic_write_text  # noqa: E402

# ---- 1. profile -------------------------------------------------------------------------------------------------


def head_bytes(model, rows: int) -> int:
    """What ``window_logits_stats`` reads on ``rows`` rows: the LM head's weight once and the hidden rows."""
    V, D = model.lm_head.weight.shape
    return (V * D + rows * D) * model.lm_head.weight.element_size()


def profile_stage(model, prompt, settings, device, bandwidth) -> dict:
    """torch.profiler around the first refresh step and the first cached step of one decode (engine uncompiled),
    after three warm-up steps (autotune, cuBLAS heuristics); plus the steps' medians as CUDA graphs."""
    from torch.profiler import ProfilerActivity, profile

    engine = gpu_decode._engine(model, [prompt], settings, False)
    engine.admit(prompt)
    for _ in range(3):  # a refresh and cached steps
        engine.step()
    engine.reset()
    engine.admit(prompt)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    width = settings.get("block") or settings.get("window")
    out = {}
    for kind, wall, prof in timed_steps(engine, device, lambda: profile(activities=activities, record_shapes=True)):
        if kind in out:
            continue
        live = engine.last_step[0]
        # the head's rows: the window's on a cached step; a refresh step scores its window rows too
        rows, what = kernel_rows(prof.events(), {"window_logits_stats_kernel": head_bytes(model, width)},
                                 model.lm_head.weight.element_size())
        summary = kernel_table(rows, bandwidth)
        summary.update(wall_seconds=wall, rows=what, live=live)
        summary["markdown"] = markdown(f"{kind} step", summary)
        out[kind] = summary
        if len(out) == 2:
            break
    del engine
    if device.type == "cuda":
        torch.cuda.empty_cache()
        out["graphs"] = steps_over_floor(model, prompt, settings, device, "cudagraphs")
    return out


def steps_over_floor(model, prompt, settings, device, mode) -> dict:
    """The engine's step medians (`gpu_decode.time_engine_steps`) at B = 1 and, on a known card, the cached step
    over the read floor, the weights and the row's KV cache (the goal: <= 1.3x)."""
    out = gpu_decode.time_engine_steps(model, [prompt], settings, device, mode)
    floor = gpu_decode.weight_floor(model, device, 1, len(prompt) + settings["gen_length"]).get("floor_seconds")
    if floor:
        out.update(floor_seconds=floor, cached_over_floor=out["cached_step_median"] / floor)
    return out


# ---- 2. kernels at real shapes ------------------------------------------------------------------------------------

def untrained_tracelock(model, **rule):
    """A TraceLock policy with an untrained controller of the shipped architecture on ``model``'s hidden size (PCA
    encoders of 256 and 32 codes fitted on random samples), with the commit ``rule`` (`TraceLockPolicy`'s hold_end
    and fallback; default the paper's): timing only, its decisions mean nothing."""
    from tracelock.controller import Controller, ControllerConfig, controller_fingerprint
    from tracelock.features import LinearEncoder, TapEncoder, backbone_fingerprint
    from tracelock.policies.tracelock import TraceLockPolicy

    D = model.spec.hidden_size
    samples = torch.randn(1024, D, generator=torch.Generator().manual_seed(0))
    encoder = TapEncoder(LinearEncoder.fit_pca(samples, min(256, D)), LinearEncoder.fit_pca(samples, min(32, D)),
                         backbone_fingerprint(model))
    torch.manual_seed(0)
    config = ControllerConfig(code_dim=encoder.code_dim, groups=encoder.groups,
                              fingerprint=controller_fingerprint(model, encoder))
    return TraceLockPolicy(Controller(config).eval(), encoder=encoder, **rule)


def _autotune_choice(kernel) -> str | None:
    best = getattr(kernel, "best_config", None)
    return None if best is None else str(best)


def _head_row(model, R, impl, g, device, bandwidth, flop_rate) -> dict:
    """``window_logits_stats`` on ``R`` random rows: checked against its spec, timed, against its roofline; cuBLAS's
    ``hidden @ weight.T`` (the logits written, no statistics) at the same shape beside it."""
    from tracelock.kernels.ref import window_logits_stats_ref

    weight, eos = model.lm_head.weight, model.spec.eos_id
    V, D = weight.shape
    hidden = torch.randn(R, D, generator=g, device=device, dtype=weight.dtype)
    ref = window_logits_stats_ref(hidden, weight, eos)
    got = ops.window_logits_stats(hidden, weight, eos, impl=impl)
    seconds = time_call(lambda: ops.window_logits_stats(hidden, weight, eos, impl=impl), device)
    row = dict(R=R, V=V, D=D, proposal_agreement=(ref[0] == got[0]).float().mean().item(),
               **roofline(head_bytes(model, R) + 5 * R * 4, 2 * R * V * D, seconds, bandwidth, flop_rate))
    if impl == "triton":
        from tracelock.kernels import window_logits_stats as kernel

        row["config"] = _autotune_choice(kernel._window_logits_stats_kernel)
        row["each_config"] = [
            _config_row(str(cfg), lambda i=i: kernel.window_logits_stats_triton(hidden, weight, eos, config=i),
                        lambda out: dict(proposal_agreement=(out[0] == ref[0]).float().mean().item()), row, device,
                        bandwidth, flop_rate) for i, cfg in enumerate(kernel.CONFIGS)]
    cublas = time_call(lambda: hidden @ weight.T, device)
    row["cublas_mm"] = roofline(head_bytes(model, R) + R * V * weight.element_size(), 2 * R * V * D, cublas,
                                bandwidth, flop_rate)
    return row


def _tap_row(model, T, A, c, impl, g, device, bandwidth, flop_rate) -> dict:
    """``tap_project`` on ``T`` random rows of three taps: checked against its spec, timed, against its roofline."""
    from tracelock.kernels.ref import tap_project_ref

    D, N = A.shape[1], A.shape[2]
    taps = [torch.randn(T, D, generator=g, device=device, dtype=model.dtype) for _ in range(3)]
    ref = tap_project_ref(*taps, A, c)
    close = torch.allclose(ops.tap_project(*taps, A, c, impl=impl), ref, rtol=2e-2, atol=2e-2)
    seconds = time_call(lambda: ops.tap_project(*taps, A, c, impl=impl), device)
    row = dict(T=T, D=D, N=N, matches_spec=close,
               **roofline(3 * T * D * taps[0].element_size() + 3 * D * N * A.element_size() + T * N * 4,
                          2 * 3 * T * D * N, seconds, bandwidth, flop_rate))
    if impl == "triton":
        from tracelock.kernels.tap_project import CONFIGS, _tap_project_kernel, tap_project_triton

        row["config"] = _autotune_choice(_tap_project_kernel)
        row["each_config"] = [
            _config_row(str(cfg), lambda i=i: tap_project_triton(*taps, A, c, config=i),
                        lambda out: dict(matches_spec=torch.allclose(out, ref, rtol=2e-2, atol=2e-2)), row, device,
                        bandwidth, flop_rate) for i, cfg in enumerate(CONFIGS)]
    return row


def _config_row(name: str, fn, check, row: dict, device, bandwidth, flop_rate) -> dict:
    """One autotune config of a kernel, its output checked against the spec's (``check``) and then timed on its own
    (what the next tiling change starts from)."""
    try:
        return dict(config=name, **check(fn()), **roofline(row["bytes"], row["flops"], time_call(fn, device, calls=10),
                                                           bandwidth, flop_rate))
    except Exception as err:  # a config the card cannot run (shared memory): recorded, the others still timed
        return dict(config=name, error=f"{type(err).__name__}: {err}"[:300])


def kernels_stage(model, batches, width, canvas, device, bandwidth, flop_rate) -> dict:
    """Each kernel at the decode's shapes (B x ``width`` head rows, B x ``canvas`` tap rows), Triton on a GPU (in a
    dry run under the interpreter when TRITON_INTERPRET=1 is set, else the torch specs), checked against its spec
    before it is timed, then each of its autotune configs timed on its own."""
    from tracelock import _triton

    impl = "triton" if device.type == "cuda" or _triton.triton_interpret else "torch"
    g = torch.Generator(device=device).manual_seed(0)
    A, c = untrained_tracelock(model).tap_fold(model)
    A = A.to(model.dtype) if device.type == "cuda" else A  # the tensor-core path takes A in the taps' dtype
    out = dict(impl=impl, head=[], taps=[])
    for B in batches:
        out["head"].append(dict(B=B, **_head_row(model, B * width, impl, g, device, bandwidth, flop_rate)))
        log("window_logits_stats", {k: v for k, v in out["head"][-1].items() if k != "cublas_mm"})
        out["taps"].append(dict(B=B, **_tap_row(model, B * canvas, A, c, impl, g, device, bandwidth, flop_rate)))
        log("tap_project", out["taps"][-1])
    return out


# ---- 3. TraceLock's step in the engine ----------------------------------------------------------------------------

# the shipped controllers' commit rule (hold the end of text, fall back to the backbone's confidence)
SHIPPED_RULE = dict(hold_end=True, fallback="confidence")


def commit_kernel_row(B, width, length, device) -> dict:
    """``ops.commit_step`` with the shipped rule (a fallback score, held slots, the end-of-text fill) on one step's
    slots: B rows of ``width`` slots on a canvas of ``length``, checked against its spec, then timed per call."""
    from tracelock.kernels.ref import commit_step_ref
    from tracelock.states import ACTIVE

    g = torch.Generator(device=device).manual_seed(0)
    score = torch.randn(B, width, device=device, generator=g)
    tau = torch.zeros(B, device=device)
    confidence = torch.rand(B, width, device=device, generator=g)
    held = torch.rand(B, width, device=device, generator=g) < 0.1
    positions = (length - width + torch.arange(width, device=device)).expand(B, -1).contiguous()
    active = torch.ones(B, width, dtype=torch.bool, device=device)
    proposal = torch.randint(0, 1000, (B, width), device=device, generator=g)
    x = torch.zeros(B, length, dtype=torch.long, device=device)
    state = torch.full((B, length), ACTIVE, dtype=torch.uint8, device=device)
    end_ids = torch.tensor([1, 2], device=device)
    rule = dict(fallback_score=confidence, held=held, fill_id=0, stop_at_eot=True)

    def call(xs, ss):
        return ops.commit_step(score, tau, active, proposal, positions, xs, ss, end_ids, 0.9, 0, **rule)

    want_x, want_state = x.clone(), state.clone()
    want = commit_step_ref(score, tau, active, proposal, positions, want_x, want_state, end_ids, 0.9, 0, **rule)
    got_x, got_state = x.clone(), state.clone()
    got = call(got_x, got_state)
    same = all(torch.equal(a, b) for a, b in zip((want_x, want_state, *want), (got_x, got_state, *got)))
    if not same:
        raise AssertionError("commit_step differs from commit_step_ref; not timed")
    seconds = time_call(lambda: call(x.clone(), state.clone()), device)
    copies = time_call(lambda: (x.clone(), state.clone()), device)  # what the timing's canvas resets cost alone
    return dict(B=B, width=width, length=length, checked_against_spec=True, seconds_per_call=seconds - copies)


def tracelock_step_stage(model, prompt, gen, width, device, mode) -> dict:
    """Step medians of the engine (``mode``) with TraceLock's untrained controller under the shipped commit rule
    against the confidence rule's bare step, both in a window of ``width`` with the dual cache, B = 1 (goal: at most
    1.05x); the paper's rule beside it; and the commit kernel's own time per step."""
    common = dict(gen_length=gen, window=width, cache="dual")
    out = dict(commit_rule=SHIPPED_RULE)

    def steps(policy, engine_mode):
        return gpu_decode.time_engine_steps(model, [prompt], dict(common, policy=policy), device, engine_mode)

    try:
        ours = steps(untrained_tracelock(model, **SHIPPED_RULE), mode)
    except Exception as err:  # recorded; the uncompiled engine still gives the ratio
        out[f"error_{mode}"] = f"{type(err).__name__}: {err}"[:500]
        mode = False
        ours = steps(untrained_tracelock(model, **SHIPPED_RULE), mode)
    bare = steps("confidence", mode)
    paper = steps(untrained_tracelock(model), mode)
    out.update(settings=common, engine_mode=mode, bare=bare, tracelock=ours, tracelock_paper_rule=paper,
               cached_ratio=ours["cached_step_median"] / bare["cached_step_median"],
               cached_ratio_paper_rule=paper["cached_step_median"] / bare["cached_step_median"])
    out["cached_ratio_goal_1_05_met"] = out["cached_ratio"] <= 1.05
    if bare["refresh_step_median"] and ours["refresh_step_median"]:
        out["refresh_ratio"] = ours["refresh_step_median"] / bare["refresh_step_median"]
    out["commit_kernel"] = commit_kernel_row(1, width, len(prompt) + gen, device)
    return out


def main(argv=None):
    parser = study_parser(__doc__, 150.0, out="folder for the JSON and the markdown (created)")
    args = parser.parse_args(argv)
    budget = Budget(args.budget)
    model, _, label, (gen, block, prompt_len, batches) = gpu_decode.start_run(args)
    prompt = gpu_decode.random_prompts(model, 1, prompt_len)[0]
    settings = dict(gpu_decode.RULE, gen_length=gen, block=block)
    device = model.device
    card, bandwidth, flop_rate = ceilings(device)
    mode = False if args.dry_run else "cudagraphs"
    result = dict(shape=label, device=torch.cuda.get_device_name(device) if device.type == "cuda" else
                  platform.processor() or platform.machine(), card=card, bandwidth=bandwidth, bf16_peak=flop_rate,
                  torch=torch.__version__, settings=settings, prompt_length=prompt_len, budget_seconds=args.budget,
                  floor=gpu_decode.weight_floor(model, device, 1, prompt_len + gen))
    path = Path(args.out) / f"gpu-step-{args.shape}{'-dry-run' if args.dry_run else ''}.json"

    def save():
        atomic_write_text(path, json.dumps(result, indent=2, default=str) + "\n")

    save()
    log("floor", result["floor"])
    run_stage(result, "profile", lambda: profile_stage(model, prompt, settings, device, bandwidth), save, budget, 25)
    if isinstance(result["profile"], dict) and "cached" in result["profile"]:
        md = Path(args.out) / f"profile-{args.shape}{'-dry-run' if args.dry_run else ''}.md"
        atomic_write_text(md, f"## One decode step, {label}, {result['device']}\n\n" + "\n".join(
            result["profile"][k]["markdown"] for k in ("refresh", "cached") if k in result["profile"]))
        log(result["profile"]["cached"]["markdown"])
    run_stage(result, "kernels", lambda: kernels_stage(model, batches, block, prompt_len + gen, device, bandwidth,
                                                       flop_rate), save, budget, 20)
    run_stage(result, "tracelock_step", lambda: tracelock_step_stage(model, prompt, gen, block, device, mode), save,
              budget, 40)
    log("wrote", path)
    return result


if __name__ == "__main__":
    main()
