"""docs/coming-from.md runs as written: each section's `fused_generate` example gives the same tokens as the call it
stands for (Fast-dLLM's own `generate` / `generate_with_dual_cache`, loaded from a checkout beside the repository,
for LLaDA's and Fast-dLLM's; skipped when that checkout is absent), and its command line gives the same answer. The
rules since Fast-dLLM are checked against their projects' own code in bench/test_bench_peers_since.py."""

import importlib.util
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tracelock.text import answer_ids

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "coming-from.md"
CLI = str(Path(sys.executable).parent / "tracelock")


def _section(title: str) -> str:
    text = PAGE.read_text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


@pytest.fixture(scope="module")
def namespace():
    """The page's preamble, run: ``model``, ``tok``, ``chat``, ``ids``."""
    preamble = _blocks(PAGE.read_text().split("\n## ")[0], "python")[0]
    space = {}
    exec(preamble, space)
    return space


def run_example(namespace, title: str, index: int = 0) -> dict:
    """Run a section's Python example after the preamble; its names (``tokens``, ``stats``, ...)."""
    space = dict(namespace)
    exec(_blocks(_section(title), "python")[index], space)
    return space


def run_command(line: str, cwd=None) -> dict:
    args = shlex.split(line)
    assert args[0] == "tracelock"
    done = subprocess.run([CLI, *args[1:], "--threads", "1"], capture_output=True, text=True, timeout=600, cwd=cwd)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def assert_cli_matches(record: dict, tokens: torch.Tensor, prompt_len: int, end_ids):
    assert record["token_ids"] == answer_ids(tokens[0, prompt_len:].tolist(), end_ids)


@pytest.fixture(scope="module")
def bench_peers():
    """bench/peers.py: Fast-dLLM's code, found and loaded."""
    spec = importlib.util.spec_from_file_location("bench_peers", ROOT / "bench" / "peers.py")
    peers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peers)
    return peers


@pytest.fixture(scope="module")
def fastdllm(namespace, bench_peers):
    """Fast-dLLM's `llada/generate.py` and its LLaDA model on the bundled model's weights (bench/peers.py)."""
    peers = bench_peers
    folder, why = peers.find_fastdllm(None)
    if folder is None:
        pytest.skip(why)
    model = namespace["model"]
    config = json.loads((ROOT / "tracelock" / "testbed" / "model" / "config.json").read_text())
    return peers.llada_generate_module(folder), peers.load_llada(folder, model, config)


def test_llada_generate_maps_onto_the_confidence_policy(namespace, fastdllm):
    module, peer = fastdllm
    got = run_example(namespace, "LLaDA")
    model, ids = namespace["model"], namespace["ids"]
    # Fast-dLLM's `generate` without a threshold is LLaDA's generate (the same schedule and confidence)
    with torch.no_grad():
        x, nfe = module.generate(peer, torch.tensor([ids]), steps=32, gen_length=64, block_length=16, temperature=0.,
                                 remasking="low_confidence", mask_id=model.spec.mask_id)
    assert torch.equal(got["tokens"], x) and got["stats"].steps == [nfe] == [32]
    record = run_command(_blocks(_section("LLaDA"), "bash")[0])
    assert_cli_matches(record, got["tokens"], len(ids), model.spec.end_ids)


def test_fastdllm_dual_cache_threshold_maps_onto_threshold_with_cache_dual(namespace, fastdllm):
    module, peer = fastdllm
    got = run_example(namespace, "Fast-dLLM")
    model, ids = namespace["model"], namespace["ids"]
    with torch.no_grad():
        x, _ = module.generate_with_dual_cache(peer, torch.tensor([ids]), steps=64, gen_length=64, block_length=16,
                                                 temperature=0., remasking="low_confidence",
                                                 mask_id=model.spec.mask_id, threshold=0.9)
    assert torch.equal(got["tokens"], x)  # (its nfe counts its forwards its own way; the tokens are the contract)
    record = run_command(_blocks(_section("Fast-dLLM"), "bash")[0])
    assert_cli_matches(record, got["tokens"], len(ids), model.spec.end_ids)


def test_dream_diffusion_generate_maps_onto_the_entropy_policy(namespace):
    import tracelock

    got = run_example(namespace, "Dream")
    dream, dream_ids = got["dream"], got["dream_ids"]
    # the spelled-out call it stands for: Dream's entropy rule, one region, 64 steps, top-k (alg_temp 0), greedy
    spelled, stats = tracelock.fused_generate(dream, [dream_ids], policy="entropy", gen_length=64, block=None,
                                              policy_args=dict(steps=64, eps=1e-3, alg_temp=0.0, batch_average=False),
                                              temperature=0.0)
    assert torch.equal(got["tokens"], spelled) and got["stats"].steps == stats.steps == [64]
    record = run_command(_blocks(_section("Dream"), "bash")[0])
    assert_cli_matches(record, got["tokens"], len(dream_ids), dream.spec.end_ids)


@pytest.mark.slow
def test_learn2pd_maps_onto_the_l2p_policy(namespace, tmp_path, monkeypatch):
    import tracelock
    from tracelock.policies import make_policy

    section = _section("Learn2PD")
    collect, train = _blocks(section, "bash")[0].strip().splitlines()
    # fewer items and epochs than the page, for time only: the mapping does not depend on how good the filter is
    for args in (shlex.split(collect) + ["--limit", "8"], shlex.split(train) + ["--epochs", "300"]):
        done = subprocess.run([CLI, *args[1:], "--threads", "1", "--quiet"], capture_output=True, text=True,
                              timeout=600, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
    monkeypatch.chdir(tmp_path)
    got = run_example(namespace, "Learn2PD")
    model, ids = namespace["model"], namespace["ids"]
    policy = make_policy("l2p", filters=tmp_path / "l2p-filters", threshold=0.96, steps=64,
                                            eotp=True, model=model)
    spelled, stats = tracelock.fused_generate(model, [ids], policy=policy, gen_length=64, block=16)
    assert torch.equal(got["tokens"], spelled) and got["stats"].steps == stats.steps
    record = run_command(_blocks(section, "bash")[1], cwd=tmp_path)
    assert_cli_matches(record, got["tokens"], len(ids), model.spec.end_ids)


def _dream(got):
    return got["dream"], got["dream_ids"]


@pytest.fixture
def specs(monkeypatch):
    """The sections of the rules since Fast-dLLM run on the specs (TRACELOCK_IMPL=torch): the kernels are checked in
    tests/test_kernel_*.py, each rule against its authors' code in bench/test_bench_peers_since.py."""
    monkeypatch.setenv("TRACELOCK_IMPL", "torch")


def _example_is_the_call(namespace, section: str, policy: str) -> dict:
    """The section's first example and its first command line give what ``policy`` with its defaults gives (64 tokens
    in blocks of 16); the example's results."""
    import tracelock

    got = run_example(namespace, section)
    model, ids = namespace["model"], namespace["ids"]
    spelled, stats = tracelock.fused_generate(model, [ids], policy=policy, gen_length=64, block=16)
    assert torch.equal(got["tokens"], spelled) and got["stats"].steps == stats.steps
    record = run_command(_blocks(_section(section), "bash")[0])
    assert_cli_matches(record, got["tokens"], len(ids), model.spec.end_ids)
    return got


@pytest.mark.usefixtures("specs")
def test_dinfer_decoders_map_onto_credit_and_hierarchy(namespace):
    # the example spells out the defaults (dInfer's credit_alpha, boost_gamma, decay_beta and its benchmarks' tau)
    _example_is_the_call(namespace, "dInfer", "credit")


@pytest.mark.usefixtures("specs")
def test_klass_maps_onto_the_klass_policy(namespace):
    import tracelock

    _example_is_the_call(namespace, "KLASS", "klass")
    dream_got = run_example(namespace, "KLASS", 1)
    dream, dream_ids = _dream(dream_got)
    spelled, stats = tracelock.fused_generate(dream, [dream_ids], policy="klass", gen_length=64, block=None,
                                              policy_args={"form": "dream", "kl": 0.001})
    assert torch.equal(dream_got["tokens"], spelled) and dream_got["stats"].steps == stats.steps


@pytest.mark.usefixtures("specs")
def test_pc_sampler_maps_onto_pc_and_eb(namespace):
    import tracelock

    model, ids = namespace["model"], namespace["ids"]
    section = _section("PC-Sampler")
    got = run_example(namespace, "PC-Sampler")
    table = ROOT / "tracelock" / "testbed" / "model" / "background.json"
    # background="testbed" is the table shipped with the bundled model; lambd, alpha and steps = gen_length are the
    # defaults
    spelled, stats = tracelock.fused_generate(model, [ids], policy="pc", policy_args={"background": str(table)},
                                              gen_length=64, block=16)
    assert torch.equal(got["tokens"], spelled) and got["stats"].steps == stats.steps == [64]
    assert_cli_matches(run_command(_blocks(section, "bash")[0]), got["tokens"], len(ids), model.spec.end_ids)
    eb = run_example(namespace, "PC-Sampler", 1)
    spelled, stats = tracelock.fused_generate(model, [ids], policy="eb", gen_length=64, block=None)
    assert torch.equal(eb["tokens"], spelled) and eb["stats"].steps == stats.steps
    assert_cli_matches(run_command(_blocks(section, "bash")[1]), eb["tokens"], len(ids), model.spec.end_ids)


@pytest.mark.usefixtures("specs")
def test_less_maps_onto_the_less_policy(namespace):
    _example_is_the_call(namespace, "LESS", "less")
