"""`tracelock testbed-ship RUN`: a finished `testbed-train` run becomes the bundled model, with its provenance;
`tracelock testbed-ship-controller RUN`: a finished `tracelock train` run becomes a bundled model's controller.

The model folder's files are copied as they are; ``testbed.json`` records what made them: the command, the
configuration, the training time and machine, the loss curve of each phase (the AR warm-up and the masked
objective measure different losses, so they are kept apart), the in-run probes, and the weights' SHA-256, which a
reproduction run can be compared against. A shipped controller keeps its held-out metrics and a ``shipped.json``
with the commands that made it.
"""

import hashlib
import json
import shutil
from pathlib import Path

from tracelock.atomic import atomic_write, atomic_write_json, atomic_write_text

MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
               "tokenizer.json", "tokenizer_config.json")
CURVE_EVERY = 100  # steps between the loss points kept in testbed.json
BUNDLED_MODEL = Path(__file__).parent / "model"
CONTROLLER_FILES = ("best.json", "best.safetensors", "encoder.json", "encoder.safetensors", "metrics.json")
GATE_FILE = "gate.json"  # a `tracelock fit` controller's chosen gate (base rule, accept, veto): shipped with it


def sha256(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _curve(points: list, first: int, last: int) -> list:
    """[step, 10-step mean loss] for steps in (first, last]: the first point, every CURVE_EVERY-th, and the last."""
    kept = [p for p in points if first < p[0] <= last]
    return [p for i, p in enumerate(kept) if i == 0 or p[0] % CURVE_EVERY == 0 or i == len(kept) - 1]


def provenance(run, *, command: str, machine: str) -> dict:
    """testbed.json's content for a finished run folder; a run that has not finished is an error."""
    from tracelock.testbed.evaluate import reference_label  # imports torch, which `testbed-ship --help` need not

    run = Path(run)
    state = run / "train_state.json"
    if not state.exists():
        raise FileNotFoundError(f"{run} holds no train_state.json: pass the --out folder of a "
                                "`tracelock testbed-train` run")
    log = json.loads(state.read_text())
    cfg = log["config"]
    missing = [name for name in MODEL_FILES if not (run / name).exists()]
    if log["step"] != cfg["steps"] or missing:
        raise ValueError(f"{run} stopped at step {log['step']} of {cfg['steps']} "
                         f"(missing: {', '.join(missing) or '-'}); "
                         "finish it with the same `testbed-train` command plus --resume")
    ar = cfg.get("ar_steps", 0)
    masked = ("LLaDA SFT (masked, 1/t weighted)" if cfg.get("family", "llada") == "llada" else
              "LLaDA SFT with Dream's shift (masked, 1/t weighted, the row before a masked position predicts it)")
    phases = (f"steps 0-{ar - 1}: autoregressive (causal mask, next-token loss on the answer); " if ar else "") + \
        f"steps {ar}-{cfg['steps'] - 1}: {masked}" + (", fresh AdamW and schedule" if ar else "")
    return {
        "command": command,
        "config": cfg,
        "steps": log["step"],
        "train_seconds": round(log["seconds"], 1),
        "machine": machine,
        "objective": phases,
        "final_loss_10_step_mean": log["loss"][-1][1],
        "loss_curve_ar": _curve(log["loss"], 0, ar),
        "loss_curve_masked": _curve(log["loss"], ar, cfg["steps"]),
        "probes": {"how": f"{reference_label(cfg.get('family', 'llada'))}, gen 64, block 16, first "
                          "probe_items validation items per task, recorded during training (--probe-every)",
                   **log.get("probes", {})},
        "model_safetensors_sha256": sha256(run / "model.safetensors"),
    }


def ship(run, dest, *, command: str, machine: str, overwrite: bool = False) -> dict:
    """Copy the run's model files into ``dest`` (atomically, file by file) and write ``dest/testbed.json``; a
    ``dest`` that already holds a model (the bundled one, say) is replaced only with ``overwrite``."""
    info = provenance(run, command=command, machine=machine)
    dest = Path(dest)
    if (dest / "model.safetensors").exists() and not overwrite:
        bundled = " (the package's bundled model)" if dest.resolve() == BUNDLED_MODEL.resolve() else ""
        raise FileExistsError(f"{dest}{bundled} already holds a model; pass --overwrite to replace it, or another "
                              "--dest")
    dest.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        atomic_write(dest / name, lambda tmp, name=name: shutil.copyfile(Path(run) / name, tmp))
    atomic_write_json(dest / "testbed.json", info)
    return info


def ship_controller(run, dest, *, command: str, machine: str, commit_rule: str | None = None) -> dict:
    """Copy a finished `tracelock train` run's controller, encoder and held-out metrics into ``dest`` (atomically,
    file by file) and write ``dest/shipped.json``; a run without metrics.json has not finished and is refused. A
    `tracelock fit` controller (``OUT/controller``) brings its ``gate.json``, which `shipped.json` repeats.

    ``commit_rule`` ("paper" or "hold-end", `tracelock.controller.commit_rule_named`) sets the rule the controller
    deploys with in ``dest/best.json``; None keeps the run's. ``run`` may be ``dest`` itself (a new rule, in place).
    """
    from tracelock.controller import commit_rule_named

    run, dest = Path(run), Path(dest)
    missing = [name for name in CONTROLLER_FILES if not (run / name).exists()]
    if missing:
        raise FileNotFoundError(f"{run} lacks {', '.join(missing)}: pass the --out folder of a finished "
                                "`tracelock train` or `tracelock self-train` (its controller/) run")
    dest.mkdir(parents=True, exist_ok=True)
    if run.resolve() != dest.resolve():
        for name in CONTROLLER_FILES + ((GATE_FILE,) if (run / GATE_FILE).is_file() else ()):
            atomic_write(dest / name, lambda tmp, name=name: shutil.copyfile(run / name, tmp))
    config = json.loads((dest / "best.json").read_text())
    if commit_rule is not None:
        config["commit_rule"] = commit_rule_named(commit_rule, config.get("fingerprint", {}))
        atomic_write_text(dest / "best.json", json.dumps(config, indent=2) + "\n")  # as `Controller.save` writes it
    info = {"command": command, "machine": machine, "metrics": json.loads((run / "metrics.json").read_text()),
            "commit_rule": config.get("commit_rule", {}),
            "best_safetensors_sha256": sha256(dest / "best.safetensors")}
    if (dest / GATE_FILE).is_file():
        info["gate"] = json.loads((dest / GATE_FILE).read_text())
    atomic_write_json(dest / "shipped.json", info)
    return info


def _run(args):
    info = ship(args.run, args.dest, command=args.made_by, machine=args.machine, overwrite=args.overwrite)
    print(f"shipped {args.run} -> {args.dest} (model.safetensors sha256 {info['model_safetensors_sha256'][:16]}...)")


def _run_controller(args):
    info = ship_controller(args.run, args.dest, command=args.made_by, machine=args.machine,
                           commit_rule=args.commit_rule)
    print(f"shipped {args.run} -> {args.dest} (best.safetensors sha256 {info['best_safetensors_sha256'][:16]}...)")


def add_parsers(sub):
    p = sub.add_parser("testbed-ship", help="copy a finished testbed-train run into a model folder with testbed.json")
    p.add_argument("run", help="the --out folder of a finished `tracelock testbed-train` run")
    p.add_argument("--dest", required=True,
                   help=f"model folder to write; the package's bundled model is {BUNDLED_MODEL}")
    p.add_argument("--overwrite", action="store_true", help="replace the model --dest already holds")
    p.add_argument("--command", dest="made_by", required=True,  # not `command`: the subcommand's own name is that
                   help="the testbed-train command that made the run, for the record")
    p.add_argument("--machine", required=True, help="where it ran (CPU, threads, torch), for the record")
    p.set_defaults(func=_run)

    p = sub.add_parser("testbed-ship-controller",
                       help="copy a finished `tracelock train` run into a bundled model's controller folder")
    p.add_argument("run", help="the --out folder of a finished `tracelock train` run (or a self-train's or a "
                               "`tracelock fit`'s controller/, which brings its gate.json)")
    p.add_argument("--dest", required=True,
                   help="folder to write; the bundled models' controllers are "
                        f"{BUNDLED_MODEL.parent / 'controller-llada'} and {BUNDLED_MODEL.parent / 'controller-dream'}")
    p.add_argument("--command", dest="made_by", required=True, help="the commands that made the run, for the record")
    p.add_argument("--machine", required=True, help="where it ran (CPU, threads, torch), for the record")
    p.add_argument("--commit-rule", choices=["paper", "hold-end"], default=None,
                   help="the commit rule the controller deploys with (written into its best.json): paper, or "
                        "hold-end (`tracelock train --commit-rule`); default: the run's. RUN may be --dest itself")
    p.set_defaults(func=_run_controller)
