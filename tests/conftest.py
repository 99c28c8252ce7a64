import os

# set before anything imports tracelock: @triton.jit reads TRITON_INTERPRET when a kernel is decorated
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
