"""Every Triton kernel compiles for sm_90 without a GPU: ``triton.compile`` with an explicit
GPUTarget runs the real NVIDIA pipeline down to PTX and a cubin from ptxas, and so catches what the interpreter
tolerates (dot tiles with K < 16, unsupported ops, register or shared-memory overflows).

Each kernel is compiled for every constexpr specialisation its launcher can pick, with the default (first)
autotune config, plus every other autotune config on the path a bf16 model takes on a GPU. That path is compiled a
second time as a launch at the released models' shapes sees it: 16-byte aligned pointers and the sizes and strides
that are multiples of 16 marked so (triton's JIT specialises them so at launch). Only then can its loads be
pipelined (asynchronous copies into ``num_stages`` shared-memory buffers, without which a memory-bound kernel waits
on every load); the pipelined kernel must still fit sm_90's shared memory.

The compiles run in one child process without ``TRITON_INTERPRET``: under the interpreter (which tests/conftest.py
turns on) triton's own ``tl.standard`` helpers (max, argmax, sigmoid, ...) are interpreted functions, and
``triton.compile`` fails on them (triton 3.7.1). Run this file as a script to compile every case and print JSON.
"""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tracelock import _triton

pytestmark = pytest.mark.skipif(not _triton.triton_available, reason="triton is not installed")

SM = 90


# the int arguments that are multiples of 16 at LLaDA-8B's and Dream-7B's decode shapes (D 4096 / 3584, N 384,
# V 126464 / 152064, splits of 256-column multiples, row strides of D)
ALIGNED = {"_tap_project_kernel": ("D", "N", "stride_h1", "stride_h2", "stride_h3"),
           "_window_logits_stats_kernel": ("V", "D", "SPLIT_V", "stride_h"),
           # the backbone's elementwise kernels (D 4096 / 3584, F 12288 / 18944, fused q/k/v rows of 96 / 36 heads)
           "_add_rms_norm_kernel": ("D", "stride_x", "stride_r"), "_silu_mul_kernel": ("F", "stride_m"),
           "_rope_qkv_kernel": ("stride_xb", "stride_xq", "stride_cb", "stride_cq", "stride_sb", "stride_sq",
                                "stride_kb", "stride_kh", "stride_kl", "stride_vb", "stride_vh", "stride_vl"),
           # the matrix products (N 12288 / 4096 / 4608 / 3584, K 4096 / 12288 / 3584 / 18944, F 12288 / 18944)
           "_linear_rows_kernel": ("N", "K", "stride_x", "stride_r"),
           # the vocabulary-wide row passes (V 126464 / 152064, rows of V logits)
           "_credit_fuse_kernel": ("V", "stride_l"), "_step_kl_kernel": ("V", "stride_l"),
           "_topk_js_kernel": ("V", "stride_l"),
           # the same passes fused into the LM head (window_logits_stats's sizes)
           "_head_credit_fuse_kernel": ("V", "D", "SPLIT_V", "stride_h"),
           "_head_topk_js_kernel": ("V", "D", "SPLIT_V", "stride_h"),
           "_head_step_kl_kernel": ("V", "D", "SPLIT_V", "stride_h")}


def _aligned(cases: list) -> list:
    """``cases`` again as compiled for a launch at the released shapes (see the module docstring)."""
    return [dict(case, id=case["id"] + "-aligned", aligned=True) for case in cases]


def _tap_project_cases():
    from tracelock.kernels.tap_project import CONFIGS

    sizes = dict(T="i32", D="i32", N="i32", T_BUCKET="i32", stride_h1="i32", stride_h2="i32", stride_h3="i32")
    cases = []
    # fp16/bf16 taps with fp32 weights take the DOT_NATIVE=False path of fp32 (upcast after the load)
    for h, a, native in [("fp32", "fp32", False), ("bf16", "bf16", True)]:
        types = dict(H1=f"*{h}", H2=f"*{h}", H3=f"*{h}", A=f"*{a}", C="*fp32", OUT="*fp32", **sizes)
        n_configs = len(CONFIGS) if native else 1
        cases += [dict(id=f"tap_project-h{h}-A{a}-cfg{i}", module="tap_project", kernel="_tap_project_kernel",
                       types=types, constexprs=dict(DOT_NATIVE=native), config=i) for i in range(n_configs)]
    return cases + _aligned([c for c in cases if c["constexprs"]["DOT_NATIVE"]])


def _window_logits_stats_cases():
    from tracelock.kernels.window_logits_stats import CONFIGS

    sizes = dict(R="i32", V="i32", D="i32", S="i32", SPLIT_V="i32", eos_id="i32", stride_h="i32")
    parts = dict(PART_M="*fp32", PART_Z="*fp32", PART_W="*fp32", PART_T2="*fp32", PART_I1="*i64",
                 EOS_LOGIT="*fp32")
    cases = []
    # (input dtype, DOT_NATIVE, BLOCK_R, HAS_EOS, configs): the largest row tile on every path, the smallest on
    # the native one, and every autotune config where a bf16 model runs
    for dt, native, block_r, eos, n_configs in [("fp32", False, 128, True, 1), ("bf16", True, 128, True, len(CONFIGS)),
                                                ("bf16", True, 16, False, 1)]:
        types = dict(H=f"*{dt}", W=f"*{dt}", **parts, **sizes)
        constexprs = dict(HAS_EOS=eos, DOT_NATIVE=native, BLOCK_R=block_r)
        cases += [dict(id=f"window_logits_stats-{dt}-R{block_r}-eos{int(eos)}-cfg{i}", module="window_logits_stats",
                       kernel="_window_logits_stats_kernel", types=types, constexprs=constexprs, config=i)
                  for i in range(n_configs)]
    # the bf16 head as the decode launches it: 128-row tiles (B >= 4) and 32-row tiles (a window of 32 at B = 1)
    bf16 = [c for c in cases if c["constexprs"]["DOT_NATIVE"] and c["constexprs"]["BLOCK_R"] == 128]
    cases += _aligned(bf16)
    cases += _aligned([dict(c, id=c["id"].replace("-R128-", "-R32-"), constexprs=dict(c["constexprs"], BLOCK_R=32))
                       for c in bf16])
    outs = dict(PROPOSAL="*i64", MAX_PROB="*fp32", SECOND_PROB="*fp32", NEG_ENTROPY="*fp32", EOS_PROB="*fp32")
    types = dict(**parts, **outs, R="i32", S="i32")
    # the launcher's merge tiles: [rows, BLOCK_S] of at most 4096 elements, from one split up to MAX_SPLITS
    for eos, block_r, block_s in [(True, 128, 1), (False, 8, 512), (True, 1, 2)]:
        cases.append(dict(id=f"window_logits_stats_merge-eos{int(eos)}-R{block_r}-S{block_s}",
                          module="window_logits_stats", kernel="_window_logits_stats_merge_kernel", types=types,
                          constexprs=dict(HAS_EOS=eos, BLOCK_R=block_r, BLOCK_S=block_s), config=None))
    return cases


def _commit_step_cases():
    from tracelock.kernels.commit_step import BLOCK_L
    from tracelock.states import ACTIVE, EOT, LOCKED

    cases = []
    # windows of 1, 33 and 128 slots with and without a cap, one end id or none; bf16 scores once; the paper's
    # rule, the shipped one (a fallback score, held slots) and each with the end-of-text fill
    for score, block_r, cap, block_e, shipped, eot in [("fp32", 1, False, 1, False, False),
                                                       ("fp32", 64, True, 2, False, True),
                                                       ("fp32", 128, True, 1, True, False),
                                                       ("bf16", 128, False, 2, True, True),
                                                       ("fp32", 32, False, 2, True, True)]:
        types = dict(SCORE=f"*{score}", TAU=f"*{score}", FALLBACK=f"*{score}", HELD="*i1", ACTIVE_MASK="*i1",
                     PROPOSAL="*i64", POSITIONS="*i64", X="*i64", STATE="*u8", END_IDS="*i64", FIRST_ACTIVE="*i64",
                     COMMITTED="*i64", R="i32", L="i32", E="i32", m_threshold="fp32", cap="i32", fill_id="i32")
        constexprs = dict(HAS_CAP=cap, HAS_FALLBACK=shipped, HAS_HELD=shipped, STOP_AT_EOT=eot, S_ACTIVE=ACTIVE,
                          S_LOCKED=LOCKED, S_EOT=EOT, BLOCK_R=block_r, BLOCK_E=block_e, BLOCK_L=BLOCK_L)
        rule = ("shipped" if shipped else "paper") + ("-eot" if eot else "")
        cases.append(dict(id=f"commit_step-{score}-R{block_r}-cap{int(cap)}-E{block_e}-{rule}", module="commit_step",
                          kernel="_commit_step_kernel", types=types, constexprs=constexprs, config=None))
    return cases


def _vectorised(cases: list) -> list:
    """Elementwise ``cases`` (no loop to pipeline) as launched at the released shapes: aligned like `_aligned`'s, and
    checked for 16-byte loads instead of asynchronous copies."""
    return [dict(case, id=case["id"] + "-aligned", vectorised=True) for case in cases]


def _add_rms_norm_cases():
    from tracelock.kernels.add_rms_norm import num_warps_for

    cases = []
    # rows of the released widths (BLOCK_D 4096 for D 4096 and 3584) with and without the residual, in bf16 and fp32
    # (an fp32 weight on bf16 rows once), and the smallest row tile with the fewest warps
    for x, w, residual, block_d in [("bf16", "bf16", True, 4096), ("bf16", "bf16", False, 4096),
                                    ("fp32", "fp32", True, 4096), ("bf16", "fp32", True, 4096),
                                    ("fp16", "fp16", True, 64)]:
        out = "fp32" if "fp32" in (x, w) else x
        types = dict(X=f"*{x}", RES=f"*{x}", W=f"*{w}", NORMED=f"*{out}", SUMMED=f"*{x}", D="i32", stride_x="i32",
                     stride_r="i32", eps="fp32")
        cases.append(dict(id=f"add_rms_norm-{x}-w{w}-res{int(residual)}-D{block_d}", module="add_rms_norm",
                          kernel="_add_rms_norm_kernel", types=types,
                          constexprs=dict(HAS_RESIDUAL=residual, BLOCK_D=block_d), config=None,
                          options=dict(num_warps=num_warps_for(block_d))))
    return cases + _vectorised([c for c in cases if c["constexprs"]["BLOCK_D"] == 4096 and "fp32" not in c["id"]])


def _rope_qkv_cases():
    from tracelock.kernels.rope_qkv import block_heads

    cases = []
    # LLaDA (32 + 2·32 heads, rope in fp32) and Dream (28 + 2·4 heads, rope in bf16) at head_dim 128, with the cache
    # (a cached step) and without (a refresh); fp32 and fp16 once each; the smallest head
    for dt, rope_fp32, index, heads, head_dim in [("bf16", True, True, 96, 128), ("bf16", True, False, 96, 128),
                                                  ("bf16", False, True, 36, 128), ("bf16", False, False, 36, 128),
                                                  ("fp32", True, False, 96, 128), ("fp32", False, True, 36, 128),
                                                  ("fp16", False, True, 3, 2)]:
        block_h = block_heads(heads, head_dim)
        types = dict(QKV=f"*{dt}", COS="*fp32", SIN="*fp32", INDEX="*i64", Q_OUT=f"*{dt}", K_OUT=f"*{dt}",
                     V_OUT=f"*{dt}", Q="i32", H="i32", KV="i32", L_KV="i32",
                     **dict.fromkeys(["stride_xb", "stride_xq", "stride_cb", "stride_cq", "stride_sb", "stride_sq",
                                      "stride_ib", "stride_iq", "stride_kb", "stride_kh", "stride_kl", "stride_vb",
                                      "stride_vh", "stride_vl"], "i32"))
        constexprs = dict(ROPE_FP32=rope_fp32, HAS_INDEX=index, HEAD_DIM=head_dim, BLOCK_H=block_h,
                          BLOCK_HALF=max(head_dim // 2, 1))
        cases.append(dict(id=f"rope_qkv-{dt}-{'fp32' if rope_fp32 else 'dtype'}-index{int(index)}-hd{head_dim}"
                             f"-H{block_h}", module="rope_qkv", kernel="_rope_qkv_kernel", types=types,
                          constexprs=constexprs, config=None, options=dict(num_warps=4)))
    return cases + _vectorised([c for c in cases if c["types"]["QKV"] == "*bf16"])


def _silu_mul_cases():
    from tracelock.kernels.silu_mul import BLOCK_F, num_warps_for

    cases = []
    # the full column tile in each dtype, and a narrow one (F < BLOCK_F)
    for dt, block_f in [("bf16", BLOCK_F), ("fp16", BLOCK_F), ("fp32", BLOCK_F), ("bf16", 64)]:
        cases.append(dict(id=f"silu_mul-{dt}-F{block_f}", module="silu_mul", kernel="_silu_mul_kernel",
                          types=dict(GU=f"*{dt}", OUT=f"*{dt}", F="i32", stride_m="i32"),
                          constexprs=dict(BLOCK_F=block_f), config=None,
                          options=dict(num_warps=num_warps_for(block_f))))
    return cases + _vectorised([c for c in cases if c["id"] == f"silu_mul-bf16-F{BLOCK_F}"])


def _linear_rows_cases():
    from tracelock.kernels.linear_rows import CONFIGS

    def case(dt, block_m, bias, res, silu, config, aligned=False):
        types = dict(X=f"*{dt}", W=f"*{dt}", BIAS=f"*{dt}", RES=f"*{dt}", OUT=f"*{dt}", PART="*fp32", COUNT="*i32",
                     M="i32", N="i32", K="i32", stride_x="i32", stride_r="i32")
        epi = "-".join(["bias"] * bias + ["res"] * res + ["silu"] * silu) or "plain"
        return dict(id=f"linear_rows-{dt}-M{block_m}-{epi}-cfg{config}" + "-aligned" * aligned, module="linear_rows",
                    kernel="_linear_rows_kernel", types=types, aligned=aligned, config=config,
                    constexprs=dict(HAS_BIAS=bias, HAS_RES=res, SILU_MUL=silu, DOT_NATIVE=dt != "fp32",
                                    BLOCK_M=block_m))

    flags = [(b, r, s) for b in (False, True) for r in (False, True) for s in (False, True)]
    # on the bf16 path every epilogue at 16 rows and the lightest and heaviest at 32 and 64; the fp32 path (IEEE dot)
    # likewise at 16 rows (the whole grid of flags x tiles x configs took twice as long to compile, for no new path)
    cases = [case("bf16", 16, *f, 0) for f in flags] + [case("fp32", 16, *f, 0) for f in (flags[0], flags[-1])]
    cases += [case("bf16", m, *f, 0) for m in (32, 64) for f in (flags[0], flags[-1])]
    # as the released shapes launch them: the o/down products (residual) and gate/up (silu_mul), every config at
    # every row tile
    return cases + [case("bf16", m, False, not s, s, i, aligned=True) for m in (16, 32, 64) for s in (False, True)
                    for i in range(len(CONFIGS))]


def _row_pass_cases(module: str, kernel: str, types, constexprs: dict) -> list:
    """A vocabulary-wide row pass (one program per row): ``types(dt)`` for bf16, fp16 and fp32 logits at the
    launcher's full tile, bf16 at a narrow one (a small vocabulary), and bf16 and fp32 again as launched at the
    released shapes (16-byte loads, no spills)."""
    from tracelock.kernels.credit_fuse import BLOCK_V, num_warps_for

    cases = [dict(id=f"{module}-{dt}-V{block_v}", module=module, kernel=kernel, types=types(dt),
                  constexprs=dict(constexprs, BLOCK_V=block_v), config=None,
                  options=dict(num_warps=num_warps_for(block_v)))
             for dt, block_v in [("bf16", BLOCK_V), ("fp16", BLOCK_V), ("fp32", BLOCK_V), ("bf16", 64)]]
    full = (f"{module}-bf16-V{BLOCK_V}", f"{module}-fp32-V{BLOCK_V}")
    return cases + _vectorised([c for c in cases if c["id"] in full])


def _credit_fuse_cases():
    def types(dt):
        return dict(LOGITS=f"*{dt}", CREDIT="*fp32", BOOST="*i1", FRESH="*i1", PROPOSAL="*i64", CONFIDENCE="*fp32",
                    V="i32", stride_l="i32", alpha="fp32", gamma="fp32", beta="fp32")

    return _row_pass_cases("credit_fuse", "_credit_fuse_kernel", types, {})


def _step_kl_cases():
    def types(dt, prev="fp32"):
        return dict(LOGITS=f"*{dt}", PREV=f"*{prev}", PROPOSAL="*i64", CONFIDENCE=f"*{prev}", KL=f"*{prev}", V="i32",
                    stride_l="i32")

    cases = _row_pass_cases("step_kl", "_step_kl_kernel", types, {})
    # prev in fp64 (the spec's dtype) computes in fp64
    return cases + [dict(cases[0], id=cases[0]["id"] + "-prev-fp64", types=types("bf16", "fp64"))]


def _topk_js_cases():
    def types(dt):
        return dict(LOGITS=f"*{dt}", PREV_IDS="*i64", PREV_PROBS="*fp32", HAS_PREV="*i1", IDS="*i64", PROBS="*fp32",
                    JS="*fp32", V="i32", K="i32", stride_l="i32")

    # K = 8 (LESS's); BLOCK_K 1 (K = 1) and 16 (K = 13, padded) once each
    cases = _row_pass_cases("topk_js", "_topk_js_kernel", types, dict(BLOCK_K=8))
    return cases + [dict(cases[0], id=cases[0]["id"] + f"-BK{k}", constexprs=dict(cases[0]["constexprs"], BLOCK_K=k))
                    for k in (1, 16)]


def _head_cases(module: str, types, constexprs: dict, merge_types: dict, merge_constexprs: list) -> list:
    """A vocabulary pass fused into the LM head: its split kernel (``types(dt)``) on the fp32 path at 64 rows (its
    largest row tile) and on the bf16 path at 64 and 16 rows with every autotune config, the bf16 64- and 32-row
    tiles again as launched at the released shapes (pipelined, no spills); its merge at each of ``merge_constexprs``."""
    configs = len(importlib.import_module(f"tracelock.kernels.{module}").CONFIGS)
    kernel = f"_{module}_kernel"
    cases = []
    paths = [("fp32", False, 64, 1), ("bf16", True, 64, configs), ("bf16", True, 16, 1)]
    for dt, native, block_r, n_configs in paths:
        cases += [dict(id=f"{module}-{dt}-R{block_r}-cfg{i}", module=module, kernel=kernel, types=types(dt),
                       constexprs=dict(constexprs, DOT_NATIVE=native, BLOCK_R=block_r), config=i)
                  for i in range(n_configs)]
    bf16 = [c for c in cases if c["constexprs"]["DOT_NATIVE"] and c["constexprs"]["BLOCK_R"] == 64]
    cases += _aligned(bf16)
    cases += _aligned([dict(c, id=c["id"].replace("-R64-", "-R32-"), constexprs=dict(c["constexprs"], BLOCK_R=32))
                       for c in bf16])
    for extra in merge_constexprs:
        cases.append(dict(id=f"{module}_merge-" + "-".join(f"{k}{v}" for k, v in extra.items()), module=module,
                          kernel=f"_{module}_merge_kernel", types=merge_types, constexprs=extra, config=None))
    return cases


# the launchers' merge tiles: [rows, BLOCK_S] of at most 4096 elements, from one split up to MAX_SPLITS
_MERGE_TILES = [dict(BLOCK_R=128, BLOCK_S=1), dict(BLOCK_R=8, BLOCK_S=512), dict(BLOCK_R=1, BLOCK_S=2)]
_SPLIT_SIZES = dict(R="i32", V="i32", D="i32", S="i32", SPLIT_V="i32", stride_h="i32")


def _head_credit_fuse_cases():
    f32 = ("PART_M1", "PART_Z1", "PART_F1", "PART_M2", "PART_Z2")
    parts = dict(dict.fromkeys(f32, "*fp32"), PART_I1="*i64", PART_I2="*i64")

    def types(dt):
        return dict(H=f"*{dt}", W=f"*{dt}", CREDIT="*fp32", FRESH="*i1", **parts, **_SPLIT_SIZES, alpha="fp32",
                    beta="fp32")

    merge = dict(**parts, CREDIT="*fp32", BOOST="*i1", PROPOSAL="*i64", CONFIDENCE="*fp32", R="i32", V="i32", S="i32",
                 alpha="fp32", gamma="fp32")
    return _head_cases("head_credit_fuse", types, {}, merge, _MERGE_TILES)


def _head_topk_js_cases():
    def types(dt):
        return dict(H=f"*{dt}", W=f"*{dt}", PART_M="*fp32", PART_Z="*fp32", PART_V="*fp32", PART_I="*i64",
                    **_SPLIT_SIZES, K="i32")

    merge = dict(PART_M="*fp32", PART_Z="*fp32", PART_V="*fp32", PART_I="*i64", PREV_IDS="*i64", PREV_PROBS="*fp32",
                 HAS_PREV="*i1", IDS="*i64", PROBS="*fp32", JS="*fp32", V="i32", K="i32", S="i32")
    # K = 8 (LESS's) from one split up to the most the merge takes (4096 candidates), and K = 1
    tiles = [dict(BLOCK_K=8, BLOCK_S=1, BLOCK_C=8), dict(BLOCK_K=8, BLOCK_S=512, BLOCK_C=4096),
             dict(BLOCK_K=1, BLOCK_S=4, BLOCK_C=4)]
    return _head_cases("head_topk_js", types, dict(BLOCK_K=8), merge, tiles)


def _head_step_kl_cases():
    def types(dt):
        return dict(H=f"*{dt}", W=f"*{dt}", PREV_LOGITS="*fp32", PREV_LSE="*fp32", PART_M="*fp32", PART_Z="*fp32",
                    PART_A="*fp32", PART_I="*i64", **_SPLIT_SIZES)

    merge = dict(PART_M="*fp32", PART_Z="*fp32", PART_A="*fp32", PART_I="*i64", PREV_LSE="*fp32", PROPOSAL="*i64",
                 CONFIDENCE="*fp32", KL="*fp32", R="i32", S="i32")
    return _head_cases("head_step_kl", types, {}, merge, _MERGE_TILES)


def cases() -> list[dict]:
    """Every (kernel, specialisation, config) to compile, as plain data the child process can rebuild."""
    return (_tap_project_cases() + _window_logits_stats_cases() + _commit_step_cases() + _add_rms_norm_cases()
            + _rope_qkv_cases() + _silu_mul_cases() + _linear_rows_cases() + _credit_fuse_cases() + _step_kl_cases()
            + _topk_js_cases() + _head_credit_fuse_cases() + _head_topk_js_cases() + _head_step_kl_cases())


def _ptxas() -> str | None:
    """The ptxas triton uses: TRITON_PTXAS_PATH, the one bundled in the triton wheel, or one on PATH."""
    import shutil

    if os.environ.get("TRITON_PTXAS_PATH"):
        return os.environ["TRITON_PTXAS_PATH"]
    bundled = Path(_triton.triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return str(bundled) if bundled.exists() else shutil.which("ptxas")


def compile_case(case: dict) -> dict:
    """Compile one case for sm_90 in this (non-interpreting) process; returns what the tests check."""
    import importlib

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    module = importlib.import_module(f"tracelock.kernels.{case['module']}")
    fn = getattr(module, case["kernel"])
    # autotune and heuristics wrap the JITFunction
    while not isinstance(fn, JITFunction):
        fn = fn.fn
    values = dict(case["constexprs"])
    options = dict(case.get("options") or {})
    if case.get("config") is not None:
        config = module.CONFIGS[case["config"]]
        values.update(config.kwargs)
        options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    missing = set(fn.arg_names) - set(case["types"]) - set(values)
    if missing:
        return dict(error=f"no type or value given for {sorted(missing)}")
    signature = {name: case["types"].get(name, "constexpr") for name in fn.arg_names}
    attrs = {}
    if case.get("aligned") or case.get("vectorised"):
        attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
                 if case["types"].get(name, "").startswith("*") or name in ALIGNED[case["kernel"]]}
    src = ASTSource(fn=fn, signature=signature, constexprs={(fn.arg_names.index(k),): v for k, v in values.items()},
                    attrs=attrs)
    try:
        compiled = _triton.triton.compile(src, target=GPUTarget("cuda", SM, 32), options=options)
    except Exception as err:  # the report carries the compiler's message to the failing test
        return dict(error=f"{type(err).__name__}: {err}")
    out = dict(ptx_target=f".target sm_{SM}" in compiled.asm["ptx"], cubin_bytes=len(compiled.asm["cubin"]),
               wgmma="warp_group_dot" in compiled.asm["ttgir"], shared=compiled.metadata.shared,
               async_copies=compiled.asm["ttgir"].count("async_copy_global_to_local"))
    if case.get("aligned") or case.get("vectorised"):
        out.update(_registers(compiled.asm["ptx"]))
    if case.get("vectorised"):
        out.update(_elementwise(compiled.asm["ptx"]))
    return out


def _elementwise(ptx: str) -> dict:
    """16-byte global loads, fp32 multiplies, and FMAs that add something other than +0 (a multiply contracted into
    an add) in a kernel's PTX."""
    import re

    fmas = re.findall(r"\bfma\.rn\.f32\s+[^;]*?,\s*([^,;]+);", ptx)
    return dict(vector_loads=len(re.findall(r"\bld\.global(?:\.[\w:]+)*\.v4\.b32", ptx)),
                f32_muls=len(re.findall(r"\bmul(?:\.rn)?\.f32\b", ptx)),
                contracted_fmas=sum(addend.strip() != "0f00000000" for addend in fmas))


def _registers(ptx: str) -> dict:
    """Registers per thread and bytes of spill stores of a kernel's PTX, from ``ptxas -v`` for sm_90a."""
    import re
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.ptx"
        path.write_text(ptx)
        done = subprocess.run([_ptxas(), f"-arch=sm_{SM}a", "-v", str(path), "-o", str(Path(tmp) / "kernel.cubin")],
                              capture_output=True, text=True, timeout=300)
    report = done.stdout + done.stderr
    registers, spills = re.search(r"Used (\d+) registers", report), re.search(r"(\d+) bytes spill stores", report)
    return dict(registers=int(registers.group(1)) if registers else None,
                spill_stores=int(spills.group(1)) if spills else None)


@pytest.fixture(scope="module")
def compiled():
    if _ptxas() is None:
        pytest.skip("ptxas is unavailable: triton's wheel bundles it; set TRITON_PTXAS_PATH or reinstall triton")
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("case", cases(), ids=lambda c: c["id"])
def test_kernel_compiles_sm90(compiled, case):
    got = compiled[case["id"]]
    assert "error" not in got, got.get("error")
    assert got["ptx_target"] and got["cubin_bytes"] > 0
    # H100/H200 shared memory per block is 227 KiB
    assert got["shared"] <= 227 * 1024


# 4 warps holding a 128 x 128 fp32 tile and its epilogue: ptxas spills about 1 KB; autotuning times it beside the rest
SPILLS_KNOWN = {"window_logits_stats-bf16-R128-eos1-cfg2-aligned"}


@pytest.mark.parametrize("case", [c for c in cases() if c.get("aligned")], ids=lambda c: c["id"])
def test_aligned_loads_are_pipelined(compiled, case):
    # at the released shapes every tile load of the main loop is an asynchronous copy into one of num_stages
    # buffers (triton 3.7 copies each tile in its own piece; an unpipelined loop has none)
    got = compiled[case["id"]]
    assert got["async_copies"] > 0
    # and no register spills (ptxas -v), but for the one config known to spill
    assert got["registers"] and got["registers"] <= 255
    assert (got["spill_stores"] > 0) == (case["id"] in SPILLS_KNOWN), got


@pytest.mark.parametrize("case_id", ["tap_project-hbf16-Abf16-cfg0", "window_logits_stats-bf16-R128-eos1-cfg0"])
def test_lowp_dots_use_wgmma(compiled, case_id):
    # 16-bit tiles with at least 64 rows go to Hopper's warp-group MMA with the default config
    assert compiled[case_id]["wgmma"]


def test_linear_rows_swap_ab_uses_wgmma_at_16_rows(compiled):
    # SWAP_AB makes the weight tile the MMA's 64-row operand, so Hopper's warp-group MMA runs at any M; without it
    # the 16-row x tile takes the older mma.sync path
    from tracelock.kernels.linear_rows import CONFIGS

    for i, config in enumerate(CONFIGS):
        got = compiled[f"linear_rows-bf16-M16-res-cfg{i}-aligned"]
        assert got["wgmma"] == config.kwargs["SWAP_AB"], (i, got)


@pytest.mark.parametrize("case", [c for c in cases() if c.get("vectorised")], ids=lambda c: c["id"])
def test_elementwise_loads_are_vectorised(compiled, case):
    # at the released shapes the elementwise kernels load their rows 16 bytes at a time, without register spills
    got = compiled[case["id"]]
    assert got["vector_loads"] > 0, got
    assert got["registers"] and got["registers"] <= 255 and got["spill_stores"] == 0, got


@pytest.mark.parametrize("case", [c for c in cases() if c.get("vectorised") and c["module"] == "rope_qkv"],
                         ids=lambda c: c["id"])
def test_rope_products_are_rounded_one_by_one(compiled, case):
    # the spec rounds each product before the sum; a contracted multiply-add would round once (mul_rn prevents it)
    got = compiled[case["id"]]
    assert got["f32_muls"] == 0 and got["contracted_fmas"] == 0, got


if __name__ == "__main__":
    print(json.dumps({case["id"]: compile_case(case) for case in cases()}))
