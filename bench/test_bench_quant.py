"""Weight-only int8 (`load_model(quantize="int8")`, torchao) against full-precision fp32 weights on the CPU: the
bundled models decoding 8 validation math prompts, 64 tokens in blocks of 16 with Fast-dLLM's threshold 0.9 and the
dual cache, in the engine (eager; inductor with ``--benchmark`` only, its compile takes minutes here). Before timing,
each model's engine is checked against its own `fused_generate` (tokens and steps), and the share of answers int8
decodes to the same tokens as fp32 goes into extra_info; then the two are timed in alternating rounds and the ratio
of their medians is recorded (``pytest bench/test_bench_quant.py --benchmark``; without the flag each body runs once).
"""

import statistics
import time

import pytest
import torch

import tracelock
from tracelock.decode.engine import DecodeEngine, prompt_bucket
from tracelock.testbed import held_out

pytest.importorskip("torchao", reason="the quant extra is not installed (pip install tracelock[quant])")

ITEMS, GEN, BLOCK = 8, 64, 16
SETTING = dict(policy="threshold", policy_args={"tau": 0.9}, gen_length=GEN, block=BLOCK, cache="dual")


@pytest.fixture(scope="module", params=["testbed", "testbed-dream"])
def bundled(request):
    name = request.param
    tok = tracelock.load_tokenizer(name)
    prompts = [tok(e.prompt, add_special_tokens=False)["input_ids"] for e in held_out("math", "validation", ITEMS)]
    models = {"fp32": tracelock.load_model(name), "int8": tracelock.load_model(name, quantize="int8")}
    return name, models, prompts


def _engine(model, prompts, compile) -> DecodeEngine:
    bucket = prompt_bucket(max(map(len, prompts)), GEN, model.spec.max_positions)
    return DecodeEngine(model, policy=SETTING["policy"], policy_args=SETTING["policy_args"], gen_length=GEN,
                        block=BLOCK, cache="dual", slots=len(prompts), prompt_len=bucket, compile=compile)


@pytest.mark.parametrize("compiled", [False, True], ids=["engine", "compiled-engine"])
def test_int8_against_fp32(request, benchmark, machine, bundled, compiled):
    if compiled and benchmark.disabled:
        pytest.skip("the compiled engine is timed with --benchmark only (inductor compiles for minutes here)")
    name, models, prompts = bundled
    engines = {fmt: _engine(m, prompts, compiled) for fmt, m in models.items()}
    answers = {}
    for fmt, engine in engines.items():  # check before timing: each engine decodes as fused_generate does
        answers[fmt] = engine.run(prompts)
        for prompt, (tokens, stats) in zip(prompts, answers[fmt]):
            want, want_stats = tracelock.fused_generate(models[fmt], [prompt], impl="torch", **SETTING)
            assert torch.equal(tokens.reshape(-1), want.reshape(-1)) and stats.steps == want_stats.steps, fmt
    same = sum(torch.equal(a[0], b[0]) for a, b in zip(answers["fp32"], answers["int8"])) / ITEMS
    benchmark.group = f"quant-{name}-{'compiled' if compiled else 'engine'}-B{ITEMS}-gen{GEN}-block{BLOCK}"
    benchmark.extra_info.update(machine, model=name, items=ITEMS, int8_same_tokens_as_fp32=same)
    if benchmark.disabled:
        return
    rounds = request.config.getoption("--bench-rounds")
    times = {fmt: [] for fmt in engines}
    for _ in range(rounds):  # alternating, so a load change on a shared machine falls on both
        for fmt, engine in engines.items():
            start = time.perf_counter()
            engine.run(prompts)
            times[fmt].append(time.perf_counter() - start)
    benchmark.extra_info.update(
        seconds_per_item={f: statistics.median(t) / ITEMS for f, t in times.items()}, rounds=rounds,
        int8_over_fp32=statistics.median(times["int8"]) / statistics.median(times["fp32"]),
        median_round_ratio=statistics.median([a / b for a, b in zip(times["int8"], times["fp32"])]))
    benchmark.pedantic(lambda: engines["int8"].run(prompts), rounds=rounds, warmup_rounds=0)
