"""Load LLaDA / Dream checkpoint folders (single or sharded safetensors) into `DiffusionBackbone`."""

import contextlib
import difflib
import hashlib
import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from tracelock.models.backbone import DiffusionBackbone
from tracelock.models.keys import official_keys
from tracelock.models.spec import CheckpointError, ModelSpec

_SUPPORTED_DTYPES = {
    "cpu": (torch.float32, torch.bfloat16),
    "cuda": (torch.float32, torch.bfloat16, torch.float16),
}


_TESTBED = Path(__file__).resolve().parent.parent / "testbed"
# names that load a model shipped inside the package: "testbed" is the LLaDA-family model
BUNDLED = {"testbed": _TESTBED / "model", "testbed-llada": _TESTBED / "model",
           "testbed-dream": _TESTBED / "model-dream"}
# the trained TraceLock controller shipped with each bundled model (`controller="testbed"` etc.)
BUNDLED_CONTROLLERS = {"testbed": _TESTBED / "controller-llada", "testbed-llada": _TESTBED / "controller-llada",
                       "testbed-dream": _TESTBED / "controller-dream"}
# the gates `tracelock fit` chose for each bundled model and task family (a controller with its gate.json: base rule,
# accept, veto): `gate:controller=testbed-llada-math` deploys one
BUNDLED_GATES = {f"testbed-{family}-{task}": _TESTBED / f"gate-{family}-{task}"
                 for family in ("llada", "dream") for task in ("math", "code")}


def resolve_path(path) -> Path:
    """A checkpoint folder: the folder itself, the folder of a bundled model name ("testbed" = "testbed-llada",
    "testbed-dream"), or a Hugging Face Hub id such as "GSAI-ML/LLaDA-8B-Instruct" resolved through huggingface_hub's
    cache (downloaded into it where the network allows). Anything else is an error that names the three kinds."""
    folder = Path(path)
    name = str(path)
    if folder.exists():
        return folder
    if name in BUNDLED:
        folder = BUNDLED[name]
        if not (folder / "config.json").exists():
            family = "dream" if name == "testbed-dream" else "llada"
            raise CheckpointError(f"the bundled {name!r} model is missing from this install ({folder}); "
                                  f"train it with `tracelock testbed-train --family {family} --out DIR` and load DIR")
        return folder
    if is_hub_id(name):
        from tracelock.models.hub import hub_snapshot

        return hub_snapshot(name)
    close = difflib.get_close_matches(name, BUNDLED, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise CheckpointError(f"model {name!r} does not exist: {hint}pass a checkpoint folder (with config.json), a "
                          "Hugging Face Hub id such as GSAI-ML/LLaDA-8B-Instruct, or a bundled model: "
                          f"{', '.join(BUNDLED)}")


def is_hub_id(name: str) -> bool:
    """``org/name`` as the Hub spells repository ids (not a path: no leading ``.``, ``/`` or ``~``)."""
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name) is not None and ".." not in name


def resolve_controller(path) -> Path:
    """A controller run folder, the shipped controller of a bundled model name ("testbed", "testbed-dream"), or a
    bundled gate's ("testbed-llada-math", `BUNDLED_GATES`)."""
    folder = Path(path)
    bundled = {**BUNDLED_CONTROLLERS, **BUNDLED_GATES}
    if not folder.exists() and str(path) in bundled:
        folder = bundled[str(path)]
        if not (folder / "best.safetensors").exists():
            raise FileNotFoundError(f"the bundled {path!r} controller is missing from this install ({folder}); "
                                    "train one with `tracelock train` (docs/tracelock.md) and pass its folder")
    return folder


def _dtype_named(name: str) -> torch.dtype:
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "fp32": torch.float32,
             "bf16": torch.bfloat16, "fp16": torch.float16}
    if name not in names:
        from tracelock.text import did_you_mean

        raise ValueError(f"dtype={name!r} is not a dtype name; use torch.float32 / torch.bfloat16 / torch.float16 or "
                         f"'float32' / 'bfloat16' / 'float16'{did_you_mean(name, names)}")
    return names[name]


def check_dtype(dtype, device) -> None:
    from tracelock.checks import check_device

    device = check_device(device)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype such as torch.bfloat16, got {dtype!r}")
    allowed = _SUPPORTED_DTYPES.get(device.type)
    if allowed is None:
        raise ValueError(f"device {device} is not supported; use 'cpu' or 'cuda'")
    if dtype not in allowed:
        names = ", ".join(str(d) for d in allowed)
        raise ValueError(f"dtype {dtype} is not supported on {device.type}; use one of {names}")


def _tensor_files(folder: Path) -> dict:
    """{official key: safetensors file} from model.safetensors or model.safetensors.index.json."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"{index} is not a valid safetensors index ({err!r}); it needs a "
                                  '"weight_map" {key: shard file}; re-download the checkpoint') from None
        missing = sorted({f for f in weight_map.values() if not (folder / f).exists()})
        if missing:
            raise CheckpointError(f"{index} names shard files that are missing: {missing}; download them too")
        return {k: folder / f for k, f in weight_map.items()}
    single = folder / "model.safetensors"
    if single.exists():
        with _readable(single), safe_open(single, framework="pt") as f:
            return {k: single for k in f.keys()}
    raise CheckpointError(f"{folder} holds no weights: expected model.safetensors or model.safetensors.index.json "
                          "(tracelock never unpickles .bin/.pt files); convert the checkpoint to safetensors")


@contextlib.contextmanager
def _readable(file: Path):
    """A truncated or damaged safetensors file (unreadable header, data cut short) as a `CheckpointError`."""
    try:
        yield
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{file} is not a readable safetensors file ({err}); the download or copy was cut "
                              "short or damaged: download or copy it again") from None


def _check_shipped_digest(folder: Path) -> None:
    """A testbed model shipped by `tracelock testbed-ship` records its weights' sha256 in testbed.json: check it
    (a downloaded checkpoint has no digest beside it, so a flipped bit in its tensor data cannot be seen here)."""
    info = folder / "testbed.json"
    if not info.is_file():
        return
    try:
        want = json.loads(info.read_text()).get("model_safetensors_sha256")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        raise CheckpointError(f"{info} is not a valid JSON object; copy the model folder again") from None
    weights = folder / "model.safetensors"
    if want is None or not weights.is_file():
        return
    digest = hashlib.sha256()
    with open(weights, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    if digest.hexdigest() != want:
        raise CheckpointError(f"{weights} does not match the sha256 recorded in {info.name}: the file is damaged; "
                              "copy the model folder again (the bundled one: reinstall tracelock)")


def load_model(path, *, dtype=None, device=None, quantize=None) -> DiffusionBackbone:
    """Load an HF checkpoint folder of LLaDA or Dream (official key names) as a frozen `DiffusionBackbone`.

    Args:
        path: folder with config.json, tokenizer files and model.safetensors (or a sharded index); a Hugging
            Face Hub id ("GSAI-ML/LLaDA-8B-Instruct": its safetensors, configs and tokenizer, from huggingface_hub's
            cache or downloaded into it); "testbed" / "testbed-dream", the bundled models; or a LLaDA / Dream model
            already loaded with transformers (its tensors shared where the layout allows:
            `tracelock.models.from_transformers`).
        dtype (torch.dtype | str): parameter dtype, or its name ("float32", "bfloat16", "float16"). Default:
            torch.float32 (a transformers module: its own).
        device: "cpu" or "cuda[:i]". Default: "cpu" (a transformers module: its own).
        quantize (str, optional): quantized weights through torchao (the ``quant`` extra): "int8" (CPU and CUDA),
            "int4" or "fp8" (CUDA, bfloat16); the LM head, norms and embedding stay in ``dtype``
            (`tracelock.models.quantize`). A format ``device`` cannot run is refused before any weight is read.
            Default: None (the weights in ``dtype``).

    Returns:
        DiffusionBackbone in eval mode with ``requires_grad=False``; ``model.spec`` is its `ModelSpec`,
        ``model.quantization`` its format (None: not quantized).
    """
    from tracelock.models.from_transformers import backbone_from_module
    from tracelock.models.quantize import check_quantize, quantize_model

    if isinstance(dtype, str):
        dtype = _dtype_named(dtype)
    if isinstance(path, torch.nn.Module) and hasattr(path, "config"):
        first = next(path.parameters())
        dtype, device = dtype or first.dtype, device or first.device
        check_dtype(dtype, device)
        quantize = check_quantize(quantize, device, dtype)
        return quantize_model(backbone_from_module(path, dtype=dtype, device=device), quantize)
    dtype, device = dtype or torch.float32, device or "cpu"
    check_dtype(dtype, device)
    quantize = check_quantize(quantize, device, dtype)
    folder = resolve_path(path)
    spec = ModelSpec.from_pretrained(folder)
    files = _tensor_files(folder)
    _check_shipped_digest(folder)
    expected = official_keys(spec)
    missing = [k for k in expected if k not in files]
    if missing:
        raise CheckpointError(f"{folder}: tensor {missing[0]!r} is missing ({len(missing)} missing in all); "
                              f"the weights do not match config.json ({spec.family}, {spec.num_layers} layers)")
    unexpected = sorted(set(files) - set(expected))
    if unexpected:
        raise CheckpointError(f"{folder}: unexpected tensor {unexpected[0]!r} ({len(unexpected)} in all) for a "
                              f"{spec.family} checkpoint; check that config.json belongs to these weights")

    with torch.device("meta"):
        model = DiffusionBackbone(spec)
    shapes = {name: p.shape for name, p in model.released_weights().items()}
    state = {}
    by_file = {}
    for key, file in files.items():
        by_file.setdefault(file, []).append(key)
    for file, keys in by_file.items():
        with _readable(file), safe_open(file, framework="pt", device="cpu") as f:
            for key in keys:
                name = expected[key]
                got = tuple(f.get_slice(key).get_shape())
                if got != tuple(shapes[name]):
                    raise CheckpointError(f"{file.name}: tensor {key!r} has shape {list(got)} but config.json "
                                          f"implies {list(shapes[name])}; the config and weights do not match")
                state[name] = f.get_tensor(key).to(device=device, dtype=dtype)
    model.load_released(state)
    model.eval().requires_grad_(False)
    return quantize_model(model, quantize)


def load_tokenizer(path):
    """The checkpoint's tokenizer through transformers' classes, offline (never trust_remote_code)."""
    from transformers import PreTrainedTokenizerFast, Qwen2TokenizerFast

    folder = resolve_path(path)
    if (folder / "tokenizer.json").exists():
        tok = PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)
    elif (folder / "vocab.json").exists() and (folder / "merges.txt").exists():
        # Dream ships a slow remote-code copy of Qwen2Tokenizer: the same BPE files load in Qwen2's class
        tok = Qwen2TokenizerFast.from_pretrained(folder, local_files_only=True)
    else:
        raise CheckpointError(f"{folder} has no tokenizer files: expected tokenizer.json, or vocab.json + merges.txt")
    if tok.chat_template is None:
        spec = ModelSpec.from_pretrained(folder)
        tok.chat_template = spec.chat_template
    return tok
