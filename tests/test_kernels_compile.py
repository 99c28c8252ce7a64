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
           "_window_logits_stats_kernel": ("V", "D", "SPLIT_V", "stride_h")}


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


def cases() -> list[dict]:
    """Every (kernel, specialisation, config) to compile, as plain data the child process can rebuild."""
    return _tap_project_cases() + _window_logits_stats_cases() + _commit_step_cases()


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
    options = {}
    if case.get("config") is not None:
        config = module.CONFIGS[case["config"]]
        values.update(config.kwargs)
        options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    missing = set(fn.arg_names) - set(case["types"]) - set(values)
    if missing:
        return dict(error=f"no type or value given for {sorted(missing)}")
    signature = {name: case["types"].get(name, "constexpr") for name in fn.arg_names}
    attrs = {}
    if case.get("aligned"):
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
    if case.get("aligned"):
        out.update(_registers(compiled.asm["ptx"]))
    return out


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


if __name__ == "__main__":
    print(json.dumps({case["id"]: compile_case(case) for case in cases()}))
