"""Benchmarks: `pytest bench/ --benchmark` times them; without the flag each body runs once as a smoke test.

One backbone per run (the ``target`` fixture):
- the bundled testbed model on the CPU (default), its held-out items scored for the metric;
- ``--shape llada-8b|dream-7b``: random weights at a released shape (meant for a GPU; ``--shape-layers N`` keeps the
  first N layers where the whole model does not fit); random prompts, so there is no metric;
- ``--model-path DIR`` (or ``TRACELOCK_MODEL``): a checkpoint folder, scored on ``--bench-task`` when given.

TraceLock needs a controller: ``--controller RUN`` (a `tracelock train` folder). Otherwise the testbed uses the
controller shipped with it (``controller="testbed"``); other backbones get an untrained one of the paper's
architecture (timing only). The trace-store benchmark measures a quick run of the method (8 traces, 20 optimiser
steps; cached under .pytest_cache).
"""

import hashlib
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))  # the benchmarks' helper modules (peers.py)

QUICK_CONTROLLER = dict(traces=8, steps=20, batch_size=16)  # bump the cache key below when this changes
QUICK_VERSION = 1
QUICK_L2P = dict(traces=8, epochs=2000)  # bump the cache key below when this changes
QUICK_L2P_VERSION = 1


def pytest_addoption(parser):
    group = parser.getgroup("tracelock benchmarks")
    group.addoption("--benchmark", action="store_true", default=False,
                    help="time the benchmark suites (default: run each body once as a smoke test)")
    group.addoption("--shape", default="testbed", choices=["testbed", "llada-8b", "dream-7b"],
                    help="backbone: the bundled testbed (default) or random weights at a released shape")
    group.addoption("--shape-layers", type=int, default=None,
                    help="with --shape: keep only the first N layers (a model that does not fit whole)")
    group.addoption("--model-path", default=os.environ.get("TRACELOCK_MODEL"),
                    help="a LLaDA/Dream checkpoint folder instead of the testbed (default: $TRACELOCK_MODEL)")
    group.addoption("--bench-task", default=None,
                    help="task whose items are the prompts and the metric (tracelock eval's --task spec); "
                         "default testbed:math on the testbed")
    group.addoption("--bench-items", type=int, default=8, help="prompts per decoding benchmark (one batch)")
    group.addoption("--gen-length", type=int, default=None,
                    help="generation length (default: 64 on the testbed, 256 otherwise)")
    group.addoption("--width", type=int, default=None,
                    help="block (baselines) and window (TraceLock) width (default: 16 on the testbed, 32 otherwise)")
    group.addoption("--controller", default=None, help="a `tracelock train` run folder for the TraceLock rows")
    group.addoption("--l2p", default=None,
                    help="a `tracelock train-l2p` filters folder for the Learn2PD rows (one filter of the --width)")
    group.addoption("--device", default=None, help="cpu or cuda (default: cuda when available)")
    group.addoption("--bench-rounds", type=int, default=5,
                    help="timed rounds of each decode and step row, after one warm-up (default 5)")
    group.addoption("--peer-fastdllm", default=None,
                    help="a Fast-dLLM checkout (NVlabs/Fast-dLLM) whose own code races tracelock in "
                         "test_bench_peers.py (default: ../shared/peers/fast-dllm when it exists)")
    group.addoption("--peer-plusplus", default=None,
                    help="a Fast-dLLM++ checkout (Ringo-Star/FastdLLM_plusplus, its v1/ folder) whose own Fréchet "
                         "profile rule test_bench_peers.py checks the `frechet` policy against (default: "
                         "../shared/peers/fast-dllm-plusplus when it exists)")
    group.addoption("--peer-dinfer", default=None,
                    help="a dInfer checkout (inclusionAI/dInfer) whose own threshold, credit and hierarchy decoders "
                         "test_bench_peers_since.py runs (default: ../shared/peers/dinfer when it exists)")
    group.addoption("--peer-klass", default=None,
                    help="a KLASS checkout (shkim0116/KLASS) whose own LLaDA and Dream samplers "
                         "test_bench_peers_since.py runs (default: ../shared/peers/klass when it exists)")
    group.addoption("--peer-pcsampler", default=None,
                    help="a PC-Sampler checkout (NEUIR/Uncode, formerly NEUIR/PC-Sampler) whose own PC-Sampler and "
                         "EB-Sampler test_bench_peers_since.py runs (default: ../shared/peers/pc-sampler when it "
                         "exists)")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    # before pytest-benchmark builds its session: without --benchmark it runs each body once, untimed
    if not config.getoption("--benchmark"):
        config.option.benchmark_disable = True
        # the decode and step bodies skip their smoke call: the checked run before it was that very call
        config.addinivalue_line("filterwarnings", "ignore:Benchmark fixture was not used at all")


@dataclass
class Target:
    """The backbone every benchmark of a run uses, its prompts and decoding settings."""

    name: str
    model: object
    prompts: list  # N token-id lists (the loop left-pads them)
    gen_length: int
    block: int
    tokenizer: object = None
    task: object = None  # tracelock.eval.tasks.Task, None without a metric
    items: list = field(default_factory=list)

    @property
    def float32(self) -> bool:
        return self.model.dtype == torch.float32

    @property
    def batch(self) -> int:
        return len(self.prompts)

    @property
    def prompt_len(self) -> int:
        """P of the decoded canvases [N, P + G]: the longest prompt."""
        return max(map(len, self.prompts))

    def metric(self, tokens: torch.Tensor):
        """The task metric of decoded canvases [N, P + G] (None without a task)."""
        if self.task is None:
            return None
        from tracelock.text import decode_answer

        P = self.prompt_len
        completions = [decode_answer(self.tokenizer, row[P:].tolist(), self.model.spec.end_ids) for row in tokens]
        results = self.task.score(self.items, completions)
        return sum(bool(r) for r in results) / len(results)


def _task_target(name, model, tokenizer, spec: str, n: int, gen_length: int, block: int) -> Target:
    from tracelock.eval.tasks import make_task
    from tracelock.text import encode_prompt

    task = make_task(spec)
    items = task.items(n)
    prompts = [encode_prompt(tokenizer, it.prompt) for it in items]
    return Target(name, model, prompts, gen_length, block, tokenizer, task, items)


@pytest.fixture(scope="session")
def target(request) -> Target:
    import tracelock

    opt = request.config.getoption
    n = opt("--bench-items")
    big = opt("--shape") != "testbed" or opt("--model-path")
    gen, width = opt("--gen-length") or (256 if big else 64), opt("--width") or (32 if big else 16)
    device = torch.device(opt("--device") or ("cuda" if torch.cuda.is_available() else "cpu"))
    if opt("--shape") != "testbed":
        from tracelock.models.shapes import random_backbone

        model = random_backbone(opt("--shape"), layers=opt("--shape-layers"), device=device,
                                dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
        # random prompts of 128 ordinary tokens (ids below every special id); LLaDA's paper setting 256 / 32
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, min(model.spec.mask_id, model.spec.eos_id) - 1, (n, 128), generator=g)
        name = opt("--shape") + (f"-{opt('--shape-layers')}layers" if opt("--shape-layers") else "")
        return Target(name, model, ids.tolist(), gen, width)
    if opt("--model-path"):
        path = opt("--model-path")
        if not opt("--bench-task"):
            raise pytest.UsageError("--model-path needs --bench-task for its prompts and metric, e.g. "
                                    "--bench-task gsm8k:PATH/test.jsonl")
        model = tracelock.load_model(path, device=device,
                                     dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
        return _task_target(Path(path).name, model, tracelock.load_tokenizer(path), opt("--bench-task"), n, gen, width)
    model = tracelock.load_model("testbed", device=device)
    return _task_target("testbed", model, tracelock.load_tokenizer("testbed"), opt("--bench-task") or "testbed:math",
                        n, gen, width)


def _weights_digest(model) -> str:
    h = hashlib.sha256()
    for name, p in model.released_weights().items():
        h.update(name.encode())
        h.update(p.detach().float().flatten()[:4096].cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _quick_controller(folder: Path, model) -> Path:
    """collect -> fit-encoder -> featurize -> train on the testbed, at the sizes of QUICK_CONTROLLER; returns
    the folder, which also holds the traces and the feature cache the trace-store benchmark measures."""
    from tracelock.features import fit_encoder
    from tracelock.recording.collect import collect
    from tracelock.traces.cache import featurize
    from tracelock.traces.filters import TraceFilterConfig
    from tracelock.traces.store import iter_traces
    from tracelock.train.fit import TrainConfig, train

    q = QUICK_CONTROLLER
    # no filters: the bench needs a controller of the right architecture, and this model answers few items right
    collect("testbed", "testbed:math", folder / "traces", num=q["traces"], gen_length=64, batch_size=q["traces"],
            filters=TraceFilterConfig(enabled=False))
    encoder = fit_encoder(model, iter_traces(folder / "traces"), max_positions=2048)
    encoder.save(folder / "encoder")
    featurize(model, encoder, iter_traces(folder / "traces"), folder / "cache", dtype="fp16")
    train(TrainConfig(cache=str(folder / "cache"), out=str(folder / "ctrl"), steps=q["steps"],
                      batch_size=q["batch_size"], eval_every=q["steps"], encoder=str(folder / "encoder"),
                      device="cpu"))
    return folder


@pytest.fixture(scope="session")
def quick_run(request, target) -> Path | None:
    """The testbed's quick controller run folder (built once per weights, kept in pytest's cache)."""
    if target.name != "testbed":
        return None
    key = f"tracelock-bench-controller-v{QUICK_VERSION}-{_weights_digest(target.model)}"
    folder = Path(request.config.cache.mkdir(key))
    if not (folder / "ctrl" / "best.safetensors").exists():
        for stale in ("traces", "encoder", "cache", "ctrl"):
            shutil.rmtree(folder / stale, ignore_errors=True)
        _quick_controller(folder, target.model)
    return folder


@pytest.fixture(scope="session")
def controller(request, target) -> tuple:
    """(TraceLockPolicy, label) for the TraceLock rows."""
    from tracelock.policies.tracelock import TraceLockPolicy

    if request.config.getoption("--controller"):
        path = request.config.getoption("--controller")
        return TraceLockPolicy(path), f"controller {Path(path).name}"
    if target.name == "testbed":
        return TraceLockPolicy("testbed"), "the testbed's shipped controller"
    from tracelock.controller import Controller, ControllerConfig, controller_fingerprint
    from tracelock.features import LinearEncoder, TapEncoder, backbone_fingerprint

    D = target.model.spec.hidden_size
    g = torch.Generator().manual_seed(0)
    samples = torch.randn(1024, D, generator=g)
    encoder = TapEncoder(LinearEncoder.fit_pca(samples, min(256, D)), LinearEncoder.fit_pca(samples, min(32, D)),
                         backbone_fingerprint(target.model))
    torch.manual_seed(0)
    config = ControllerConfig(code_dim=encoder.code_dim, groups=encoder.groups,
                              fingerprint=controller_fingerprint(target.model, encoder))
    return TraceLockPolicy(Controller(config).eval(), encoder=encoder), "untrained controller (timing only)"


def _quick_l2p(folder: Path, model, block: int) -> Path:
    """collect (confidence 1/step in blocks of ``block``) -> train-l2p at the sizes of QUICK_L2P; returns the filters
    folder."""
    from tracelock.features import backbone_fingerprint
    from tracelock.l2p.data import block_examples
    from tracelock.l2p.train import fit_filter
    from tracelock.recording.collect import collect
    from tracelock.traces.filters import TraceFilterConfig
    from tracelock.traces.store import iter_traces

    q = QUICK_L2P
    collect("testbed", "testbed:math", folder / "traces", num=q["traces"], gen_length=64, block=block,
            batch_size=q["traces"], filters=TraceFilterConfig(enabled=False))
    inputs, labels, groups = block_examples(model, iter_traces(folder / "traces"), block)
    filt = fit_filter(inputs, labels, groups, family=model.spec.family, eos_id=model.spec.eos_id,
                      backbone=backbone_fingerprint(model), epochs=q["epochs"])
    filt.save(folder / "filters")
    return folder / "filters"


@pytest.fixture(scope="session")
def l2p(request, target) -> tuple:
    """(L2PPolicy, label) for the Learn2PD rows."""
    from tracelock.features import backbone_fingerprint
    from tracelock.l2p.filter import FilterConfig, L2PFilter
    from tracelock.policies import L2PPolicy

    if request.config.getoption("--l2p"):
        path = request.config.getoption("--l2p")
        return L2PPolicy(path, model=target.model), f"filters {Path(path).name}"
    if target.name == "testbed":
        key = f"tracelock-bench-l2p-v{QUICK_L2P_VERSION}-b{target.block}-{_weights_digest(target.model)}"
        folder = Path(request.config.cache.mkdir(key))
        if not (folder / "filters").is_dir():
            shutil.rmtree(folder / "traces", ignore_errors=True)
            _quick_l2p(folder, target.model, target.block)
        q = QUICK_L2P
        return (L2PPolicy(folder / "filters", model=target.model),
                f"quick filter ({q['traces']} traces, {q['epochs']} epochs)")
    spec = target.model.spec
    torch.manual_seed(0)
    filt = L2PFilter(FilterConfig(block=target.block, hidden=target.block, family=spec.family, eos_id=spec.eos_id,
                                  backbone=backbone_fingerprint(target.model))).eval()
    return L2PPolicy(filt, model=target.model), "untrained filter (timing only)"


POLICIES = ["confidence", "fastdllm-0.9", "l2p", "tracelock"]


def decode_kwargs(target: Target, policy: str, controller, l2p) -> dict:
    """fused_generate's arguments for a policy row at the target's setting: baselines in semi-AR blocks, TraceLock in
    a sliding window of the same width (the paper's protocol, as `tracelock eval`)."""
    common = dict(gen_length=target.gen_length)
    if policy == "confidence":
        return dict(common, policy="confidence", block=target.block)
    if policy == "fastdllm-0.9":
        return dict(common, policy="threshold", policy_args={"tau": 0.9}, block=target.block)
    if policy == "l2p":
        return dict(common, policy=l2p[0], block=target.block)
    if policy == "tracelock":
        return dict(common, policy=controller[0], window=target.block)
    raise ValueError(f"unknown bench policy {policy!r}; known: {', '.join(POLICIES)}")


def pytest_generate_tests(metafunc):
    # every benchmark with a ``policy`` argument runs once per policy row
    if "policy" in metafunc.fixturenames:
        metafunc.parametrize("policy", POLICIES)


@pytest.fixture(scope="session")
def policy_kwargs(target, controller, l2p):
    """``policy_kwargs(policy)``: `decode_kwargs` on this run's target, controller and Learn2PD filters."""
    return lambda policy: decode_kwargs(target, policy, controller, l2p)


@pytest.fixture(scope="session")
def decoded(target, policy_kwargs):
    """``decoded(runner, policy)``: that loop's (tokens, stats) on the target, computed once per session (the runs
    every benchmark checks its timed body against). Runners: ``reference``, ``fused`` (the default ops) and
    ``fused-spec`` (the fused loop on the ops' torch specs)."""
    import tracelock

    runners = {"reference": tracelock.reference_generate, "fused": tracelock.fused_generate,
               "fused-spec": partial(tracelock.fused_generate, impl="torch")}
    runs = {}

    def get(runner: str, policy: str):
        if (runner, policy) not in runs:
            runs[runner, policy] = runners[runner](target.model, target.prompts, **policy_kwargs(policy))
        return runs[runner, policy]

    return get


@pytest.fixture(scope="session")
def check_same(target):
    """``check_same(ref, got, spec=None)``: the fraction of equal canvas tokens of two (tokens, stats) runs, the
    reference loop's and the fused loop's, after checking the fused run:

    - fp32 through the torch / C++ ops: equal to the reference exactly (tokens and steps);
    - fp32 with the Triton kernels (on a GPU, or under TRITON_INTERPRET=1 as in CI): the fused scoring reduces in
      another order and may break a near-tie differently (Learn2PD's end-of-text cut, seen in CI), so >= 90% of the
      tokens equal the reference's;
    - bf16: the reference loop rounds its logits to bf16 before the argmax while the fused loop scores in fp32 from
      the same hidden states (as the ops' specs do), so at random weights, whose top logits are often within one
      bf16 rounding step, the two loops diverge by design. There the fused run must agree on >= 90% of the tokens
      with ``spec``, the fused loop on the torch specs (`decoded("fused-spec", ...)`); without ``spec``, with the
      reference as above.
    """
    import torch

    from tracelock.ops.chooser import requested_impl, why_not

    triton = requested_impl(None) in (None, "triton") and why_not("triton", target.model.device) is None

    def check(ref, got, spec=None) -> float:
        (ref_tokens, ref_stats), (tokens, stats) = ref, got
        agreement = (ref_tokens == tokens).float().mean().item()
        if target.float32 and not triton:
            assert torch.equal(ref_tokens, tokens) and stats.steps == ref_stats.steps, "fused != reference in fp32"
        elif target.float32 or spec is None:
            assert agreement >= 0.9, f"fused and reference tokens agree on only {agreement:.1%}"
        else:
            with_spec = (spec[0] == tokens).float().mean().item()
            assert with_spec >= 0.9, f"the fused loop's tokens agree with its torch specs' on only {with_spec:.1%}"
        return agreement

    return check


def _git_revision() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).parent)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


@pytest.fixture(scope="session")
def machine() -> dict:
    """What every benchmark records in extra_info: the machine and the software."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return dict(machine=platform.processor() or platform.machine(), cpus=os.cpu_count(), gpu=gpu,
                threads=torch.get_num_threads(), torch=torch.__version__, triton=triton_version,
                git=_git_revision())


@pytest.fixture(scope="module", params=["testbed", "testbed-dream"])
def bundled(request):
    """(name, model, the first 8 held-out math test prompts as token ids) of each bundled model: the batch of the
    engine benchmarks that compare rules (test_bench_rules.py, test_bench_commit_rule.py)."""
    import tracelock
    from tracelock.testbed import held_out

    name = request.param
    tok = tracelock.load_tokenizer(name)
    prompts = [tok(e.prompt, add_special_tokens=False)["input_ids"] for e in held_out("math", "test", 8)]
    return name, tracelock.load_model(name), prompts
