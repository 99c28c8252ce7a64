"""`tracelock demo --tracelock`: the whole method on the bundled model, small enough for a laptop.

collect -> fit-encoder -> featurize -> train, into one work folder, each stage with the package's own functions
(the same ones the CLI commands call). Every stage resumes or is skipped when its output is complete, so a second
demo reuses the controller the first one trained.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tracelock.atomic import atomic_write_json


@dataclass(frozen=True)
class DemoMethodConfig:
    """Sizes chosen so the four stages take minutes on 2 cores (the README states the measured time)."""

    num: int = 48  # training-split items per task
    tasks: str = "math,code"
    gen_length: int = 64
    block: int = 8  # the paper's fine schedule: confidence, one token per step, blocks of 8
    fraction: float = 0.25  # share of steps recorded (first and last always)
    max_positions: int = 4096  # positions the PCA encoder is fit on
    steps: int = 200  # controller training steps (paper architecture, batch 32)
    batch_size: int = 32
    decode_batch_size: int = 48
    seed: int = 0
    filters: bool = True  # the collection filters (tests switch them off for an untrained micro model)


def train_demo_controller(model_path, work, config: DemoMethodConfig = DemoMethodConfig(), *, device="cpu",
                          say=lambda what: None) -> Path:
    """Run (or finish) the pipeline in ``work``; returns the controller folder (``work/controller``)."""
    from tracelock.features import fit_encoder, load_encoder
    from tracelock.models import load_model
    from tracelock.progress import progress_bar
    from tracelock.recording.collect import collect
    from tracelock.traces.cache import featurize
    from tracelock.traces.filters import TraceFilterConfig
    from tracelock.traces.store import iter_traces, load_index
    from tracelock.train.fit import TrainConfig, train

    work = Path(work)
    traces, encoder_dir, cache, run = work / "traces", work / "encoder", work / "cache", work / "controller"
    if (run / "metrics.json").is_file():
        say(f"reusing the controller in {run}")
        return run
    say(f"collect traces ({config.num} training items per task)")
    summary = collect(model_path, f"testbed:{config.tasks}", traces, num=config.num, gen_length=config.gen_length,
                      block=config.block, fraction=config.fraction, batch_size=config.decode_batch_size,
                      seed=config.seed, filters=TraceFilterConfig(enabled=config.filters), device=device)
    if not summary["kept"]:
        raise RuntimeError(f"every collected trace in {traces} was filtered out ({summary['filtered']}); "
                           "the model is too weak for the demo's filters, pass a stronger --model")
    model = load_model(model_path, device=device)
    if not (encoder_dir / "encoder.json").is_file():
        say("fit the encoder (PCA on replayed hidden states)")
        fit_encoder(model, iter_traces(traces), max_positions=config.max_positions, seed=config.seed).save(encoder_dir)
    say("featurize the traces")
    featurize(model, load_encoder(encoder_dir, model),
              progress_bar(iter_traces(traces), total=load_index(traces)["num_traces"], desc="featurize", unit="trace"),
              cache)
    say(f"train the controller ({config.steps} steps)")
    train(TrainConfig(cache=str(cache), out=str(run), steps=config.steps, batch_size=config.batch_size,
                      eval_every=max(1, config.steps // 2), encoder=str(encoder_dir), device=device),
          resume=(run / "state.json").exists())
    atomic_write_json(work / "demo_method.json", dict(collect=summary, config=config.__dict__))
    return run
