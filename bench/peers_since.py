"""The rules published after Fast-dLLM, each run through its own project's code, loaded at run time from a checkout.

Nothing of these projects is copied into this repository: each finder takes the folder of a checkout (an option, by
default the project's folder under ``../shared/peers`` relative to the repository when it exists), and each runner
imports the project's files from there and calls its function unchanged, on a peer model that decodes with
tracelock's own weights (`peers.load_llada` / `peers.load_dream`, Fast-dLLM's model classes on the same tensors),
batch 1, greedy. Every runner returns ``(canvas [1, P + G] LongTensor, forwards)`` with tracelock's mask id wherever a
mask is left:

- dInfer (inclusionAI/dInfer; CreditDecoding ships there): `run_dinfer`, its ``BlockWiseDiffusionLLM`` with the
  threshold, credit or hierarchy decoder. Its ``generate_uniform.py`` imports ``relative_position_bucket`` from
  transformers' LayoutLMv2 at module level (unused by the decoding code); where that import fails with the installed
  transformers, `dinfer_package` puts a stub module holding just that name in ``sys.modules`` first.
- KLASS (shkim0116/KLASS): `run_klass_llada` (``stable_confident_decode``, which hard-codes LLaDA's mask id 126336:
  the model is wrapped so that id reaches it as the testbed's) and `run_klass_dream` (its ``dream_klass.py``, a
  drop-in ``generation_utils.py`` for Dream, registered as a module of the peer's Dream package and run on the peer).
- PC-Sampler (NEUIR/Uncode, formerly NEUIR/PC-Sampler): `run_pc_sampler` and its third-party EB-Sampler
  `run_eb_sampler`. PC-Sampler reads a background token-frequency table from a JSON file into a module global;
  `tracelock.testbed.background.testbed_background` counts one for a bundled model from its own training text.

Forwards are counted by wrapping the model the peer function calls (every call is one forward of the whole canvas);
a loop that does not end (a rule whose only proposal is the mask token commits nothing, or commits a mask again) is
stopped with a RuntimeError after ``FORWARD_LIMIT_PER_TOKEN * gen_length + 64`` forwards.
"""

import contextlib
import importlib
import importlib.util
import json
import sys
import tempfile
import types
import warnings
from pathlib import Path

import peers  # bench/peers.py (bench/ is on sys.path: conftest.py)
import torch

DEFAULT_PEERS = peers.DEFAULT_FASTDLLM.parent
DEFAULT_DINFER = DEFAULT_PEERS / "dinfer"
DEFAULT_KLASS = DEFAULT_PEERS / "klass"
DEFAULT_PCSAMPLER = DEFAULT_PEERS / "pc-sampler"

KLASS_MASK = 126336  # LLaDA's mask id, which KLASS's LLaDA function sets whatever mask_id it is given
FORWARD_LIMIT_PER_TOKEN = 8
DINFER_DECODERS = ("threshold", "credit", "hierarchy")


# ---------------------------------------------------------------------------------------------------------- finders


def _where(flag: str, option, default: Path) -> str:
    return f"{flag} {option}" if option else f"the default {default}"


def find_dinfer(option: str | None) -> tuple[Path | None, str]:
    """(the dInfer checkout folder, "") or (None, why not): ``option``, else the default folder when it exists. Only
    its ``python/dinfer/decoding`` package is loaded (the rest of dInfer needs SGLang / vLLM)."""
    folder = Path(option) if option else DEFAULT_DINFER
    decoding = folder / "python" / "dinfer" / "decoding"
    strategy = decoding / "parallel_strategy.py"
    if not (decoding / "generate_uniform.py").is_file() or not strategy.is_file() or \
            "CreditThresholdParallelDecoder" not in strategy.read_text():
        return None, (f"no dInfer checkout at {_where('--peer-dinfer', option, DEFAULT_DINFER)} "
                      "(python/dinfer/decoding/ with generate_uniform.py and the credit decoder missing); pass "
                      "--peer-dinfer DIR (a clone of inclusionAI/dInfer)")
    return folder, ""


def find_klass(option: str | None) -> tuple[Path | None, str]:
    """(the KLASS checkout folder, "") or (None, why not): ``option``, else the default folder when it exists."""
    folder = Path(option) if option else DEFAULT_KLASS
    llada = folder / "src" / "model" / "llada_klass.py"
    if not llada.is_file() or "stable_confident_decode" not in llada.read_text() or \
            not (folder / "src" / "model" / "dream_klass.py").is_file():
        return None, (f"no KLASS checkout at {_where('--peer-klass', option, DEFAULT_KLASS)} "
                      "(src/model/llada_klass.py with stable_confident_decode, or src/model/dream_klass.py, missing); "
                      "pass --peer-klass DIR (a clone of shkim0116/KLASS)")
    return folder, ""


def find_pcsampler(option: str | None) -> tuple[Path | None, str]:
    """(the PC-Sampler checkout folder, "") or (None, why not): ``option``, else the default folder when it exists."""
    folder = Path(option) if option else DEFAULT_PCSAMPLER
    generate = folder / "src" / "generate.py"
    if not generate.is_file() or "generate_with_pc_sampler" not in generate.read_text() or \
            not (folder / "utils" / "load_json_or_jsonl.py").is_file():
        return None, (f"no PC-Sampler checkout at {_where('--peer-pcsampler', option, DEFAULT_PCSAMPLER)} "
                      "(src/generate.py with generate_with_pc_sampler, or utils/load_json_or_jsonl.py, missing); "
                      "pass --peer-pcsampler DIR (a clone of NEUIR/Uncode, formerly NEUIR/PC-Sampler)")
    return folder, ""


# ------------------------------------------------------------------------------------------------------ the wrapper


class _Counted:
    """The model a peer function calls: counts its forwards, keeps the last canvas it was given (``last``, the very
    tensor, not a copy), maps ``remap = (theirs, ours)`` in that canvas before the forward (KLASS's hard-coded mask
    id), and stops a loop that does not end after ``limit`` forwards. ``device`` and ``config`` are what the peer
    functions read besides calling it."""

    def __init__(self, peer, limit: int, remap: tuple | None = None, config=None):
        self.peer, self.limit, self.remap, self.forwards, self.last = peer, limit, remap, 0, None
        self.device = peer.device
        if config is not None:
            self.config = config

    def __call__(self, x, *args, **kwargs):
        self.forwards += 1
        if self.forwards > self.limit:
            raise RuntimeError(f"the peer's loop ran past {self.limit} forwards without ending (a rule that commits "
                               "nothing, or commits the mask token again, when the model proposes the mask token)")
        self.last = x
        if self.remap is not None:
            x = torch.where(x == self.remap[0], self.remap[1], x)
        return self.peer(x, *args, **kwargs)


def _limit(gen_length: int) -> int:
    return FORWARD_LIMIT_PER_TOKEN * gen_length + 64


def _device(peer):
    return next(peer.parameters()).device


def _module(name: str, path: Path):
    """The file ``path`` imported as the module ``name``, once."""
    return peers.import_file(name, path)


# ----------------------------------------------------------------------------------------------------------- dInfer

_LAYOUTLM = "transformers.models.layoutlmv2.modeling_layoutlmv2"


def _layoutlm_stub():
    """dInfer's ``generate_uniform.py`` imports ``relative_position_bucket`` from transformers' LayoutLMv2 modelling
    at module level and never calls it. Where that import fails (a transformers without the module, or whose module
    fails to import), a stub module holding only that name (raising if called) goes into ``sys.modules``."""
    try:
        if hasattr(importlib.import_module(_LAYOUTLM), "relative_position_bucket"):
            return
    except Exception:  # noqa: BLE001  (any import failure of an unrelated model's module)
        pass

    def relative_position_bucket(*args, **kwargs):
        raise NotImplementedError("stub: dInfer's decoding code imports this LayoutLMv2 helper but does not use it")

    stub = types.ModuleType(_LAYOUTLM)
    stub.relative_position_bucket = relative_position_bucket
    sys.modules[_LAYOUTLM] = stub


def dinfer_package(folder: Path):
    """dInfer's ``python/dinfer/decoding`` as the package ``dinfer_decoding`` (its imports are relative), once."""
    if "dinfer_decoding" not in sys.modules:
        _layoutlm_stub()
    return peers._package("dinfer_decoding", Path(folder) / "python" / "dinfer" / "decoding")


def dinfer_decoder(folder: Path, decoder: str, *, mask_id: int, eos_id: int, threshold: float = 0.9, **knobs):
    """A fresh dInfer decoder object, greedy (temperature 0): ``"threshold"`` (`ThresholdParallelDecoder`;
    ``use_float64``), ``"credit"`` (`CreditThresholdParallelDecoder`; ``credit_alpha`` 0.7, ``boost_gamma`` 0.2,
    ``decay_beta`` 0.8 by its defaults) or ``"hierarchy"`` (`HierarchyDecoder`; ``low_threshold`` 0.4 by its
    default). ``threshold`` defaults to 0.9, dInfer's benchmark default (its classes have none, the hierarchy's
    None). The credit decoder keeps state across calls, so each run gets a new one."""
    pkg = dinfer_package(folder)
    common = dict(temperature=0.0, threshold=threshold, mask_id=mask_id, eos_id=eos_id)
    if decoder == "threshold":
        return pkg.ThresholdParallelDecoder(**common, **knobs)
    if decoder == "credit":
        return pkg.CreditThresholdParallelDecoder(**common, **knobs)
    if decoder == "hierarchy":
        return pkg.HierarchyDecoder(**common, **knobs)
    raise ValueError(f"unknown dInfer decoder {decoder!r}; known: {', '.join(DINFER_DECODERS)}")


def run_dinfer(folder: Path, peer, decoder: str, prompt: list, *, gen_length: int, block: int, mask_id: int,
               eos_id: int, early_stop: bool = False, maximum_unroll: int = 4, expected_tpf: int = 8,
               compiled: bool = False, **knobs) -> tuple[torch.Tensor, int]:
    """dInfer's ``BlockWiseDiffusionLLM(model, decoder, BlockIteratorFactory(), early_stop=False,
    cache_factory=None).generate(prompt, gen_length, block)`` on one prompt with the decoder `dinfer_decoder` builds
    from ``decoder`` and ``knobs``: (canvas [1, P + G], forwards).

    The canvas is the ``TokenArray`` it decoded into (the tensor of its last forward, which the last ``decode``
    completed in place), not ``get_generated_tokens()``, which drops every eos token at batch 1. Its block loop stops
    after the first block holding ``eos_id`` whatever ``early_stop`` is (``early_stop=True`` also fills the rest with
    eos), so with ``early_stop=False`` the blocks after it stay masked. ``forwards`` counts the model calls: its
    ``BlockRunner`` runs ``max(min(masks // expected_tpf, maximum_unroll), 1)`` iterations between two looks at the
    block, so a block may end with forwards that commit nothing (``maximum_unroll=1`` looks after each).
    ``get_transfer_index_threshold`` (threshold and credit decoders) is decorated with ``torch.compile``; unless
    ``compiled``, it runs eagerly (``torch.compiler.set_stance("force_eager")``), its own code unchanged."""
    pkg = dinfer_package(folder)
    model = _Counted(peer, _limit(gen_length))
    llm = pkg.BlockWiseDiffusionLLM(model, dinfer_decoder(folder, decoder, mask_id=mask_id, eos_id=eos_id, **knobs),
                                    pkg.BlockIteratorFactory(), early_stop=early_stop, cache_factory=None,
                                    maximum_unroll=maximum_unroll, expected_tpf=expected_tpf)
    ids = torch.tensor([prompt], device=model.device)
    stance = contextlib.nullcontext() if compiled else torch.compiler.set_stance("force_eager")
    with stance:
        llm.generate(ids, gen_length=gen_length, block_length=block)
    canvas = model.last.clone()
    assert canvas.shape == (1, len(prompt) + gen_length), canvas.shape
    assert llm.num_forwards == model.forwards
    return canvas, model.forwards


# ------------------------------------------------------------------------------------------------------------ KLASS


def klass_llada_module(folder: Path):
    """KLASS's ``src/model/llada_klass.py`` as the module ``klass_llada``."""
    return _module("klass_llada", Path(folder) / "src" / "model" / "llada_klass.py")


def run_klass_llada(folder: Path, peer, prompt: list, *, gen_length: int, steps: int, block: int,
                    conf_threshold: float, kl_threshold: float, kl_history_length: int = 2,
                    mask_id: int | None = None) -> tuple[torch.Tensor, int]:
    """KLASS's ``stable_confident_decode(model, None, prompt, gen_length, steps, block, temperature=0,
    conf_threshold=..., kl_threshold=..., kl_history_length=..., alg="klass", unmask_strategy="all")`` on a Fast-dLLM
    LLaDA peer (`peers.load_llada`): (canvas [1, P + G], its ``used_steps``, which counts its forwards).

    It overwrites ``mask_id`` with 126336 inside, so the model it calls maps 126336 to ``mask_id`` (default the peer
    config's ``mask_token_id``, the testbed's) before each forward, and the returned canvas has ``mask_id`` where
    126336 is left; it reads the vocabulary size from ``model.config.vocab_size`` (the wrapper has no ``lm_head``:
    the peer's logits width, ``embedding_size`` or ``vocab_size``). A token equal to ``mask_id`` that it commits (the
    model's argmax there) is an ordinary token to it but a mask to the model and in the canvas."""
    module = klass_llada_module(folder)
    cfg = peer.config
    mask_id = cfg.mask_token_id if mask_id is None else mask_id
    vocab = getattr(cfg, "embedding_size", None) or cfg.vocab_size
    model = _Counted(peer, _limit(gen_length), remap=(KLASS_MASK, mask_id),
                     config=types.SimpleNamespace(vocab_size=vocab))
    ids = torch.tensor([prompt], device=model.device)
    x, used = module.stable_confident_decode(model, None, ids, gen_length, steps, block, temperature=0.0,
                                             conf_threshold=conf_threshold, kl_threshold=kl_threshold,
                                             kl_history_length=kl_history_length, alg="klass", unmask_strategy="all")
    assert used == model.forwards
    return x.masked_fill(x == KLASS_MASK, mask_id), int(used)


def klass_dream_module(folder: Path, package: str = "fastdllm_dream"):
    """KLASS's ``src/model/dream_klass.py`` (a drop-in for Dream's ``generation_utils.py``) registered as the module
    ``{package}.generation_utils_klass``, beside the peer's Dream modelling (it has no relative imports)."""
    importlib.import_module(package)
    return _module(f"{package}.generation_utils_klass", Path(folder) / "src" / "model" / "dream_klass.py")


def klass_dream_config(folder: Path, *, gen_length: int, steps: int, conf_threshold: float, kl_threshold: float,
                       kl_history_length: int = 2, mask_id: int, eos_id: int, pad_id: int, bos_id: int | None,
                       package: str = "fastdllm_dream"):
    """KLASS's own ``DreamGenerationConfig``, greedy, ``alg='klass'``, ``unmask_strategy='all'`` (its ``validate``
    accepts transformers 5's keyword arguments, as `peers.dream_generation_config`'s)."""
    module = klass_dream_module(folder, package)

    class Config(module.DreamGenerationConfig):
        def validate(self, *args, **kwargs):  # transformers 5 passes user_set_attributes=...
            pass

    return Config(temperature=0.0, max_new_tokens=gen_length, steps=steps, alg="klass", unmask_strategy="all",
                  conf_threshold=conf_threshold, kl_threshold=kl_threshold, kl_history_length=kl_history_length,
                  mask_token_id=mask_id, eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=bos_id,
                  return_dict_in_generate=False)


def run_klass_dream(folder: Path, peer, prompt: list, *, gen_length: int, steps: int, conf_threshold: float,
                    kl_threshold: float, kl_history_length: int = 2, spec=None) -> tuple[torch.Tensor, int]:
    """KLASS's Dream sampler (``DreamGenerationMixin.diffusion_generate`` -> ``_sample`` of its ``dream_klass.py``,
    unchanged) on a Fast-dLLM Dream peer (`peers.load_dream`): (canvas [1, P + G], forwards).

    Its methods are bound to a proxy of the peer (a subclass of KLASS's mixin whose other attributes are the peer's
    and whose calls are the peer's forwards), so the peer keeps the block sampler `peers.load_dream` bound to it. The
    ids (mask, eos, pad, bos) are ``spec``'s (a tracelock ModelSpec), else the peer config's. ``forwards`` is counted:
    KLASS's own ``used_steps`` starts at 256 and is set only when a pass finds no mask left, so it reads 256 whenever
    the last mask is committed at the last of ``steps`` passes, or masks are left. Masks are left when ``steps`` <
    ``gen_length`` (a pass with no ready position commits exactly one) or when it commits the mask token itself."""
    cfg = peer.config
    ids_of = (dict(mask_id=spec.mask_id, eos_id=spec.eos_id, pad_id=spec.pad_id, bos_id=spec.bos_id) if spec else
              dict(mask_id=cfg.mask_token_id, eos_id=cfg.eos_token_id, pad_id=cfg.pad_token_id,
                   bos_id=cfg.bos_token_id))
    package = type(peer).__module__.rpartition(".")[0] or "fastdllm_dream"
    module = klass_dream_module(folder, package)
    config = klass_dream_config(folder, gen_length=gen_length, steps=steps, conf_threshold=conf_threshold,
                                kl_threshold=kl_threshold, kl_history_length=kl_history_length, package=package,
                                **ids_of)

    class KlassDream(module.DreamGenerationMixin):
        def __init__(self, peer):
            self.peer, self.forwards, self.limit = peer, 0, _limit(gen_length)

        def __getattr__(self, name):  # device, config, generation_config, lm_head
            return getattr(self.__dict__["peer"], name)

        def __call__(self, *args, **kwargs):
            self.forwards += 1
            if self.forwards > self.limit:
                raise RuntimeError(f"KLASS's Dream loop ran past {self.limit} forwards")
            return self.peer(*args, **kwargs)

    proxy = KlassDream(peer)
    ids = torch.tensor([prompt], device=_device(peer))
    with warnings.catch_warnings():
        # Dream's bos = eos = pad id: the "padding was detected but no attention mask" warning means nothing here
        warnings.filterwarnings("ignore", message="Padding was detected")
        x, _ = proxy.diffusion_generate(ids, generation_config=config)
    return x, proxy.forwards


# ------------------------------------------------------------------------------------------------------- PC-Sampler


def pcsampler_module(folder: Path):
    """PC-Sampler's ``src/generate.py`` as the module ``pcsampler_generate``. It puts its project root on sys.path
    at import time (for ``from utils.load_json_or_jsonl import ...`` in ``load_baseline``); sys.path is restored after
    the import, and `_pcsampler_utils` gives that import its module while a run loads a table."""
    name = "pcsampler_generate"
    if name not in sys.modules:
        saved = list(sys.path)
        try:
            _module(name, Path(folder) / "src" / "generate.py")
        finally:
            sys.path[:] = saved
    return sys.modules[name]


@contextlib.contextmanager
def _pcsampler_utils(folder: Path):
    """``utils.load_json_or_jsonl`` importable as PC-Sampler's own file (``utils`` is a common top-level name)."""
    loader = _module("pcsampler_load_json_or_jsonl", Path(folder) / "utils" / "load_json_or_jsonl.py")
    package = types.ModuleType("utils")
    package.__path__ = []
    package.load_json_or_jsonl = loader
    with peers.modules_in_place({"utils": package, "utils.load_json_or_jsonl": loader}):
        yield


def run_pc_sampler(folder: Path, peer, prompt: list, *, steps: int, gen_length: int, block: int, lambd: float,
                   alpha: float, background: dict, mask_id: int | None = None) -> tuple[torch.Tensor, int]:
    """PC-Sampler's ``generate_with_pc_sampler(model, prompt, steps, gen_length, block, lambd, alpha, baseline_name,
    temperature=0, mask_id=mask_id)`` on a LLaDA peer: (canvas [1, P + G], forwards). ``mask_id`` defaults to the
    peer config's ``mask_token_id`` (the testbed's).

    ``background`` (``{"num_token": N, "p_baseline_dict": {token_id: count}}``, e.g. the bundled
    models' ``background.json``) is written
    to a temporary JSON file whose path is its ``baseline_name``; it loads a table only while its module global
    ``BASE_LINE`` is None (a float32 tensor of 126464 entries, 1 / N for absent tokens), so the global is reset before
    and after each call. Exactly ``steps`` forwards; the schedule commits ``k`` of the block's masks per step, so a
    mask is left only where the model's argmax is the mask token itself."""
    module = pcsampler_module(folder)
    mask_id = peer.config.mask_token_id if mask_id is None else mask_id
    model = _Counted(peer, _limit(gen_length))
    ids = torch.tensor([prompt], device=model.device)
    with tempfile.TemporaryDirectory(prefix="tracelock-pcsampler-") as tmp, _pcsampler_utils(folder):
        path = Path(tmp) / "background.json"
        path.write_text(json.dumps({"num_token": background["num_token"],
                                    "p_baseline_dict": {str(k): v for k, v in background["p_baseline_dict"].items()}}))
        module.BASE_LINE = None
        try:
            x = module.generate_with_pc_sampler(model, ids, steps=steps, gen_length=gen_length, block_length=block,
                                                lambd=lambd, alpha=alpha, baseline_name=str(path), temperature=0.0,
                                                mask_id=mask_id)
        finally:
            module.BASE_LINE = None
    return x, model.forwards


def run_eb_sampler(folder: Path, peer, prompt: list, *, gamma: float, gen_length: int,
                   mask_id: int | None = None) -> tuple[torch.Tensor, int]:
    """The EB-Sampler in PC-Sampler's code (third-party; ``generate_with_eb_sampler(model, prompt, gamma, gen_length,
    temperature=0, mask_id=mask_id)``) on a LLaDA peer: (canvas [1, P + G], forwards). Whole sequence, no blocks, it
    loops until no mask is left (a committed mask token is decoded again)."""
    module = pcsampler_module(folder)
    mask_id = peer.config.mask_token_id if mask_id is None else mask_id
    model = _Counted(peer, _limit(gen_length))
    ids = torch.tensor([prompt], device=model.device)
    x = module.generate_with_eb_sampler(model, ids, gamma=gamma, gen_length=gen_length, temperature=0.0,
                                        mask_id=mask_id)
    return x, model.forwards


# ------------------------------------------------------------------------------------------ the background table

