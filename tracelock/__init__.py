"""tracelock: learned commitment for masked diffusion LMs (LLaDA, Dream), with fused decoding kernels."""

__version__ = "0.1.0"
