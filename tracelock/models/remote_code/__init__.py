"""Modelling files that `tracelock.models.write_tiny_checkpoint` writes beside a tiny checkpoint's config.json, so that
transformers opens the folder (``AutoModel.from_pretrained(folder, trust_remote_code=True)``) as it opens a released
one through its auto_map. tracelock's own code, written from the released models' math (docs/api.md, "Backbones"):
plain PyTorch and transformers, no import of tracelock, bidirectional attention, logits unshifted (Dream's sampler
shifts them). Each file is copied as is, so each imports only torch, transformers and its sibling config file."""

from pathlib import Path

FOLDER = Path(__file__).resolve().parent
FILES = {"llada": ("configuration_llada.py", "modeling_llada.py"),
         "dream": ("configuration_dream.py", "modeling_dream.py")}
