"""Fast-dLLM's own decoding code (NVlabs/Fast-dLLM), loaded at run time from a checkout, run beside tracelock.

Nothing of Fast-dLLM is copied into this repository: `find_fastdllm` takes the folder of a checkout (``--peer-fastdllm
DIR``; default ``../shared/peers/fast-dllm`` relative to the repository when it exists), and its modules are imported
from there. Its models get tracelock's own weights (the same tensors, no copy), so both decode the same checkpoint.

Fast-dLLM was written against transformers 4.49; with transformers 5 three things need help, all from outside its
code: its LLaDA ``from_pretrained`` fails (the module is built from its config and given the weights directly) and its
config lost the ``use_cache`` attribute (set back); its Dream rotary embedding looks up a "default" RoPE initialiser
that transformers 5 dropped (the standard inverse frequencies are registered under that name, only if missing); its
Dream generation config's ``validate`` does not take transformers 5's keyword argument (a subclass accepts it).
"""

import hashlib
import importlib
import importlib.util
import subprocess
import sys
import types
from contextlib import contextmanager
from pathlib import Path

import torch

DEFAULT_FASTDLLM = Path(__file__).resolve().parents[1].parent / "shared" / "peers" / "fast-dllm"
# Fast-dLLM++ (Ringo-Star/FastdLLM_plusplus): Fast-dLLM's functions with its Fréchet profile rule (``frechet_margin``)
DEFAULT_PLUSPLUS = DEFAULT_FASTDLLM.parent / "fast-dllm-plusplus"


def find_fastdllm(option: str | None) -> tuple[Path | None, str]:
    """(the checkout folder, "") or (None, why not): ``option``, else the default folder when it exists."""
    folder = Path(option) if option else DEFAULT_FASTDLLM
    if not (folder / "llada" / "generate.py").is_file():
        where = f"--peer-fastdllm {option}" if option else f"the default {DEFAULT_FASTDLLM}"
        return None, (f"no Fast-dLLM checkout at {where} (llada/generate.py missing); pass --peer-fastdllm DIR "
                      "(a clone of NVlabs/Fast-dLLM)")
    try:
        import einops  # noqa: F401  (Fast-dLLM's LLaDA model imports it)
    except ImportError:
        return None, "Fast-dLLM's LLaDA code needs einops: pip install einops"
    return folder, ""


def find_plusplus(option: str | None) -> tuple[Path | None, str]:
    """(the Fast-dLLM++ checkout folder, "") or (None, why not): ``option``, else the default folder when it exists.
    Its modules load under names of their own (`load_plusplus_llada`, `load_dream`), so it runs beside Fast-dLLM."""
    folder = Path(option) if option else DEFAULT_PLUSPLUS
    where = f"--peer-plusplus {option}" if option else f"the default {DEFAULT_PLUSPLUS}"
    generate = folder / "llada" / "generate.py"
    if not generate.is_file() or "get_transfer_index_frechet_profile" not in generate.read_text():
        return None, (f"no Fast-dLLM++ checkout at {where} (llada/generate.py with the Fréchet profile rule missing); "
                      "pass --peer-plusplus DIR (a clone of Ringo-Star/FastdLLM_plusplus, its v1/ folder)")
    if not (folder / "dream" / "model" / "generation_utils_block.py").is_file():
        return None, f"the Fast-dLLM++ checkout at {where} has no dream/model/generation_utils_block.py"
    return folder, ""


def fastdllm_version(folder) -> dict:
    """Which Fast-dLLM ran, for the result files: the checkout's git commit when it is a git clone, and always the
    sha256 of the files whose functions run (a copy without git history is identified by them alone)."""
    folder = Path(folder)
    out = {}
    try:
        git = subprocess.run(["git", "-C", str(folder), "rev-parse", "--show-toplevel", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        top, head = (git.stdout.split() + ["", ""])[:2]
        # only the checkout's own history: a copy inside another repository would name that repository's commit
        if git.returncode == 0 and Path(top).resolve() == folder.resolve():
            out["commit"] = head
    except (OSError, subprocess.TimeoutExpired):
        pass
    for name in ("llada/generate.py", "llada/model/modeling_llada.py", "dream/model/generation_utils_block.py"):
        path = folder / name
        if path.is_file():
            out[f"sha256:{name}"] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


@contextmanager
def _no_random_init():
    """Skip the random initialisation of the layers a peer model builds: its weights are replaced right after. Its
    ``post_init`` too, through transformers' ``no_init_weights`` where it exists (Dream's ``_init_weights`` draws
    every weight with ``normal_`` on the CPU: tens of seconds at 7B)."""
    saved = {cls: cls.reset_parameters for cls in (torch.nn.Linear, torch.nn.Embedding)}
    for cls in saved:
        cls.reset_parameters = lambda self: None
    try:
        with _transformers_no_init():
            yield
    finally:
        for cls, fn in saved.items():
            cls.reset_parameters = fn


def _transformers_no_init():
    """transformers' ``no_init_weights()`` (v5: ``transformers.initialization``; v4: ``transformers.modeling_utils``),
    else a context that does nothing."""
    from contextlib import nullcontext

    for module in ("transformers.initialization", "transformers.modeling_utils"):
        try:
            return importlib.import_module(module).no_init_weights()
        except (ImportError, AttributeError):
            continue
    return nullcontext()


def _shared_state(model) -> dict:
    """{official checkpoint key: tracelock's parameter tensor} of ``model``."""
    from tracelock.models.keys import official_keys

    params = model.released_weights()  # q/k/v and gate/up as views of tracelock's fused products: no copy
    return {official: params[ours] for official, ours in official_keys(model.spec).items()}


def _buffers_to(peer, device):
    """``peer`` with the buffers it built on the CPU (Dream's RoPE ``inv_freq``) moved to ``device``, where its
    weights (tracelock's tensors) already are: ``Module.to`` leaves a tensor already there as it is, no copy."""
    return peer.to(device)


def llada_generate_module(folder: Path):
    """Fast-dLLM's ``llada/generate.py`` (it imports ``model.modeling_llada``, so ``llada/`` goes on sys.path)."""
    llada = str(folder / "llada")
    if llada not in sys.path:
        sys.path.insert(0, llada)
    return importlib.import_module("generate")


def load_llada(folder: Path, model, config: dict):
    """Fast-dLLM's ``LLaDAModelLM`` built from ``config`` (an official LLaDA config.json as a dict) on ``model``'s
    weights (a tracelock LLaDA backbone; the tensors are shared)."""
    llada_generate_module(folder)
    from model.configuration_llada import LLaDAConfig
    from model.modeling_llada import LLaDAModelLM

    cfg = LLaDAConfig(**config)
    if not hasattr(cfg, "use_cache"):  # transformers 5 drops it from the config; the peer's forward reads it
        cfg.use_cache = False
    with _no_random_init():
        peer = LLaDAModelLM(cfg, init_params=False)
    peer.load_state_dict(_shared_state(model), strict=True, assign=True)
    return _buffers_to(peer, model.device).eval()


@contextmanager
def _registering_again():
    """transformers' ``AutoConfig.register`` / ``AutoModel.register`` with ``exist_ok=True``: two peers' LLaDA
    modules both register the model type "llada" when they load, which the second would otherwise refuse."""
    from transformers import AutoConfig, AutoModel

    own = {cls: cls.__dict__.get("register") for cls in (AutoConfig, AutoModel)}
    config_register, model_register = AutoConfig.register, AutoModel.register
    AutoConfig.register = staticmethod(lambda *a, **k: config_register(*a, **{**k, "exist_ok": True}))
    AutoModel.register = classmethod(lambda cls, *a, **k: model_register.__func__(cls, *a, **{**k, "exist_ok": True}))
    try:
        yield
    finally:
        for cls, attr in own.items():
            if attr is None:
                del cls.register
            else:
                cls.register = attr


def import_file(name: str, path: Path, search: list | None = None):
    """The file ``path`` imported as the module ``name`` (a package with ``search``, its folders), once."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path, submodule_search_locations=search)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


@contextmanager
def modules_in_place(modules: dict):
    """``modules`` ({name: module}) in ``sys.modules`` for the block; what those names held before is put back."""
    saved = {k: sys.modules.get(k) for k in modules}
    sys.modules.update(modules)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def _package(name: str, root: Path):
    """The folder ``root`` (a package whose imports are relative) imported as the package ``name``, once."""
    return import_file(name, root / "__init__.py", [str(root)])


def _dream_package(folder: Path, name: str = "fastdllm_dream"):
    """A peer's ``dream/model`` as the package ``name`` (its imports are relative): Fast-dLLM's as ``fastdllm_dream``,
    Fast-dLLM++'s as ``fastdllmpp_dream``; its block sampler module."""
    import transformers.modeling_rope_utils as rope

    rope.ROPE_INIT_FUNCTIONS.setdefault("default", _default_rope)
    _package(name, folder / "dream" / "model")
    return importlib.import_module(f"{name}.generation_utils_block")


def plusplus_generate_module(folder: Path):
    """Fast-dLLM++'s ``llada/generate.py`` as the module ``fastdllmpp_generate``, its ``llada/model`` as the package
    ``fastdllmpp_llada``. Nothing goes on sys.path: while it loads, its ``from model.modeling_llada import ...``
    sees that package, so it runs beside Fast-dLLM's own ``generate`` and ``model``."""
    with _registering_again():
        package = _package("fastdllmpp_llada", folder / "llada" / "model")
    name = "fastdllmpp_generate"
    if name not in sys.modules:
        with modules_in_place({"model": package, "model.modeling_llada": package.modeling_llada}):
            spec = importlib.util.spec_from_file_location(name, folder / "llada" / "generate.py")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            sys.modules[name] = module
    return sys.modules[name]


def load_plusplus_llada(folder: Path, model, config: dict):
    """Fast-dLLM++'s own ``LLaDAModelLM`` built from ``config`` (an official LLaDA config.json as a dict) on
    ``model``'s weights, for the functions of `plusplus_generate_module`."""
    plusplus_generate_module(folder)
    package = sys.modules["fastdllmpp_llada"]
    cfg = package.LLaDAConfig(**config)
    if not hasattr(cfg, "use_cache"):  # transformers 5 drops it from the config; the peer's forward reads it
        cfg.use_cache = False
    with _no_random_init():
        peer = package.LLaDAModelLM(cfg, init_params=False)
    peer.load_state_dict(_shared_state(model), strict=True, assign=True)
    return _buffers_to(peer, model.device).eval()


class _ExactForward:
    """A peer Dream model seen through its block sampler's calls, every call answered by a forward of the whole
    canvas without a cache: a refresh (no ``past_key_values``) records the canvas, a cached call writes its slice
    (the block under the dual cache, the block and the suffix under the prefix cache) into it and gets that slice's
    rows. So the sampler's loop and rule run unchanged on exact logits; ``forwards`` counts its calls."""

    def __init__(self, peer):
        self.peer, self.device, self.forwards, self.canvas = peer, peer.device, 0, None

    def __call__(self, x, attention_mask=None, tok_idx=None, past_key_values=None, use_cache=False, dual_cache=False,
                 replace_position=None):
        self.forwards += 1
        if past_key_values is None:
            self.canvas, start = x.clone(), 0
        else:
            start = int(replace_position[0].nonzero()[0]) if dual_cache else self.canvas.shape[1] - x.shape[1]
            self.canvas[:, start:start + x.shape[1]] = x
        logits = self.peer(self.canvas, attention_mask, tok_idx).logits
        # the sampler slices the returned cache's positions before the block: any tensor of the canvas' length
        return types.SimpleNamespace(logits=logits[:, start:start + x.shape[1]],
                                     past_key_values=[(torch.zeros(1, self.canvas.shape[1], 1),)])


def run_dream_exact(folder: Path, peer, config, prompt: list, *, block: int, package: str = "fastdllm_dream",
                    dual_cache: bool = True, threshold: float = 0.9, **rule):
    """A peer's Dream block sampler (``_sample`` of its ``generation_utils_block.py``, unchanged) on one prompt with
    exact logits at every step (`_ExactForward`): (canvas [1, P + G], forwards). Its loop and rule against
    tracelock's Dream forms without a cache, the cache's own approximation set aside."""
    import copy

    sampler = _dream_package(folder, package)
    exact = _ExactForward(peer)
    config = copy.deepcopy(config)
    config.max_length = len(prompt) + config.max_new_tokens
    ids = torch.tensor([prompt], device=exact.device)
    with torch.no_grad():
        canvas = sampler.DreamGenerationMixin._sample(exact, ids, attention_mask=None, generation_config=config,
                                                      threshold=threshold, block_length=block,
                                                      dual_cache=dual_cache, **rule)
    return canvas, exact.forwards


def _default_rope(config, device=None, seq_len=None, **_):
    """The standard RoPE inverse frequencies (transformers 4's "default" initialiser): (inv_freq, scaling 1)."""
    dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
    return 1.0 / (config.rope_theta ** exponents), 1.0


def load_dream(folder: Path, model, config: dict, package: str = "fastdllm_dream"):
    """Fast-dLLM's ``DreamModel`` from ``config`` (a Dream config.json as a dict) on ``model``'s weights, with its
    block sampler (``dream/model/generation_utils_block.py``) bound as its ``diffusion_generate``. Fast-dLLM++'s:
    ``package="fastdllmpp_dream"`` with its folder."""
    sampler = _dream_package(folder, package)
    DreamConfig = importlib.import_module(f"{package}.configuration_dream").DreamConfig
    DreamModel = importlib.import_module(f"{package}.modeling_dream").DreamModel

    with _no_random_init():
        peer = DreamModel(DreamConfig(**config))
    peer.load_state_dict(_shared_state(model), strict=True, assign=True)
    _buffers_to(peer, model.device)
    peer.diffusion_generate = types.MethodType(sampler.DreamGenerationMixin.diffusion_generate, peer)
    peer._sample = types.MethodType(sampler.DreamGenerationMixin._sample, peer)
    return peer.eval()


def dream_generation_config(folder: Path, spec, gen_length: int, steps: int, alg: str = "confidence_threshold",
                            package: str = "fastdllm_dream"):
    """The block sampler's generation config, greedy: ``alg="confidence_threshold"`` (the threshold rule; ``steps``
    only has to divide by the block count), or any other ``alg`` for its scheduled rule (``steps`` steps in all, a
    block's count of each step from Dream's ``int(n (1 - s/t))``, ranked by neg-entropy). Fast-dLLM++'s Fréchet rule
    overrides ``alg`` when `run_dream` passes ``frechet_margin``."""
    sampler = _dream_package(folder, package)

    class Config(sampler.DreamGenerationConfig):
        def validate(self, *args, **kwargs):  # transformers 5 passes user_set_attributes=...
            pass

    return Config(temperature=0.0, max_new_tokens=gen_length, steps=steps, alg=alg,
                  mask_token_id=spec.mask_id, eos_token_id=spec.eos_id, pad_token_id=spec.pad_id,
                  bos_token_id=spec.bos_id, return_dict_in_generate=False)


# Fast-dLLM's functions and the tracelock settings with the same rule; all greedy, semi-AR blocks
LLADA_RULES = {
    # name: (Fast-dLLM function in llada/generate.py, its threshold, tracelock's fused_generate settings)
    "fastdllm-0.9-dual": ("generate_with_dual_cache", 0.9, dict(policy="threshold", policy_args={"tau": 0.9},
                                                                 cache="dual")),
    "fastdllm-0.9-prefix": ("generate_with_prefix_cache", 0.9, dict(policy="threshold", policy_args={"tau": 0.9},
                                                                     cache="prefix")),
    "fastdllm-0.9": ("generate", 0.9, dict(policy="threshold", policy_args={"tau": 0.9})),
    "confidence": ("generate", None, dict(policy="confidence")),
    # k per step with the dual cache: Fast-dLLM's steps = gen_length // k, tracelock's per_step = k
    "confidence-dual": ("generate_with_dual_cache", None, dict(policy="confidence", cache="dual")),
}
DREAM_RULE = "fastdllm-dream-0.9-dual"
DREAM_SETTINGS = dict(policy="threshold", policy_args={"tau": 0.9, "first_token": True}, cache="dual")


def run_llada(generate_module, peer, rule: str, prompt: list, *, gen_length: int, block: int, mask_id: int,
              steps: int | None = None):
    """Fast-dLLM's function of ``rule`` on one prompt (its functions take batch 1): (canvas [1, P + G], NFE).
    ``steps`` (default gen_length) is its own ``steps`` argument: a rule without a threshold commits
    gen_length // steps tokens per step (LLaDA's schedule; tracelock's ``per_step``)."""
    name, threshold, _ = LLADA_RULES[rule]
    device = next(peer.parameters()).device
    ids = torch.tensor([prompt], device=device)
    return getattr(generate_module, name)(peer, ids, steps=steps or gen_length, gen_length=gen_length,
                                          block_length=block, temperature=0.0, remasking="low_confidence",
                                          mask_id=mask_id, threshold=threshold)


def run_dream(peer, config, prompt: list, *, block: int, threshold: float = 0.9, dual_cache: bool = True, **rule):
    """Fast-dLLM's Dream block sampler on one prompt (the dual cache unless ``dual_cache=False``: the prefix cache):
    the canvas [1, P + G]. ``config`` (from `dream_generation_config`) picks the rule: its threshold, or a scheduled
    ``alg`` of ``config.steps`` steps; Fast-dLLM++'s sampler takes ``frechet_margin=delta`` in ``rule``."""
    device = next(peer.parameters()).device
    ids = torch.tensor([prompt], device=device)
    return peer.diffusion_generate(ids, generation_config=config, block_length=block, dual_cache=dual_cache,
                                   threshold=threshold, **rule)
