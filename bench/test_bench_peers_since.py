"""The rules published after Fast-dLLM, each run through its own project's code (dInfer, KLASS, PC-Sampler;
`bench/peers_since.py`) on a bundled model, batch 1, greedy: smoke tests of the runners, then tracelock's policies
checked against them token for token and step for step.

Smoke tests (gen 32). Each runner returns a canvas [1, P + 32] holding the prompt, with no mask left except where the
peer's own code leaves masks: dInfer's block loop stops after the first block holding the eos token (`run_dinfer`),
and KLASS's Dream sampler stops after ``steps`` passes (`run_klass_dream`; none left at steps = gen_length).

Parity checks (``test_*_equals_peer``). Each runs the peer function unchanged and `tracelock.fused_generate` with the
same rule and knobs on 3 validation prompts of the testbed tasks (2 math, 1 code), gen 32 or 64, and asserts the same
canvas and the same forward count; a failure names the rule, knobs, model, prompt index, the first differing answer
position and the first step whose commits differ (each side's step trace: the peer's from the canvases its model is
called with, tracelock's from an ``observer``). Checked, on both bundled models:

- ``credit`` = dInfer's `CreditThresholdParallelDecoder` ((tau, alpha) = (0.9, 0.7), (0.8, 0.0): the plain threshold
  decoder, (0.8, 1.5) with gamma 0.5, beta 0.5), and ``hierarchy`` = its `HierarchyDecoder` ((tau, low) = (None, 0.4),
  the class default; (0.9, 0.3), the benchmarks' low; (None, 0.3)), blocks 16 / 32, ``maximum_unroll=1`` so that each
  forward is a rule step. dInfer stops after the first block holding eos (even with ``early_stop=False``): the canvas
  is compared up to that block's end, the forwards up to the step where tracelock finished it.
- ``klass`` (form llada) = KLASS's `stable_confident_decode` at steps = gen_length ((tau, kl, history) = (0.6, 0.015,
  2), GSM8K's; (0.9, 0.01, 2), HumanEval's; (0.7, 0.01, 3), MBPP's with history 3), blocks 16 / 32. And once at
  steps = gen_length / 2, where KLASS ends a block after its share of passes even with masks left and its top-k
  fallback (k not clamped to the masks left) can overwrite committed tokens, while tracelock commits the leftovers:
  that check asserts equality only for the prompts on which the peer left no mask and overwrote nothing (at least one).
- ``klass:form=dream`` (no block) = KLASS's Dream ``_sample`` at steps = gen_length ((0.9, 0.001), GSM8K's; (0.9,
  0.005), MATH's; (0.8, 0.001) with history 3).
- ``pc`` = PC-Sampler's `generate_with_pc_sampler` ((lambd, alpha) = (0.25, 10), the authors', with block = gen =
  steps; (0.0, 10), in their scripts too; (1.0, 1.0), the cap active), with the model's bundled background table
  (``tracelock/testbed/model*/background.json``, the same file on both sides), and ``eb`` = the third-party
  `generate_with_eb_sampler` staged with it (gamma 0.01, the authors' script; 0.1, its default; 0.5).

Both models for every peer: the functions written for LLaDA only (dInfer's loop, KLASS's LLaDA code, PC-Sampler, EB)
run on the Dream model through `PeerView` (Fast-dLLM's Dream peer whose logits are shifted right by one, as Dream's
samplers and tracelock's ``logit_shift`` do: position i is predicted from row i - 1), and KLASS's Dream sampler, which
shifts the logits itself, runs on the LLaDA model through the reverse view (the LLaDA peer's logits shifted left by
one; the row KLASS then reads at position i is LLaDA's own row i). The peers' own loops and rules run unchanged.

Where tracelock is known to differ from a peer, only by floating-point rounding of a confidence that meets an exact
tie in the peer's rule, the check follows the two step traces to the first step where they part and passes only if
that step's difference is such a tie (`_tie_between`: each slot committed by one side only has the float32
confidence, the peer's or tracelock's, of a slot of its group committed at that step), with the canvases equal up to
it; the run's later tokens and forward count are then not compared (a `PeerTie` warning names the run), and every
parity test still compares at least one prompt in full:

- ``hierarchy`` with tau None: dInfer's rule marks every slot equal to its run's best confidence, a confidence it
  computes as ``exp(log_softmax(logits))`` of the proposal; tracelock's policy reads the step's confidence signal,
  which differs from it by a few float32 ulps near 1.0. So two slots of a run may tie (both commit) on one side and
  not on the other (one commits): the tokens come out equal, but the forward count differs by one (seen on the Dream
  model at gen 64, block 32: prompts 0 and 1 of (None, 0.4); also on the LLaDA model with other prompts and blocks).

``klass:form=dream`` ranks its one fallback by the softmax in the logits' dtype, as KLASS's Dream code does, so its
runs are compared in full.
"""

import functools
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import peers  # bench/peers.py (bench/ is on sys.path: conftest.py)
import peers_since
import pytest
import torch

import tracelock
from tracelock.testbed import background as backgrounds

G = 32
MODELS = ("testbed", "testbed-dream")


def _folder(request, option: str, find):
    folder, why = find(request.config.getoption(option))
    if folder is None:
        pytest.skip(why)
    return folder


@pytest.fixture(scope="session")
def fastdllm(request):
    return _folder(request, "--peer-fastdllm", peers.find_fastdllm)


@pytest.fixture(scope="session")
def dinfer(request):
    return _folder(request, "--peer-dinfer", peers_since.find_dinfer)


@pytest.fixture(scope="session")
def klass(request):
    return _folder(request, "--peer-klass", peers_since.find_klass)


@pytest.fixture(scope="session")
def pcsampler(request):
    return _folder(request, "--peer-pcsampler", peers_since.find_pcsampler)


def _model_folder(name: str) -> Path:
    return Path(tracelock.__file__).parent / "testbed" / ("model-dream" if name == "testbed-dream" else "model")


def _prompts(name: str, n: int) -> list:
    """n validation items per testbed task (math, then code) as chat prompts (token ids)."""
    from tracelock.eval.tasks import make_task
    from tracelock.text import encode_prompt

    tok = tracelock.load_tokenizer(name)
    return [encode_prompt(tok, it.prompt) for task in ("math", "code")
            for it in make_task(f"testbed:{task}@validation").items(n)]


def _bundled(name: str):
    """A bundled model, its config.json and two chat prompts (the first validation item of math and of code)."""
    model = tracelock.load_model(name)
    return model, json.loads((_model_folder(name) / "config.json").read_text()), _prompts(name, 1)


@pytest.fixture(scope="session")
def llada(fastdllm):
    """(tracelock's LLaDA-family testbed, Fast-dLLM's LLaDA on its weights, prompts)."""
    model, config, prompts = _bundled("testbed")
    return model, peers.load_llada(fastdllm, model, config), prompts


@pytest.fixture(scope="session")
def dream(fastdllm):
    """(tracelock's Dream-family testbed, Fast-dLLM's Dream on its weights, prompts)."""
    model, config, prompts = _bundled("testbed-dream")
    return model, peers.load_dream(fastdllm, model, config), prompts


@pytest.fixture(scope="session")
def background():
    return backgrounds.testbed_background("testbed")


def _check(canvas, prompt, spec, forwards, most: int):
    """The canvas' shape and prompt, and 1..most forwards; returns the generated region's mask positions."""
    assert canvas.dtype == torch.long and canvas.shape == (1, len(prompt) + G)
    assert canvas[0, :len(prompt)].tolist() == prompt
    assert isinstance(forwards, int) and 1 <= forwards <= most
    return (canvas[0, len(prompt):] == spec.mask_id).nonzero().flatten().tolist()


@pytest.mark.parametrize("option, find", [("--peer-dinfer", peers_since.find_dinfer),
                                          ("--peer-klass", peers_since.find_klass),
                                          ("--peer-pcsampler", peers_since.find_pcsampler)])
def test_finder_names_the_option(tmp_path, option, find):
    folder, why = find(str(tmp_path))
    assert folder is None and option in why and str(tmp_path) in why


@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("decoder", peers_since.DINFER_DECODERS)
def test_dinfer(dinfer, llada, decoder, block):
    """Masks are left only in the blocks after the first that holds the eos token (its loop stops there)."""
    model, peer, prompts = llada
    spec = model.spec
    for prompt in prompts:
        canvas, forwards = peers_since.run_dinfer(dinfer, peer, decoder, prompt, gen_length=G, block=block,
                                                  mask_id=spec.mask_id, eos_id=spec.eos_id)
        left = _check(canvas, prompt, spec, forwards, G + 4 * (G // block))
        blocks = canvas[0, len(prompt):].view(-1, block)
        with_eos = (blocks == spec.eos_id).any(-1).nonzero().flatten().tolist()
        stop = with_eos[0] if with_eos else len(blocks) - 1
        assert all(p // block > stop for p in left), (left, stop)
        assert not (blocks[:stop + 1] == spec.mask_id).any()


def test_klass_llada(klass, llada):
    model, peer, prompts = llada
    for prompt in prompts:
        canvas, used = peers_since.run_klass_llada(klass, peer, prompt, gen_length=G, steps=G, block=16,
                                                   conf_threshold=0.9, kl_threshold=0.01)
        assert _check(canvas, prompt, model.spec, used, G) == []
        assert not (canvas == peers_since.KLASS_MASK).any()


def test_klass_dream(klass, dream):
    """At steps = gen_length no mask is left; with fewer steps masks may be left (one commit per pass at least)."""
    model, peer, prompts = dream
    for prompt in prompts:
        canvas, forwards = peers_since.run_klass_dream(klass, peer, prompt, gen_length=G, steps=G,
                                                       conf_threshold=0.9, kl_threshold=0.001)
        assert _check(canvas, prompt, model.spec, forwards, G) == []
    canvas, forwards = peers_since.run_klass_dream(klass, peer, prompts[0], gen_length=G, steps=G // 4,
                                                   conf_threshold=0.9, kl_threshold=0.001)
    _check(canvas, prompts[0], model.spec, forwards, G // 4)


def test_pc_sampler(pcsampler, llada, background):
    model, peer, prompts = llada
    module = peers_since.pcsampler_module(pcsampler)
    for block in (32, 16):
        for prompt in prompts:
            canvas, forwards = peers_since.run_pc_sampler(pcsampler, peer, prompt, steps=G, gen_length=G, block=block,
                                                          lambd=0.25, alpha=10, background=background)
            assert _check(canvas, prompt, model.spec, forwards, G) == []
            assert forwards == G
            assert module.BASE_LINE is None  # reset for the next table


def test_eb_sampler(pcsampler, llada):
    model, peer, prompts = llada
    for prompt in prompts:
        canvas, forwards = peers_since.run_eb_sampler(pcsampler, peer, prompt, gamma=0.01, gen_length=G)
        assert _check(canvas, prompt, model.spec, forwards, G) == []


@pytest.mark.parametrize("name", MODELS)
def test_testbed_background(name, background):
    table = background if name == "testbed" else backgrounds.testbed_background(name)
    counts, spec = table["p_baseline_dict"], tracelock.load_model(name).spec
    assert table["num_token"] == sum(counts.values()) > 100_000
    assert all(isinstance(k, int) and 0 <= k < spec.vocab_size and v > 0 for k, v in counts.items())
    assert spec.eot_id in counts and spec.mask_id not in counts


# ------------------------------------------------------------------------------------ parity with the peers' code


class PeerTie(UserWarning):
    """A parity run that parted from its peer at a float32 confidence tie (compared up to that step only)."""


class PeerView:
    """A Fast-dLLM peer model as a peer function calls it, recording each call's canvas (and, with ``keep_logits``,
    the logits it returned). ``shift``: 0 passes the call through; +1 (a Dream peer for code written for LLaDA)
    calls it on the canvas alone and shifts its logits right by one (row i is predicted from row i - 1, Dream's
    convention: the first row keeps its own); -1 (a LLaDA peer for KLASS's Dream sampler, which shifts right itself)
    shifts them left by one, the last row repeated, so that the rows it reads are LLaDA's own. Every other attribute
    (device, config, parameters, lm_head, generation_config) is the peer's."""

    def __init__(self, peer, shift: int = 0, keep_logits: bool = False):
        self.peer, self.shift, self.keep_logits = peer, shift, keep_logits
        self.canvases, self.logits = [], []

    def __getattr__(self, name):
        return getattr(self.__dict__["peer"], name)

    def __call__(self, x, *args, **kwargs):
        self.canvases.append(x.clone())
        if self.shift == 0:
            out = self.peer(x, *args, **kwargs)
            logits = out.logits
        else:
            logits = self.peer(x).logits
            logits = (torch.cat([logits[:, :1], logits[:, :-1]], 1) if self.shift > 0 else
                      torch.cat([logits[:, 1:], logits[:, -1:]], 1))
            out = SimpleNamespace(logits=logits)
        if self.keep_logits:
            self.logits.append(logits)
        return out


@dataclass
class Trace:
    """One decode of one prompt: the answer before each step ([G] tokens), the answer offsets committed at each step
    and the final canvas [P + G]; tracelock's also keeps each step's record (positions, active slots, confidence)."""

    canvas: torch.Tensor
    before: list = field(default_factory=list)
    commits: list = field(default_factory=list)
    records: list = field(default_factory=list)

    @property
    def forwards(self) -> int:
        return len(self.commits)

    def forwards_to(self, n: int) -> int | None:
        """The steps until the first n answer positions are all committed, None if they never are."""
        done = 0
        for s, step in enumerate(self.commits):
            done += len(step)
            if done >= n:
                return s + 1
        return None


def _peer_trace(view: PeerView, canvas: torch.Tensor, P: int) -> Trace:
    """The peer's steps from the canvases its model was called with (each call is one step): a step's commits are
    the answer positions that changed before the next call (or the final canvas)."""
    before = [c[0, P:].clone() for c in view.canvases] + [canvas[0, P:]]
    commits = [(b != a).nonzero().flatten().tolist() for a, b in zip(before, before[1:])]
    return Trace(canvas[0].clone(), before[:-1], commits)


def _decode(model, prompt: list, rule: str, args: dict, G: int, block: int | None) -> Trace:
    """tracelock's `fused_generate` of one prompt with its step trace (observer)."""
    P, records = len(prompt), []

    def observe(r):
        positions, chosen = r.positions[0], r.chosen[0]
        records.append(SimpleNamespace(before=r.x[0, P:].clone(), commits=sorted((positions[chosen] - P).tolist()),
                                       positions=positions.clone() - P, active=r.active[0].clone(),
                                       confidence=r.signals.confidence[0].clone()))

    canvas, stats = tracelock.fused_generate(model, [prompt], policy=rule, policy_args=args, gen_length=G,
                                             block=block, observer=observe)
    assert stats.steps == [len(records)]
    return Trace(canvas[0], [r.before for r in records], [r.commits for r in records], records)


def _first(a: torch.Tensor, b: torch.Tensor):
    diff = (a != b).nonzero().flatten()
    return int(diff[0]) if len(diff) else None


def _compare(where: str, peer: Trace, ours: Trace, P: int, upto: int, tie=None) -> bool:
    """Assert tracelock's decode equals the peer's on the first ``upto`` answer positions (the peer has committed them
    all) and in forwards (the peer's, against tracelock's steps until it had committed them). ``tie(s, peer,
    ours)``: a description when the commits of step s differ only by a float32 confidence tie of the peer's (or
    tracelock's) rule, else None; then the runs are compared only up to that step. True when compared in full."""
    want, got = peer.canvas[:P + upto], ours.canvas[:P + upto]
    ours_forwards = ours.forwards_to(upto)
    if torch.equal(want, got) and ours_forwards == peer.forwards:
        return True
    step = next((s for s in range(min(peer.forwards, ours.forwards))
                 if peer.commits[s] != ours.commits[s] or not torch.equal(peer.before[s], ours.before[s])), None)
    same_before = step is not None and torch.equal(peer.before[step], ours.before[step])
    if tie is not None and same_before:
        why = tie(step, peer, ours)
        if why is not None:
            warnings.warn(f"{where}: parted from the peer at step {step}, {why}; compared up to that step",
                          PeerTie, stacklevel=2)
            return False
    at = "the step traces agree where both have steps" if step is None else (
        f"first differing step {step}: peer committed {peer.commits[step]}, tracelock {ours.commits[step]}"
        f"{'' if same_before else ' (the canvases before it differ)'}")
    raise AssertionError(f"{where}: first differing answer position {_first(want[P:], got[P:])} ({_token(want, P, got)}"
                         f"), {at}; forwards peer {peer.forwards} vs tracelock {ours_forwards}")


def _token(want, P, got):
    i = _first(want[P:], got[P:])
    return "tokens equal" if i is None else f"peer token {int(want[P + i])}, tracelock {int(got[P + i])}"


def _tie_between(step: int, peer: Trace, ours: Trace, confs: list, group) -> str | None:
    """A description when every answer position committed at ``step`` by one side only ties, in one of ``confs``
    ({offset: confidence} each, float32), with a position of its ``group(offset)`` committed by either side."""
    a, b = set(peer.commits[step]), set(ours.commits[step])
    either, lone = a | b, sorted(a ^ b)
    found = []
    for j in lone:
        partner = next((k for k in sorted(either - {j}) if group(k) == group(j)
                        and any(j in c and k in c and c[j] == c[k] for c in confs)), None)
        if partner is None:
            return None
        found.append(f"{j} ties {partner}")
    return f"peer committed {sorted(a)}, tracelock {sorted(b)} ({', '.join(found)} in float32)"


def _hierarchy_tie(peer_view: PeerView, P: int):
    """dInfer's hierarchy confidence (``exp(log_softmax)`` of the proposal, the logits' dtype) and tracelock's signal
    at a step; slots group by run of adjacent masked positions."""

    def tie(step, peer, ours):
        logits = peer_view.logits[step][0, P:]
        c = torch.log_softmax(logits, -1).gather(-1, logits.argmax(-1, keepdim=True)).squeeze(-1).exp()
        rec = ours.records[step]
        masked = rec.positions[rec.active].tolist()
        theirs = {j: float(c[j]) for j in masked}
        own = dict(zip(masked, rec.confidence[rec.active].tolist()))
        run = {j: sum(1 for k in masked if k <= j and k - 1 not in masked) for j in masked}
        return _tie_between(step, peer, ours, [theirs, own], run.get)

    return tie


def _klass_dream_tie(peer_view: PeerView, mask_id: int, P: int):
    """KLASS's Dream fallback confidence (``sample_tokens``: the softmax of the right-shifted logits in their dtype)
    at a step; all masked slots are one group."""

    def tie(step, peer, ours):
        logits = peer_view.logits[step]
        logits = torch.cat([logits[:, :1], logits[:, :-1]], 1)[0, P:]
        c = torch.softmax(logits, -1).amax(-1)
        masked = (peer.before[step] == mask_id).nonzero().flatten().tolist()
        return _tie_between(step, peer, ours, [{j: float(c[j]) for j in masked}], lambda j: 0)

    return tie


@functools.cache
def _view_in(package: str) -> type:
    """`PeerView` as a class of the Dream package ``package``: `peers_since.run_klass_dream` registers KLASS's sampler
    beside the package of ``type(peer)``, which must be the peer's Dream package, not this test module's."""
    return type("PeerView", (PeerView,), {"__module__": f"{package}.peer_view"})


@dataclass
class Bench:
    name: str
    model: object
    peer: object  # Fast-dLLM's LLaDA or Dream on the model's weights
    prompts: list
    background: dict  # the model's bundled PC-Sampler table
    dream_package: str  # the package of Fast-dLLM's Dream modelling (loaded), where KLASS's Dream sampler goes

    @property
    def dream(self) -> bool:
        return self.model.spec.family == "dream"

    def llada_view(self, keep_logits=False) -> PeerView:
        """The peer for code written for LLaDA (logits row i predicts token i)."""
        return PeerView(self.peer, 1 if self.dream else 0, keep_logits)

    def dream_view(self, keep_logits=False) -> PeerView:
        """The peer for KLASS's Dream sampler (which shifts the logits right itself)."""
        return _view_in(self.dream_package)(self.peer, 0 if self.dream else -1, keep_logits)

    def where(self, rule: str, case: str, args: dict, i: int, G: int, block) -> str:
        """What a failure names: the rule, the case (the peer's knobs), tracelock's policy_args, model, prompt."""
        return f"{rule} [{case}] policy_args={args} on {self.name}, gen {G}, block {block}, prompt {i}"


@pytest.fixture(scope="session", params=MODELS)
def bench(request, fastdllm):
    """Each bundled model with its Fast-dLLM peer and 3 prompts (the first 2 validation items of math, 1 of code)."""
    model, peer, _ = request.getfixturevalue("dream" if request.param == "testbed-dream" else "llada")
    table = json.loads((_model_folder(request.param) / "background.json").read_text())
    dream_peer = request.getfixturevalue("dream")[1]  # its package also hosts KLASS's sampler on the LLaDA model
    return Bench(request.param, model, peer, _prompts(request.param, 2)[:3], table,
                 type(dream_peer).__module__.rpartition(".")[0])


def _all(bench: Bench, run_one) -> None:
    """``run_one(i, prompt)`` -> compared in full (bool) over the prompts; at least one compared in full."""
    with torch.no_grad():
        full = [run_one(i, prompt) for i, prompt in enumerate(bench.prompts)]
    assert any(full), f"{bench.name}: no prompt compared in full"


# dInfer: (decoder, its knobs, tracelock's policy_args, gen, block); threshold 0.9 is dInfer's benchmark default
DINFER_CASES = {
    "credit-0.9-a0.7": ("credit", {"threshold": 0.9}, {"tau": 0.9}, 64, 32),  # the authors' (class defaults)
    "credit-0.8-a0": ("credit", {"threshold": 0.8, "credit_alpha": 0.0}, {"tau": 0.8, "alpha": 0.0}, 64, 16),
    "credit-0.8-a1.5": ("credit", {"threshold": 0.8, "credit_alpha": 1.5, "boost_gamma": 0.5, "decay_beta": 0.5},
                        {"tau": 0.8, "alpha": 1.5, "gamma": 0.5, "beta": 0.5}, 32, 16),
    "hierarchy-none-0.4": ("hierarchy", {"threshold": None}, {}, 64, 32),  # the class defaults
    "hierarchy-0.9-0.3": ("hierarchy", {"threshold": 0.9, "low_threshold": 0.3}, {"tau": 0.9, "low": 0.3}, 64, 16),
    "hierarchy-none-0.3": ("hierarchy", {"threshold": None, "low_threshold": 0.3}, {"low": 0.3}, 32, 16),
}


@pytest.mark.parametrize("case", DINFER_CASES)
def test_dinfer_equals_peer(dinfer, bench, case):
    """`credit` / `hierarchy` against dInfer's decoders in its own block loop (``maximum_unroll=1``): the canvas up
    to the end of the first block holding eos (where dInfer stops) and the forwards until tracelock finished it.
    Hierarchy with tau None may part at a float32 tie of a run's best confidence (module docstring)."""
    decoder, knobs, args, G, block = DINFER_CASES[case]
    spec = bench.model.spec

    def one(i, prompt):
        P, view = len(prompt), bench.llada_view(keep_logits=decoder == "hierarchy")
        canvas, forwards = peers_since.run_dinfer(dinfer, view, decoder, prompt, gen_length=G, block=block,
                                                  mask_id=spec.mask_id, eos_id=spec.eos_id, maximum_unroll=1, **knobs)
        peer = _peer_trace(view, canvas, P)
        assert peer.forwards == forwards
        blocks = canvas[0, P:].view(-1, block)
        with_eos = (blocks == spec.eos_id).any(-1).nonzero().flatten().tolist()
        upto = ((with_eos[0] if with_eos else len(blocks) - 1) + 1) * block
        assert not (canvas[0, P:P + upto] == spec.mask_id).any()
        ours = _decode(bench.model, prompt, decoder, args, G, block)
        tie = _hierarchy_tie(view, P) if decoder == "hierarchy" and knobs["threshold"] is None else None
        return _compare(bench.where(decoder, case, args, i, G, block), peer, ours, P, upto, tie)

    _all(bench, one)


# KLASS: (conf_threshold, kl_threshold, kl_history_length, gen, block, steps); its scripts: H 2, steps = gen_length
KLASS_LLADA_CASES = {
    "gsm8k-0.6-0.015": (0.6, 0.015, 2, 64, 32, 64),
    "humaneval-0.9-0.01": (0.9, 0.01, 2, 32, 16, 32),
    "mbpp-0.7-0.01-H3": (0.7, 0.01, 3, 32, 16, 32),
    "0.9-0.01-steps32": (0.9, 0.01, 2, 64, 16, 32),
}


@pytest.mark.parametrize("case", KLASS_LLADA_CASES)
def test_klass_llada_equals_peer(klass, bench, case):
    """`klass` (form llada) against KLASS's ``stable_confident_decode``: the whole canvas and the forwards. At steps
    < gen_length KLASS ends a block after its share of passes even with masks left, and its fallback's top-k (k not
    clamped to the masks left) may rewrite committed positions; tracelock commits a block's leftovers instead. There
    only the prompts where the peer left no mask and rewrote nothing are compared (at least one)."""
    tau, kl, H, G, block, steps = KLASS_LLADA_CASES[case]
    args = dict(tau=tau, kl=kl, history=H) | ({} if steps == G else {"steps": steps})
    spec = bench.model.spec

    def one(i, prompt):
        P, view = len(prompt), bench.llada_view()
        canvas, used = peers_since.run_klass_llada(klass, view, prompt, gen_length=G, steps=steps, block=block,
                                                   conf_threshold=tau, kl_threshold=kl, kl_history_length=H,
                                                   mask_id=spec.mask_id)
        peer = _peer_trace(view, canvas, P)
        assert peer.forwards == used
        rewritten = any(((a != spec.mask_id) & (a != b)).any() for a, b in zip(peer.before, peer.before[1:] +
                                                                                [canvas[0, P:]]))
        if steps < G and (rewritten or (canvas[0, P:] == spec.mask_id).any()):
            return False  # the peer's quirk: nothing to compare
        assert not rewritten and not (canvas[0, P:] == spec.mask_id).any()
        ours = _decode(bench.model, prompt, "klass", args, G, block)
        return _compare(bench.where("klass", case, args, i, G, block), peer, ours, P, G)

    _all(bench, one)


KLASS_DREAM_CASES = {  # (conf_threshold, kl_threshold, kl_history_length, gen); steps = gen_length
    "gsm8k-0.9-0.001": (0.9, 0.001, 2, 64),
    "math-0.9-0.005": (0.9, 0.005, 2, 32),
    "humaneval-0.8-0.001-H3": (0.8, 0.001, 3, 32),
}


@pytest.mark.parametrize("case", KLASS_DREAM_CASES)
def test_klass_dream_equals_peer(klass, bench, case):
    """`klass:form=dream` (no block) against KLASS's Dream ``_sample`` at steps = gen_length: the whole canvas and
    the forwards, or up to a float32 tie of its fallback's confidence (module docstring)."""
    tau, kl, H, G = KLASS_DREAM_CASES[case]
    args = dict(tau=tau, kl=kl, history=H, form="dream")
    spec = bench.model.spec

    def one(i, prompt):
        P, view = len(prompt), bench.dream_view(keep_logits=True)
        canvas, forwards = peers_since.run_klass_dream(klass, view, prompt, gen_length=G, steps=G, conf_threshold=tau,
                                                       kl_threshold=kl, kl_history_length=H, spec=spec)
        peer = _peer_trace(view, canvas, P)
        assert peer.forwards == forwards and not (canvas[0, P:] == spec.mask_id).any()
        return _compare(bench.where("klass", case, args, i, G, None), peer,
                        _decode(bench.model, prompt, "klass", args, G, None), P, G,
                        _klass_dream_tie(view, spec.mask_id, P))

    _all(bench, one)


PC_CASES = {  # (lambd, alpha, gen, block); steps = gen_length
    "authors-0.25-10": (0.25, 10.0, 32, 32),  # block = gen = steps
    "0-10": (0.0, 10.0, 32, 32),
    "1-1": (1.0, 1.0, 32, 16),
}


@pytest.mark.parametrize("case", PC_CASES)
def test_pc_sampler_equals_peer(pcsampler, bench, case):
    """`pc` against PC-Sampler's ``generate_with_pc_sampler`` with the model's bundled background table: the whole
    canvas and the forwards (steps = gen_length)."""
    lambd, alpha, G, block = PC_CASES[case]
    args = dict(lambd=lambd, alpha=alpha, background=bench.name)

    def one(i, prompt):
        P, view = len(prompt), bench.llada_view()
        canvas, forwards = peers_since.run_pc_sampler(pcsampler, view, prompt, steps=G, gen_length=G, block=block,
                                                      lambd=lambd, alpha=alpha, background=bench.background,
                                                      mask_id=bench.model.spec.mask_id)
        peer = _peer_trace(view, canvas, P)
        assert peer.forwards == forwards == G
        ours = _decode(bench.model, prompt, "pc", args, G, block)
        return _compare(bench.where("pc", case, args, i, G, block), peer, ours, P, G)

    _all(bench, one)


EB_CASES = {"authors-0.01": (0.01, 32), "default-0.1": (0.1, 64), "0.5": (0.5, 64)}  # (gamma, gen)


@pytest.mark.parametrize("case", EB_CASES)
def test_eb_sampler_equals_peer(pcsampler, bench, case):
    """`eb` (no block) against the EB-Sampler staged with PC-Sampler: the whole canvas and the forwards."""
    gamma, G = EB_CASES[case]

    def one(i, prompt):
        P, view = len(prompt), bench.llada_view()
        canvas, forwards = peers_since.run_eb_sampler(pcsampler, view, prompt, gamma=gamma, gen_length=G,
                                                      mask_id=bench.model.spec.mask_id)
        peer = _peer_trace(view, canvas, P)
        assert peer.forwards == forwards
        return _compare(bench.where("eb", case, {"gamma": gamma}, i, G, None), peer,
                        _decode(bench.model, prompt, "eb", {"gamma": gamma}, G, None), P, G)

    _all(bench, one)
