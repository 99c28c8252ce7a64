"""`tracelock fit`: TraceLock's whole recipe on one checkpoint, as one resumable command.

Each stage writes into its own folder of ``out`` and resumes (a rerun skips what is complete):

- ``pool/``: training prompts decoded by the base rule at the middle of its knob (``traces``), the encoder fitted on
  their replayed hidden states (``encoder``) and their codes and labels (``cache``: a proposal is stable when it
  already equals the final token).
- ``round-0/``: the supervised controller, trained on the pool (the ``testbed`` preset unless told otherwise).
- ``round-K/`` (K = 1..rounds): labels from its own decodes, DAgger-style (every round's data kept; the base's
  traces are round 0's): new training prompts decoded by the gate with round K-1's controller over the base, at the
  grid's strongest correction (``traces``); their codes join the on-policy cache of every round (``onpolicy/``), and
  the controller trains from round K-1's on the pool and the on-policy cache at share ``alpha``.
- ``validation/``: the base alone along its knob, and every round's controller as the gate at each (accept, veto) of
  the grid along the same knob, on validation prompts (`tracelock.eval.runner.run_eval`, resumable per point).
- the choice (``fit.json``): the (round, accept, veto) whose curve lies furthest above the base's at matched steps
  (`tracelock.eval.matched.gap_at_matched_steps`, averaged over the tasks); no correction (the base itself) when none
  is above it. ``controller/`` is that round's controller with ``gate.json``, so ``gate:controller=OUT/controller``
  deploys the choice.

Under ``torchrun`` the decoding (collection and validation) is split by rank and training runs DDP; the encoder and
the codes are rank 0's. One task family per run gives a controller per domain (``--prompts testbed:math``).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tracelock.atomic import atomic_write_json, folder_lock, remove_stale_temps
from tracelock.integrity import read_json

__all__ = ["FitConfig", "fit"]


@dataclass(frozen=True)
class FitConfig:
    """What `fit` does; the defaults are the recipe on the bundled models' scale."""

    model: str
    out: str
    prompts: str = "testbed:math,testbed:code"  # training prompts (`tracelock.recording.collect.load_items`)
    tasks: str | None = None  # the eval tasks of the choice, comma-separated; default: the prompts' validation split
    base: str | None = None  # the rule the gate corrects, its knob's values listed; default: the family's (BASES)
    accept: tuple = (1.0, 0.8)
    veto: tuple = (0.0, 0.8)
    rounds: int = 2
    limit: int = 200  # training items per task in the pool
    round_limit: int = 100  # new training items per task per round
    val_limit: int = 100  # validation items per task
    gen_length: int = 64
    block: int = 16
    fraction: float = 0.3  # share of each decode's steps recorded
    alpha: float = 0.5  # share of on-policy items in a round's training mix
    preset: str = "testbed"
    steps: int = 2000
    round_steps: int = 1000
    batch_size: int = 32  # prompts decoded together
    seed: int = 0
    device: str = "cpu"
    overrides: dict = field(default_factory=dict)  # further `TrainConfig` fields of round 0

    def __post_init__(self):
        for name in ("rounds",):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"--{name} {getattr(self, name)!r} must be a whole number >= 0")
        for name in ("limit", "round_limit", "val_limit", "steps", "round_steps", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} {value!r} must be a whole number >= 1")
        if not 0 < self.alpha < 1:
            raise ValueError(f"--alpha {self.alpha!r} must lie in (0, 1): the on-policy share of the training mix")
        if not self.accept or not self.veto:
            raise ValueError("--accept and --veto each need at least one value (1 and 0: no correction)")
        # the gate's ranges, checked before any stage runs (the gate itself would refuse them only at round 1)
        if any(not 0 < a <= 1 for a in self.accept) or any(not 0 <= v < 1 for v in self.veto):
            raise ValueError(f"--accept {','.join(map(str, self.accept))} must lie in (0, 1] and --veto "
                             f"{','.join(map(str, self.veto))} in [0, 1) (accept 1 and veto 0: no correction)")


# each family's base rule and its knob's values: Fast-dLLM++'s rule with the end-of-text hold (Dream: its Dream form),
# the rule the gate corrects unless --base names another
BASES = {"llada": "frechet:delta=0,0.5,0.9:hold_end=true",
         "dream": "frechet:delta=0,0.5,0.9:first_token=true:hold_end=true"}


def base_rule(spec: str) -> tuple[str, dict, str, list]:
    """(name, fixed arguments, knob, knob values) of a ``--base`` spec: the one listed key is the knob."""
    from tracelock.policy_specs import policy_groups, spec_value

    groups = policy_groups(spec, option="--base")
    if len(groups) != 1 or groups[0][3] is None:
        raise ValueError(f"--base {spec!r} must be one rule with its knob's values listed, e.g. "
                         "frechet:delta=0,0.5,0.9:hold_end=true")
    name, _, pairs, knob_index, values = groups[0]
    knob = pairs[knob_index][0]
    fixed = {k: spec_value(v) for i, (k, v) in enumerate(pairs) if i != knob_index}
    return name, fixed, knob, [spec_value(v) for v in values]


def _spec(name: str, args: dict) -> str:
    return ":".join([name] + [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in args.items()])


def _validation_tasks(config: FitConfig) -> list[str]:
    if config.tasks:
        return [t.strip() for t in config.tasks.split(",") if t.strip()]
    if not config.prompts.startswith("testbed:"):
        raise ValueError(f"--prompts {config.prompts!r} has no validation split: pass --tasks with the eval tasks "
                         "the choice is made on (e.g. testbed:math@validation)")
    from tracelock.recording.collect import _testbed_tasks

    names, _ = _testbed_tasks(config.prompts.split("@")[0])
    return [f"testbed:{n}@validation" for n in names]


class _Stages:
    """The run's record (``fit.json``): each finished stage with its seconds, and the estimate of what is left.

    A stage's size is (items decoded, optimizer steps): decoding and training run at rates that differ from one
    machine and backbone to another (the bundled models on the 2-core CPU: about 0.15 s per decoded item, 0.2 s per
    training step, so a pool collection of 200 items takes a seventh of the supervised round), so each rate is
    measured on the stages that do only that (collection and validation decode, the supervised round trains) and
    the estimate is the plan's remaining items and steps at those rates. A stage that does both (an on-policy round)
    counts at both."""

    def __init__(self, config: FitConfig, say, rank: int):
        self.path, self.say, self.rank = Path(config.out) / "fit.json", say, rank
        self.record = dict(config=asdict(config), stages={})
        if self.path.is_file():
            fix = f"delete {self.path} to run every stage again (each stage's own files resume it)"
            self.record["stages"] = read_json(self.path, fix=fix).get("stages", {})
        self.plan: dict = {}  # {stage: (items, steps)}: the whole run's, for the estimate

    def run(self, name: str, what: str, work):
        """Run ``work()`` as stage ``name`` (its size from ``plan``)."""
        start = time.perf_counter()
        done = self.record["stages"].get(name, {})
        self.say(f"{name}: {what}" + self._left())
        result = work()
        seconds = done.get("seconds", 0.0) + time.perf_counter() - start
        items, steps = self.plan.get(name, (0, 0))
        self.record["stages"][name] = dict(seconds=round(seconds, 1), items=items, steps=steps)
        if self.rank == 0:
            atomic_write_json(self.path, self.record)
        return result

    def rates(self) -> tuple:
        """(seconds per decoded item, seconds per training step) from the finished stages that do only one of them;
        None where none has run yet."""
        stages = self.record["stages"].values()
        decode = [(s["seconds"], s["items"]) for s in stages if s.get("items") and not s.get("steps")]
        train = [(s["seconds"], s["steps"]) for s in stages if s.get("steps") and not s.get("items")]
        return tuple(sum(t for t, _ in d) / sum(n for _, n in d) if d else None for d in (decode, train))

    def _left(self) -> str:
        per_item, per_step = self.rates()
        left = [size for name, size in self.plan.items() if name not in self.record["stages"]]
        if (per_item is None and any(i for i, _ in left)) or (per_step is None and any(k for _, k in left)):
            return ""
        seconds = sum(i * (per_item or 0) + k * (per_step or 0) for i, k in left)
        return f" (about {seconds / 60:.0f} min left)"


def fit(config: FitConfig, *, rank: int = 0, world_size: int = 1, say=lambda what: None) -> Path:
    """Run (or finish) the recipe in ``config.out``; returns the chosen controller's folder (``out/controller``)."""
    from tracelock.models.loading import resolve_path
    from tracelock.models.spec import ModelSpec

    family = ModelSpec.from_pretrained(resolve_path(config.model)).family
    name, fixed, knob, values = base_rule(config.base or BASES[family])
    tasks = _validation_tasks(config)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    mid = dict(fixed, **{knob: values[len(values) // 2]})
    stages = _Stages(config, say if rank == 0 else (lambda what: None), rank)
    n_tasks = max(1, len(config.prompts.split(",")))
    n_val = len(values) * (1 + (config.rounds + 1) * len(config.accept) * len(config.veto)) * len(tasks)
    # (items decoded, training steps) per stage; the featurization's replay counts as a decode of the pool
    stages.plan = {"collect": (config.limit * n_tasks, 0), "features": (config.limit * n_tasks, 0),
                   "round-0": (0, config.steps),
                   **{f"round-{k}": (config.round_limit * n_tasks, config.round_steps)
                      for k in range(1, config.rounds + 1)},
                   "validation": (n_val * config.val_limit, 0)}
    with folder_lock(out, f"lock-fit-rank{rank}"):
        pool = out / "pool"
        stages.run("collect", f"the base rule {_spec(name, mid)} on {config.limit} training items per task",
                   lambda: _collect(config, pool / "traces", name, mid, config.limit, config.seed, rank, world_size))
        stages.run("features", "the encoder and the pool's codes", lambda: _features(config, pool, rank, world_size))
        stages.run("round-0", f"the supervised controller ({config.steps} steps)",
                   lambda: _train(config, out / "round-0", pool, None, config.steps, rank=rank))
        for k in range(1, config.rounds + 1):
            gate = dict(accept=min(config.accept), veto=max(config.veto))
            stages.run(f"round-{k}", f"on-policy round {k}: the gate with round {k - 1}'s controller, {gate}",
                       lambda k=k, gate=gate: _round(config, out, k, name, mid, gate, rank, world_size))
        points = stages.run("validation", f"{n_val} decodes of {config.val_limit} validation items",
                            lambda: _validate(config, out, tasks, (name, fixed, knob, values), rank, world_size))
        if rank != 0:
            return out / "controller"
        choice = choose_gate(points)
        _deploy(out, choice, name, mid, knob)
        stages.record["choice"] = choice
        atomic_write_json(stages.path, stages.record)
        spread = "".join(f", {task} [{100 * lo:+.1f}, {100 * hi:+.1f}]" for task, (lo, hi) in
                         choice.get("intervals", {}).items() if lo is not None and hi is not None)
        say(f"chosen: round {choice['round']}, accept {choice['accept']}, veto {choice['veto']} (mean gap over the "
            f"base's curve at matched steps {100 * choice['gap']:+.1f} points{spread}); deploy it with "
            f"--policy gate:controller={out / 'controller'} (its knob: base_{knob})")
        return out / "controller"


def _barrier(world_size: int) -> None:
    if world_size > 1:
        import torch.distributed as dist

        dist.barrier()


def _collect(config: FitConfig, folder: Path, policy: str, args: dict, limit: int, seed: int, rank: int,
             world_size: int) -> dict | None:
    from tracelock.recording.collect import collect

    return collect(config.model, config.prompts, folder, num=limit, gen_length=config.gen_length, block=config.block,
                   policy=policy, policy_args=args, fraction=config.fraction, keep_confidence=True,
                   batch_size=config.batch_size, seed=seed, rank=rank, world_size=world_size, device=config.device)


def _features(config: FitConfig, pool: Path, rank: int, world_size: int) -> None:
    """The encoder (once) and the pool's codes, on rank 0; the other ranks wait."""
    if rank == 0:
        from tracelock.features import fit_encoder, load_encoder
        from tracelock.models import load_model
        from tracelock.traces.store import iter_traces

        model = load_model(config.model, device=config.device)
        if not (pool / "encoder" / "encoder.json").is_file():
            fit_encoder(model, iter_traces(pool / "traces"), seed=config.seed).save(pool / "encoder")
        _featurize(model, load_encoder(pool / "encoder", model), iter_traces(pool / "traces"), pool / "cache")
    _barrier(world_size)


def _featurize(model, encoder, traces, cache: Path) -> None:
    from tracelock.traces.cache import featurize

    featurize(model, encoder, traces, cache)


def _train(config: FitConfig, run: Path, pool: Path, init: Path | None, steps: int, onpolicy: Path | None = None,
           rank: int = 0):
    """A controller into ``run``: round 0 from the preset on the pool, a later round from ``init`` on the pool and
    the on-policy cache at share alpha. Done when its ``metrics.json`` is written."""
    from tracelock.train.cli import PRESETS
    from tracelock.train.fit import TrainConfig, train

    if (run / "metrics.json").is_file():  # train writes it last; a run killed after it left its lock and temps
        if rank == 0:
            with folder_lock(run):
                remove_stale_temps(run)
        return
    common = dict(cache=str(pool / "cache"), out=str(run), steps=steps, eval_every=max(1, steps // 4),
                  encoder=str(pool / "encoder"), seed=config.seed, device=config.device)
    if init is None:
        preset = {k: v for k, v in PRESETS[config.preset].items() if k not in ("steps", "eval_every")}
        cfg = TrainConfig(**{**preset, **config.overrides, **common})
    else:
        cfg = TrainConfig(**common, init=str(init), mix_cache=str(onpolicy), alpha=config.alpha,
                          batch_size=PRESETS[config.preset].get("batch_size", 64))
    train(cfg, resume=(run / "state.json").exists())


def _round(config: FitConfig, out: Path, k: int, name: str, args: dict, gate: dict, rank: int,
           world_size: int) -> None:
    """On-policy round ``k``: decode new training items with the gate of round k-1's controller, add their codes to
    the on-policy cache (ids prefixed by the round), train round k's controller from round k-1's."""
    from tracelock.features import load_encoder
    from tracelock.models import load_model
    from tracelock.traces.store import iter_traces

    folder, previous = out / f"round-{k}", out / f"round-{k - 1}"
    policy_args = dict(controller=str(previous), base=name, accept=gate["accept"], veto=gate["veto"],
                       **{f"base_{key}": v for key, v in args.items()})
    _collect(config, folder / "traces", "gate", policy_args, config.round_limit, config.seed + k, rank, world_size)
    if rank == 0:
        model = load_model(config.model, device=config.device)

        def prefixed():
            for trace in iter_traces(folder / "traces"):
                trace.meta["id"] = f"round-{k}/{trace.meta['id']}"
                yield trace

        _featurize(model, load_encoder(out / "pool" / "encoder", model), prefixed(), out / "onpolicy")
    _barrier(world_size)
    _train(config, folder, out / "pool", previous, config.round_steps, onpolicy=out / "onpolicy", rank=rank)


def _validate(config: FitConfig, out: Path, tasks: list, base: tuple, rank: int, world_size: int) -> dict:
    """Decode the base along its knob and each (round, accept, veto) gate along it on every validation task, then the
    base at midpoints of its knob until no two of its points lie more than `BASE_STEP_GAP` mean steps apart;
    returns {task: {curve: [(knob value, {id: record})]}} on rank 0.

    The base is traced densely because the choice reads curves as step functions: a hole in the base's curve (the
    entropy bound on Dream-family math: 33% at 16.1 mean steps, then 58% at 20.4) would count as the base's accuracy
    at the hole's low end across it, and any gate with a point inside it would look far ahead (+11.5 points, chosen,
    on the four listed values alone)."""
    from tracelock.eval.dense import geometric, trace_densely
    from tracelock.eval.items import folder_items
    from tracelock.eval.runner import PolicySpec, Setting, check_policies, run_eval

    name, fixed, knob, values = base

    def base_spec(v):
        return PolicySpec(_spec(name, dict(fixed, **{knob: v})), name, dict(fixed, **{knob: v}))

    def valid(v) -> bool:  # a value the setting takes (a schedule's steps must divide into its blocks)
        try:
            check_policies([base_spec(v)], [setting], "auto")
        except ValueError:
            return False
        return True

    whole = all(isinstance(v, int) and not isinstance(v, bool) for v in values)
    setting = Setting(config.gen_length, config.block)
    specs = {"base": [base_spec(v) for v in values]}
    for k in range(config.rounds + 1):
        for accept in config.accept:
            for veto in config.veto:
                # labels (and so folders) name the round, not the run's path
                specs[f"{k}/{accept}/{veto}"] = [
                    PolicySpec(f"gate round-{k} accept={accept} veto={veto} {_spec(name, dict(fixed, **{knob: v}))}",
                               "gate", dict(controller=str(out / f"round-{k}"), accept=accept, veto=veto, base=name,
                                            **{f"base_{key}": x for key, x in dict(fixed, **{knob: v}).items()}))
                    for v in values]
    result = {}
    for task in tasks:
        folder = out / "validation" / task.replace(":", "-").replace("@", "-")

        def decode(policies, task=task, folder=folder):
            run_eval(config.model, task, policies, [setting], folder, n=config.val_limit, seed=config.seed,
                     batch_size=config.batch_size, rank=rank, world_size=world_size, workers=1, device=config.device)

        def records(spec, folder=folder):
            return folder_items(folder / "runs" / setting.slug / spec.slug)

        decode([p for ps in specs.values() for p in ps])
        result[task] = {c: [(v, records(p)) for v, p in zip(values, ps)] for c, ps in specs.items()}
        base_values = trace_densely(values, lambda v, records=records: _mean_steps(records(base_spec(v))),
                                    lambda new, decode=decode: decode([base_spec(v) for v in new]), BASE_STEP_GAP,
                                    BASE_DENSE_ROUNDS, whole=whole, log=geometric(values), valid=valid)
        result[task]["base"] = [(v, records(base_spec(v))) for v in sorted(base_values)]
    return result


BASE_STEP_GAP = 1.5  # mean steps between the base's consecutive points on validation
BASE_DENSE_ROUNDS = 6  # rounds of midpoints: each halves a hole in the knob


def _mean_steps(records: dict) -> float:
    return sum(r["steps"] for r in records.values()) / len(records)


def choose_gate(points: dict, min_cover: float = 0.5) -> dict:
    """The candidate (round, accept, veto) with the largest mean gap over the base's curve at matched steps (the
    mean over tasks of `gap_at_matched_steps`); ties go to the earlier round. A candidate has no gap on a task, and
    is not chosen, when the steps its knob reaches cover less than ``min_cover`` of the base's span: a gate that
    pins every knob value to about one budget (accept at or below veto overrides the base everywhere) is one point,
    not a curve a user can trade along, and its gap over a sliver of the range says little. No correction (round 0
    with accept 1 and veto 0: the base itself, gap 0) when no candidate is above the base."""
    from tracelock.eval.matched import Curve, gap_at_matched_steps, verdict

    def curve(label, pts, ids):
        return Curve(label, [[int(r[i]["correct"]) for i in ids] for _, r in pts],
                     [[r[i]["steps"] for i in ids] for _, r in pts])

    def covers(candidate, base):
        steps, base_steps = candidate.points()[0], base.points()[0]
        overlap = min(steps.max(), base_steps.max()) - max(steps.min(), base_steps.min())
        return overlap >= min_cover * (base_steps.max() - base_steps.min())

    gaps, pairs = {}, {}
    for task, curves in points.items():
        ids = sorted(set.intersection(*(set(r) for pts in curves.values() for _, r in pts)))
        base = curve("base", curves["base"], ids)
        for label, pts in curves.items():
            if label != "base":
                candidate = curve(label, pts, ids)
                pairs.setdefault(label, {})[task] = (candidate, base)
                gaps.setdefault(label, []).append(
                    gap_at_matched_steps(candidate, [base]) if covers(candidate, base) else None)
    mean = {label: None if None in g else sum(g) / len(g) for label, g in gaps.items()}
    ranked = [label for label in mean if mean[label] is not None]
    best = max(ranked, key=lambda label: (round(mean[label], 9), -int(label.split("/")[0])), default=None)
    if best is None or mean[best] <= 0:
        return dict(round=0, accept=1.0, veto=0.0, gap=0.0, gaps=mean, intervals={})
    k, accept, veto = best.split("/")
    # the chosen gap's 90% paired bootstrap interval per task (read it knowing it is the best of the candidates)
    intervals = {task: verdict(candidate, [base])["gap_interval"] for task, (candidate, base) in pairs[best].items()}
    return dict(round=int(k), accept=float(accept), veto=float(veto), gap=mean[best], gaps=mean, intervals=intervals)


def _deploy(out: Path, choice: dict, name: str, args: dict, knob: str) -> None:
    """``out/controller``: the chosen round's controller folder with its ``gate.json`` (written whole, then moved)."""
    from tracelock.policies.gate import GATE_FILE

    final, staging = out / "controller", out / "controller.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(out / f"round-{choice['round']}", staging,
                    ignore=shutil.ignore_patterns("state*", "*.tmp*", "lock*"))
    atomic_write_json(staging / GATE_FILE, dict(base=name, base_args=args, accept=choice["accept"],
                                                veto=choice["veto"], knob=f"base_{knob}"))
    # the old controller moves aside before the new one takes its name, so a crash leaves one of them whole
    old = out / "controller.old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    staging.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def _numbers(option: str, low: float, high: float):
    """A comma-separated list of numbers in [low, high] (an argparse type)."""
    import argparse

    def parse(text: str) -> tuple:
        try:
            values = tuple(float(v) for v in text.split(",") if v.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{option} {text!r}: give numbers separated by commas, e.g. 1,0.8") \
                from None
        if not values or any(not low <= v <= high for v in values):
            raise argparse.ArgumentTypeError(f"{option} {text!r}: every value must lie in [{low}, {high}]")
        return values

    return parse


def _fit(args):
    from tracelock.distributed import torchrun_group
    from tracelock.progress import status

    with torchrun_group(args.device) as (rank, world, device):
        config = FitConfig(model=args.model, out=args.out, prompts=args.prompts, tasks=args.tasks,
                           base=args.base, accept=args.accept, veto=args.veto, rounds=args.rounds, limit=args.limit,
                           round_limit=args.round_limit, val_limit=args.val_limit, gen_length=args.gen_length,
                           block=args.block, alpha=args.alpha, steps=args.steps, round_steps=args.round_steps,
                           batch_size=args.batch_size, seed=args.seed, device=device)
        run = fit(config, rank=rank, world_size=world, say=status)
    if rank == 0:
        print(f"controller and its gate in {run}; every stage's folder, the validation records and fit.json in "
              f"{args.out}")


def add_parsers(sub):
    from tracelock.cli_options import add_device, add_model, option_help
    from tracelock.cli_values import batch_int, gen_length_int, positive_int, seed_int

    p = sub.add_parser("fit", help="the whole TraceLock recipe on a checkpoint: traces, encoder, codes, the "
                                   "controller, on-policy rounds and the gate chosen on validation (resumable; "
                                   "decoding split under torchrun)")
    add_model(p)
    p.add_argument("--out", required=True, help="the run folder (re-running the command resumes it)")
    p.add_argument("--prompts", default="testbed:math,testbed:code",
                   help="training prompts: testbed tasks or a JSONL file, as `tracelock collect --prompts` "
                        "(default: testbed:math,testbed:code; one task for a controller per domain)")
    p.add_argument("--tasks", help=option_help("--tasks", "the choice is made on them (default: the --prompts' "
                                                          "testbed tasks, @validation)"))
    p.add_argument("--base", help="the rule the gate corrects, with its knob's values listed (default: "
                                  f"{BASES['llada']}; on Dream: {BASES['dream']})")
    p.add_argument("--accept", type=_numbers("--accept", 0.0, 1.0), default=(1.0, 0.8),
                   help="the gate's accept values tried on validation (1: never accepts; default 1,0.8)")
    p.add_argument("--veto", type=_numbers("--veto", 0.0, 1.0), default=(0.0, 0.8),
                   help="the gate's veto values tried on validation (0: never vetoes; default 0,0.8)")
    p.add_argument("--rounds", type=int, default=2, help="on-policy rounds after the supervised one (default 2)")
    p.add_argument("--limit", type=positive_int, default=200, help="training items per task in the pool")
    p.add_argument("--round-limit", type=positive_int, default=100, help="new training items per task per round")
    p.add_argument("--val-limit", type=positive_int, default=100, help="validation items per task")
    p.add_argument("--gen-length", type=gen_length_int, default=64, metavar="N", help=option_help("--gen-length"))
    p.add_argument("--block", type=gen_length_int, default=16, metavar="W",
                   help=option_help("--block", "every decode of the recipe uses it (default 16)"))
    p.add_argument("--alpha", type=float, default=0.5, help="share of on-policy items in a round's training mix")
    p.add_argument("--steps", type=positive_int, default=2000, help="training steps of the supervised controller")
    p.add_argument("--round-steps", type=positive_int, default=1000, help="training steps of each round")
    p.add_argument("--batch-size", type=batch_int, default=32, help="prompts decoded together")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the item draws (round K draws with seed + K)")
    add_device(p, torchrun=True)
    p.set_defaults(func=_fit)
