"""`tracelock self-train`: deployment-aware self-training (paper appendix "Other Variations").

1. decode new prompts with the trained controller at a slightly stricter threshold (``theta``, default 0.97 against
   the deployed 0.95), recording on-policy traces, and keep those that pass the collection filters;
2. featurize them with the controller's own encoder (labels from their final sequences, as for any trace);
3. train from the controller (warm start) on ``alpha D_self + (1 - alpha) D_pre``, the original pool kept whole.

Every stage resumes: the trace store and the cache skip what they hold, and training continues its saved state.
"""

from __future__ import annotations

from pathlib import Path

from tracelock.atomic import atomic_write_json, folder_lock

__all__ = ["self_train"]


def self_train(model_path, controller, pre_cache, prompts: str, out, *, num=None, gen_length=64, window=None,
               block=None, theta=0.97, alpha=0.5, steps=1000, batch_size=32, lr=1e-4, eval_every=None, seed=1,
               decode_batch_size=16, filters=None, device="cpu", progress=None) -> Path:
    """Run the three stages into ``out`` (``traces/``, ``cache/``, ``controller/``); returns the new run folder.

    Args:
        model_path: the backbone (checkpoint folder or "testbed").
        controller: the supervised controller's run folder (`tracelock train --out`, holding its encoder).
        pre_cache: the feature cache it was trained on (the original pool).
        prompts (str): new prompts (`tracelock.recording.collect.load_items` spec); testbed items are drawn with
            ``seed`` (default 1, so not the original pool's seed-0 sample).
        theta (float): the commit threshold while collecting. Default: 0.97.
        alpha (float): share of the self-training pool in the training mix. Default: 0.5.
        steps, batch_size, lr, eval_every: training (``eval_every`` default: ``steps // 4``).
        window / block: the decoding schedule while collecting. Default: window 16.
    """
    from tracelock.features import load_encoder
    from tracelock.models import load_model
    from tracelock.progress import progress_bar
    from tracelock.recording.collect import collect
    from tracelock.traces.cache import featurize
    from tracelock.traces.store import iter_traces, load_index
    from tracelock.train.fit import TrainConfig, train

    out, controller = Path(out), Path(controller)
    if not (controller / "best.safetensors").is_file():
        raise FileNotFoundError(f"--controller {controller} holds no best.safetensors; pass a `tracelock train --out` "
                                "folder")
    if not 0 < theta < 1:
        raise ValueError(f"theta={theta!r} must lie in (0, 1); slightly above the deployed 0.95, e.g. 0.97")
    if block is None and window is None:
        window = 16
    with folder_lock(out):  # one self-training run per folder (each stage also locks its own subfolder)
        say = progress or (lambda what: None)
        say("collect on-policy traces")
        summary = collect(model_path, prompts, out / "traces", num=num, gen_length=gen_length, block=block,
                          window=window, policy="tracelock", policy_args=dict(controller=str(controller), theta=theta),
                          batch_size=decode_batch_size, seed=seed, filters=filters, device=device)
        say("featurize them with the controller's encoder")
        model = load_model(model_path, device=device)
        encoder = load_encoder(controller, model)
        traces = progress_bar(iter_traces(out / "traces"), total=load_index(out / "traces")["num_traces"],
                              desc="featurize", unit="trace")
        featurize(model, encoder, traces, out / "cache")
        say("train from the controller on the mix")
        run = out / "controller"
        config = TrainConfig(cache=str(pre_cache), out=str(run), steps=steps, batch_size=batch_size, lr=lr,
                             eval_every=eval_every or max(1, steps // 4), init=str(controller),
                             mix_cache=str(out / "cache"), alpha=alpha, encoder=str(controller), device=device)
        train(config, resume=(run / "state.json").exists())
        atomic_write_json(out / "self_train.json", dict(collect=summary, theta=theta, alpha=alpha, steps=steps,
                                                        controller=str(controller), pre_cache=str(pre_cache)))
        return run


def _self_train(args):
    from tracelock.progress import status

    run = self_train(args.model, args.controller, args.cache, args.prompts, args.out, num=args.limit,
                     gen_length=args.gen_length, window=args.window, block=args.block, theta=args.theta,
                     alpha=args.alpha, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                     eval_every=args.eval_every, seed=args.seed, decode_batch_size=args.decode_batch_size,
                     device=args.device, progress=status)
    print(f"self-trained controller in {run} (traces and their cache beside it)")


def add_parsers(sub):
    from tracelock.cli_options import add_device, add_model, add_prompt_limit, add_setting_spelling, option_help
    from tracelock.cli_values import batch_int, gen_length_int, input_folder, positive_int, seed_int

    p = sub.add_parser("self-train", help="deployment-aware self-training: on-policy traces, mixed with the "
                                          "original pool, warm-started training")
    add_model(p)
    p.add_argument("--controller", required=True, type=input_folder("a controller folder (`tracelock train --out`)"),
                   help="the supervised controller (`tracelock train --out`)")
    p.add_argument("--cache", required=True, type=input_folder("a feature cache folder (`tracelock featurize --out`)"),
                   help="the feature cache it was trained on (the original pool, kept)")
    p.add_argument("--prompts", required=True, help="new prompts: testbed tasks (testbed:math,testbed:code) or a "
                                                    "JSONL file, as `tracelock collect --prompts`")
    add_prompt_limit(p)
    p.add_argument("--out", required=True, help="folder for traces/, cache/ and controller/ (re-running resumes)")
    p.add_argument("--gen-length", type=gen_length_int, default=64, metavar="N",
                   help=option_help("--gen-length"))
    sched = p.add_mutually_exclusive_group()
    sched.add_argument("--window", type=gen_length_int, metavar="W",
                       help="soft-crop window width (TraceLock's schedule) while collecting (default 16)")
    sched.add_argument("--block", type=gen_length_int, metavar="W",
                       help="semi-AR block length, divides --gen-length (LLaDA's block_length), while collecting "
                            "instead (default: the window)")
    add_setting_spelling(p, width="window")
    p.add_argument("--theta", type=float, default=0.97, help="commit threshold while collecting (deployed: 0.95)")
    p.add_argument("--alpha", type=float, default=0.5, help="share of the new traces in the training mix")
    p.add_argument("--steps", type=positive_int, default=1000, help="training steps (paper: 1000)")
    p.add_argument("--batch-size", type=batch_int, default=32, help="training batch")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    p.add_argument("--eval-every", type=positive_int, help="validation every N steps (default steps // 4)")
    p.add_argument("--seed", type=seed_int, default=1, help="seed of the testbed sample (the original pool used 0)")
    p.add_argument("--decode-batch-size", type=batch_int, default=16, help="items decoded together while "
                                                                           "collecting")
    add_device(p)
    p.set_defaults(func=_self_train)
