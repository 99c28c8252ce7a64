"""tracelock.kernels: the ``*_ref`` specs (``ref.py``) and, later, one Triton file per op.

Installed as ``tracelock.kernels`` (never as a bare ``kernels`` module). Nothing here is imported
eagerly, so ``import tracelock.kernels.ref`` stays free of triton for CPU and training code.
"""
