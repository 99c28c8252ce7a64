"""PC-Sampler's background token-frequency table for a bundled model, counted from its own training text, and the
files it ships (``tracelock/testbed/model*/background.json``, read by ``pc:background=testbed``).

Rebuild them with ``python -m tracelock.testbed.background`` (deterministic; tests/test_new_rules.py checks the
shipped files equal a fresh count).
"""

import collections
import dataclasses
import json

from tracelock.atomic import atomic_write_text

BACKGROUND_ITEMS = 2000  # training items per task counted


def testbed_background(name: str, items: int = BACKGROUND_ITEMS) -> dict:
    """PC-Sampler's background table (``{"num_token": N, "p_baseline_dict": {token_id: count}}``) for a bundled
    testbed model ("testbed", "testbed-dream" or a testbed-train run folder), counted from its own training text.

    The text is the start of the model's training stream itself: `tracelock.testbed.train.Batches` with the recipe
    recorded in the folder's ``testbed.json`` (seed, batch size, tasks), steps 0, 1, ... until ``items`` items per
    task are in (the tasks alternate within a batch), each item as it was trained on: the chat-templated prompt,
    the answer and its end-of-turn token; the eos padding after it is left out. Deterministic; about 2 s."""
    from tracelock.models.loading import load_tokenizer, resolve_path
    from tracelock.models.spec import ModelSpec
    from tracelock.testbed.train import Batches
    from tracelock.testbed.train_config import BackboneTrainConfig

    folder = resolve_path(name)
    recipe = json.loads((folder / "testbed.json").read_text())["config"]
    fields = {f.name for f in dataclasses.fields(BackboneTrainConfig)}
    cfg = BackboneTrainConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in recipe.items()
                                 if k in fields})
    batches = Batches(cfg, load_tokenizer(folder), ModelSpec.from_pretrained(folder))
    counts, taken, step = collections.Counter(), dict.fromkeys(cfg.tasks, 0), 0
    while min(taken.values()) < items:
        x, region, answer_len = batches(step)
        step += 1
        ends = region.float().argmax(1) + answer_len  # prompt | answer <eot> | eos padding
        for i in range(x.shape[0]):
            task = cfg.tasks[i % len(cfg.tasks)]
            if taken[task] < items:
                taken[task] += 1
                counts.update(x[i, :int(ends[i])].tolist())
    return {"num_token": sum(counts.values()), "p_baseline_dict": dict(sorted(counts.items()))}



def write_background(name: str) -> None:
    """Write the bundled model ``name``'s table into its folder."""
    from tracelock.models.loading import resolve_path

    table = testbed_background(name)
    atomic_write_text(resolve_path(name) / "background.json", json.dumps(table, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    for bundled in ("testbed", "testbed-dream"):
        write_background(bundled)
