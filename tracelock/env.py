"""``python -m tracelock.env`` / ``tracelock env``: the versions and build facts a bug report needs."""

import importlib.metadata
import platform
import sys


def _version(dist: str) -> str:
    # metadata instead of import: importing transformers alone takes seconds
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def ops_report(device) -> dict:
    """{"op NAME": the implementation a decode on ``device`` runs by default, and for a Triton kernel whether its
    self-check (`tracelock.selfcheck`, bf16 on CUDA, fp32 else) passed here}."""
    import torch

    from tracelock import ops, selfcheck

    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = {}
    for op in ops.IMPLEMENTATIONS:
        impl = ops.pick(op, None, device)
        if impl != "triton":
            out[f"op {op}"] = impl
        elif not selfcheck.enabled():
            out[f"op {op}"] = "triton (self-check off: TRACELOCK_SELFCHECK=0)"
        elif op not in selfcheck.BUILDERS:
            out[f"op {op}"] = "triton (no self-check)"
        else:
            ok, why = selfcheck.check(op, device, dtype)
            out[f"op {op}"] = (f"triton (self-check passed, {str(dtype).removeprefix('torch.')})" if ok else
                               f"torch (the Triton kernel failed its self-check: {why})")
    return out


def report() -> dict:
    """Return one short string per fact: tracelock, python, torch, threads (torch's CPU threads), triton,
    interpreter, _C, gpu, transformers, then one per op (`ops_report`: what runs on the GPU, else the CPU)."""
    import torch

    import tracelock
    from tracelock import _ext, _triton

    if _ext.has_cuda_ext():
        ext = "built, with CUDA"
    elif _ext.has_cpp():
        ext = "built, CPU only"
    else:
        ext = f"not available ({_ext.ext_error()})"
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return {
        "tracelock": tracelock.__version__,
        "python": f"{platform.python_version()} ({sys.executable})",
        "torch": f"{torch.__version__} ({f'cuda {torch.version.cuda}' if torch.version.cuda else 'cpu'})",
        "threads": str(torch.get_num_threads()),
        "triton": _triton.triton_version or "not installed",
        "interpreter": f"TRITON_INTERPRET={'1' if _triton.triton_interpret else '0'}",
        "_C": ext,
        "gpu": gpu,
        "transformers": _version("transformers"),
        **ops_report("cuda" if torch.cuda.is_available() else "cpu"),
    }


def main(argv=None) -> int:
    """Print ``report()`` one ``key: value`` line each; ``argv`` is accepted for the CLI and ignored."""
    for key, value in report().items():
        print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
