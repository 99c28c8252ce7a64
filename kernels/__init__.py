"""tracelock.kernels: the ``*_ref`` specs (``ref.py``) and one Triton file per op (see README.md).

Installed as ``tracelock.kernels`` (never as a bare ``kernels`` module). Nothing here is imported
eagerly, so ``import tracelock.kernels.ref`` stays free of triton for CPU and training code.
"""
