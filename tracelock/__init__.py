"""tracelock: learned commitment for masked diffusion LMs (LLaDA, Dream), with fused decoding kernels."""

__version__ = "0.1.0"

# torch before anything that may load the compiled extension tracelock._C (it links against libc10)
import torch  # noqa: E402, F401

from tracelock.decode.throughput import generate_many  # noqa: E402
from tracelock.generate import fused_generate  # noqa: E402
from tracelock.models import ModelSpec, load_model, load_tokenizer, write_tiny_checkpoint  # noqa: E402
from tracelock.reference import reference_generate  # noqa: E402

__all__ = ["ModelSpec", "__version__", "fused_generate", "generate_many", "load_model", "load_tokenizer",
           "reference_generate", "write_tiny_checkpoint"]
