"""`BackboneTrainConfig` of `tracelock testbed-train` and the shipped model's recipe, without torch (the CLI reads
them to build its ``--help``, which must not import torch)."""

from dataclasses import dataclass

__all__ = ["SHIPPED_RECIPE", "SHIPPED_RECIPES", "BackboneTrainConfig", "recipe_config"]


@dataclass
class BackboneTrainConfig:
    out: str
    family: str = "llada"  # "dream": a Dream-format checkpoint with shifted logits (see `tracelock.testbed.train`)
    seed: int = 0
    steps: int = 3600
    batch_size: int = 32
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.01
    d_model: int = 256
    n_layers: int = 6
    n_heads: int = 4
    mlp: int = 768
    vocab_size: int = 1024
    tokenizer_corpus: int = 20000
    max_positions: int = 512
    long_fraction: float = 0.15  # share of batches whose generation region is 128 instead of 64
    eps: float = 1e-3
    # share of rows masked the way semi-AR decoding sees them (see `block_mask`); 0 is LLaDA's SFT masking alone
    block_fraction: float = 0.0
    block_sizes: tuple = (16, 32)
    tasks: tuple = ("math", "code")
    save_every: int = 100
    # bf16 autocast made a step ~30x slower on the 2-core AMD EPYC used earlier (57 s vs 1.9 s); fp32 is the default
    bf16: bool = False
    threads: int = 0  # 0: torch's default
    # "cuda" trains on the GPU; the masks are drawn on the CPU either way, so both devices see the same data and masks,
    # but float rounding differs, so a run reproduces its weights only on the device (and --threads) it ran on
    device: str = "cpu"
    # processes that build the batches ahead of the training step (0: in the training process); the batches are a
    # function of (seed, step) either way. Worth it on a GPU, where building a batch costs more than the step
    workers: int = 0
    # torch.compile the loss (forward + backward): 1.4-1.9x faster steps on a 2-core Xeon after a ~1 min compile;
    # the weights differ from an eager run's only by float reordering, so a run may switch on resume
    compile: bool = False
    ar_steps: int = 0  # autoregressive warm-up steps at the start of ``steps`` (0: LLaDA's objective throughout)
    # peak learning rate of the masked phase after an AR phase (None: lr). Lower keeps more of what the AR phase
    # learnt, as Dream adapted its AR initialisation at a small learning rate
    masked_lr: float | None = None
    # a finished run (or checkpoint folder) of the same family and sizes whose tokenizer and weights this run starts
    # from, as Dream started from an AR model: a second stage of training (None: a fresh tokenizer and random weights)
    init: str | None = None
    # every probe_every steps (0: never), decode the first probe_items validation items per task (confidence 1/step,
    # gen 64, blocks of 16) and record the accuracies in the run's log; greedy, so the weights are unchanged
    probe_every: int = 0
    probe_items: int = 100


# the bundled model's recipe (`tracelock/testbed/model/testbed.json`, "config"; tested equal): the defaults of
# `tracelock testbed-train`, so a bare run trains the shipped model's recipe. The device, batch-building workers,
# thread count and save interval are the machine's business, not the recipe's
SHIPPED_RECIPES = {
    "llada": dict(seed=0, steps=9000, batch_size=128, ar_steps=800, d_model=128, n_layers=4, n_heads=2, mlp=512),
    "dream": dict(seed=0, steps=8000, batch_size=64, ar_steps=3000, masked_lr=2e-4, block_fraction=0.5, d_model=128,
                  n_layers=4, n_heads=2, mlp=512),
}
SHIPPED_RECIPE = SHIPPED_RECIPES["llada"]


def recipe_config(out, family: str = "llada", **overrides) -> BackboneTrainConfig:
    """The shipped ``family`` model's recipe, with ``overrides`` (any `BackboneTrainConfig` field) on top."""
    if family not in SHIPPED_RECIPES:
        raise ValueError(f"family={family!r}: the testbed model is one of {', '.join(SHIPPED_RECIPES)}")
    return BackboneTrainConfig(out=str(out), **{**SHIPPED_RECIPES[family], "family": family, **overrides})
