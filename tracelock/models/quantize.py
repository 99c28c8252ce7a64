"""Quantized weights through torchao (the ``quant`` extra): ``load_model(..., quantize="int8" | "int4" | "fp8")``.

Every linear layer of the transformer blocks (the fused q/k/v product, o_proj, the fused gate/up product, down_proj)
gets torchao's quantized weight; the embedding, the norms and the LM head stay in the model's dtype, and so do the
activations: the hidden states the controller taps are computed in that dtype from the quantized products, and the
LM head (which the decode loop's fused head reads as a plain matrix) is never quantized.

- ``int8``: torchao's ``Int8WeightOnlyConfig``, symmetric int8 per output row (one scale per row); CPU and CUDA, any
  of the model's dtypes. The product dequantizes the weight to the activation dtype and multiplies.
- ``int4``: ``Int4WeightOnlyConfig``, asymmetric int4 in groups of 128 along the input, packed for tinygemm
  (``tile_packed_to_4d``, torch's ``_weight_int4pack_mm``); CUDA of compute capability 8.0 or newer, bfloat16.
- ``fp8``: ``Float8DynamicActivationFloat8WeightConfig`` per row: e4m3 weights with one scale per row, the
  activations cast to e4m3 per row at each product (``torch._scaled_mm``); CUDA of compute capability 9.0 or newer
  (H100, H200), bfloat16.

`check_quantize` refuses, before any weight is read, a format the device, the dtype or the installed torchao cannot
run (naming the format, the device and what would run it) and a missing torchao (naming the extra). torchao's
recommended inductor settings are not applied (``set_inductor_config=False``): they are process-wide and would change
how every other model in the process compiles.
"""

import contextlib
import difflib
import logging
import warnings

import torch

from tracelock.extras import MissingExtraError

# the torchao release the [quant] extra pins (constraints.txt), and the oldest whose API this module uses
TORCHAO_MIN = (0, 18)
INT4_GROUP = 128

# format: (what it is, the devices it runs on, in words)
FORMATS = {
    "int8": ("int8 weights, one scale per row: torchao's Int8WeightOnlyConfig", "the CPU and CUDA GPUs"),
    "int4": (f"int4 weights in groups of {INT4_GROUP} in tinygemm's tile_packed_to_4d packing: torchao's "
             "Int4WeightOnlyConfig", "CUDA GPUs of compute capability 8.0 or newer (A100, H100, H200) in bfloat16"),
    "fp8": ("float8 e4m3 weights and activations, one scale per row: torchao's "
            "Float8DynamicActivationFloat8WeightConfig on torch._scaled_mm",
            "CUDA GPUs of compute capability 9.0 or newer (H100, H200) in bfloat16"),
}
# the smallest CUDA compute capability and the one dtype of the GPU-only formats
_CUDA_NEEDS = {"int4": ((8, 0), torch.bfloat16), "fp8": ((9, 0), torch.bfloat16)}


def _say(option: str, value) -> str:
    """``--quantize int4`` on the command line, ``quantize='int4'`` in Python."""
    return f"{option} {value}" if option.startswith("--") else f"{option}={value!r}"


def quantize_format(quantize) -> str | None:
    """None for full precision (None, "none", ""), else the format's name; an unknown name is a ValueError."""
    if quantize is None or (isinstance(quantize, str) and quantize.strip().lower() in ("", "none")):
        return None
    if not isinstance(quantize, str):
        raise TypeError(f"quantize must be a format name ({', '.join(FORMATS)}) or None, got {type(quantize).__name__}")
    name = quantize.strip().lower()
    if name not in FORMATS:
        close = difflib.get_close_matches(name, FORMATS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"quantize={quantize!r} is not a format: use {', '.join(FORMATS)} (or None for the weights "
                         f"in the model's dtype){hint}")
    return name


def device_refusal(fmt: str, device, dtype, *, option: str = "quantize", dtype_option: str = "dtype") -> str | None:
    """Why ``fmt`` cannot run on ``device`` in ``dtype`` (None: it can): the format, the device, what would run it."""
    device = torch.device(device)
    if fmt not in _CUDA_NEEDS:
        return None
    (major, minor), need_dtype = _CUDA_NEEDS[fmt]
    what, where = FORMATS[fmt]
    fallback = f"; on {device.type}, {_say(option, 'int8')} runs"
    if device.type != "cuda":
        return f"{_say(option, fmt)} ({what}) cannot run on {device}: it runs on {where}{fallback}"
    capability = torch.cuda.get_device_capability(device)
    if capability < (major, minor):
        name = torch.cuda.get_device_name(device)
        return (f"{_say(option, fmt)} ({what}) cannot run on {device} ({name}, compute capability "
                f"{capability[0]}.{capability[1]}): it runs on {where}{fallback}")
    if dtype != need_dtype:
        want = "bfloat16" if dtype_option.startswith("--") else "torch.bfloat16"
        shown = str(dtype).removeprefix("torch.") if dtype_option.startswith("--") else str(dtype)
        return (f"{_say(option, fmt)} runs its products in bfloat16 only, not {_say(dtype_option, shown)}: pass "
                f"{_say(dtype_option, want).replace(repr(want), want)}")
    return None


@contextlib.contextmanager
def _quiet_import():
    """torchao's import logs a warning per GPU library that does not load into a CPU build of torch, and torch one
    about an enum torchao registers: neither is the user's business."""
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def import_torchao(fmt: str = "int8", option: str = "quantize"):
    """The torchao module, or a `MissingExtraError` naming the ``quant`` extra (absent, or older than the pin)."""
    install = ('pip install "tracelock[quant]" (in a clone: pip install -c constraints.txt --no-build-isolation -e '
               '".[quant]")')
    try:
        with _quiet_import():
            import torchao
            import torchao.quantization  # noqa: F401
    except ImportError as err:
        raise MissingExtraError(f"{_say(option, fmt)} quantizes with torchao, which is not installed ({err}): "
                                f"{install}") from None
    version = tuple(int(p) for p in torchao.__version__.split("+")[0].split(".")[:2] if p.isdigit())
    if version < TORCHAO_MIN:
        raise MissingExtraError(f"{_say(option, fmt)}: torchao {torchao.__version__} is installed, tracelock needs "
                                f"torchao>={'.'.join(map(str, TORCHAO_MIN))}: {install}")
    return torchao


def check_quantize(quantize, device, dtype, *, option: str = "quantize", dtype_option: str = "dtype") -> str | None:
    """The format's name (None: full precision) once ``device`` and ``dtype`` can run it and torchao imports; else a
    ValueError (format, device, what would run it) or a `MissingExtraError` (the extra). Reads no weights."""
    fmt = quantize_format(quantize)
    if fmt is None:
        return None
    why = device_refusal(fmt, device, dtype, option=option, dtype_option=dtype_option)
    if why:
        raise ValueError(why)
    import_torchao(fmt, option)
    return fmt


def config(fmt: str):
    """torchao's config object of ``fmt``."""
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Int4WeightOnlyConfig,
        Int8WeightOnlyConfig,
        PerRow,
    )

    if fmt == "int8":
        return Int8WeightOnlyConfig(granularity=PerRow(), set_inductor_config=False)
    if fmt == "int4":
        return Int4WeightOnlyConfig(group_size=INT4_GROUP, int4_packing_format="tile_packed_to_4d",
                                    set_inductor_config=False)
    if fmt == "fp8":
        return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False)
    raise ValueError(f"no torchao config for {fmt!r}")


def quantized_layers(model) -> list:
    """The names of the linear layers a format replaces: every ``nn.Linear`` of the blocks (not the LM head)."""
    return [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and name.startswith("blocks.")]


def quantize_model(model, quantize, *, option: str = "quantize"):
    """Quantize ``model``'s block linears in place with torchao (checked first: `check_quantize`); returns it.

    ``model.quantization`` records the format (None: not quantized), and ``model.checkpoint_sample`` the weight sample
    of the full-precision checkpoint (`tracelock.models.sample.weights_sample`), so a controller trained on that
    checkpoint still recognizes it (a quantized weight is not a plain matrix to sample).
    """
    fmt = check_quantize(quantize, model.device, model.dtype, option=option)
    if fmt is None:
        model.quantization = None
        return model
    if getattr(model, "quantization", None):
        raise ValueError(f"the model is already quantized ({model.quantization}); load it again to use {fmt}")
    from tracelock.models.sample import weights_sample

    sample = weights_sample(model)
    layers = set(quantized_layers(model))
    with _quiet_import():
        from torchao.quantization import quantize_

        quantize_(model, config(fmt), filter_fn=lambda m, fqn: fqn in layers)
    # said once per compiled graph by AOT autograd's cache: torchao's weights have no stable hash for it to key on
    warnings.filterwarnings("ignore", message=r".* does not implement _stable_hash_for_caching")
    plain = [n for n in layers if type(model.get_submodule(n).weight) in (torch.Tensor, torch.nn.Parameter)]
    if plain:  # torchao leaves a weight whose shape the format cannot hold (int4: an input not a multiple of 128)
        raise ValueError(f"{_say(option, fmt)}: {len(plain)} of {len(layers)} linear layers cannot take this format "
                         f"(e.g. {plain[0]}, weight {list(model.get_submodule(plain[0]).weight.shape)}): "
                         f"{FORMATS[fmt][0]}; use {_say(option, 'int8')}")
    _inline_blocks(model)
    model.quantization = fmt
    model.checkpoint_sample = sample
    return model


def _inline_blocks(model) -> None:
    """Each block's forward without its regional-compilation mark (`Block.forward`'s nested_compile_region): torch
    2.13's invoke_subgraph has no rule for torchao's weight subclasses, so a compiled step of a quantized model traces
    every layer inline (a longer compile; eager runs the same code either way)."""
    import types

    plain = getattr(type(model.blocks[0]).forward, "__marked_compile_region_fn__", None)
    if plain is None:
        return
    for block in model.blocks:
        block.forward = types.MethodType(plain, block)


def stored_bytes(t: torch.Tensor) -> int:
    """The bytes a tensor holds: a tensor subclass (a torchao weight) the sum of the tensors it flattens to (its
    quantized data, scales and zero points), a plain tensor its elements."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(stored_bytes(getattr(t, n)) for n in names if isinstance(getattr(t, n), torch.Tensor))
    return t.numel() * t.element_size()


def weight_bytes(model) -> dict:
    """Bytes of the weights a decode step reads, {"blocks": the block linears, "head": the LM head, "other": the
    norms}: the embedding is left out (a step gathers a few of its rows)."""
    out = dict(blocks=0, head=0, other=0)
    for name, p in model.named_parameters():
        if name == "embed.weight":
            continue
        kind = "head" if name.startswith("lm_head") else "blocks" if p.dim() >= 2 else "other"
        out[kind] += stored_bytes(p)
    return out
