"""Judging an eval run's QA answers: the paper's batch ranking across policies, and the critic rate.

`judge_run` ranks, per setting, the answers every policy of the run gave to the same prompt (names never reach
the judge), and judges each policy's answers against the reference answers where the task has them. One JSON per
setting under ``RUN/judge/`` (written atomically; a setting already judged for the same policies and items is
kept, so an interrupted judging resumes at the next setting). `apply_judgements` puts the average rank, the
top-two rate and the critic rate into the summary rows.
"""

import json
from pathlib import Path

from tracelock.atomic import atomic_write_json
from tracelock.eval.items import folder_items


def check_judge_args(url: str | None, model: str | None, local: str | None) -> None:
    """Raise a clear error unless the arguments name exactly one judge (cheap: builds nothing)."""
    if (url is None) == (local is None):
        raise ValueError("pass --judge-url URL --judge-model NAME (an OpenAI-compatible server) or --judge-local "
                         "PATH (a transformers chat model), exactly one of them")
    if url is not None and not model:
        raise ValueError("--judge-url needs --judge-model NAME, the served model's name")


def make_judge(url: str | None = None, model: str | None = None, local: str | None = None, api_key: str | None = None):
    """An `HTTPJudge` (``url`` + ``model``) or a `LocalJudge` (``local``, a transformers chat model folder)."""
    from tracelock.eval.judge_backends import HTTPJudge, LocalJudge

    check_judge_args(url, model, local)
    return HTTPJudge(url, model, api_key) if url is not None else LocalJudge(local)


def _judge_path(out: Path, setting_slug: str) -> Path:
    return out / "judge" / f"{setting_slug}.json"


def judge_run(out, judge, *, retries: int = 2, seed: int = 0, progress=None) -> list[Path]:
    """Judge every setting of the eval run in ``out``; returns the judge files written or kept."""
    from tracelock.eval.judge import critic_rate, rank_systems
    from tracelock.eval.tasks import make_task

    out = Path(out)
    manifest = json.loads((out / "manifest.json").read_text())
    task = make_task(manifest["task"], seed=manifest["seed"])
    if not getattr(task, "judged", False):
        raise ValueError(f"task {manifest['task']} is scored by its checker; only qa:PATH runs are judged")
    items = task.items(manifest["n"])
    written = []
    for setting in manifest["settings"]:
        answers = {}
        for p in manifest["policies"]:
            folder = out / "runs" / setting["slug"] / p["slug"]
            if folder.exists():
                answers[p["label"]] = folder_items(folder)
        done = [it for it in items if all(it.id in recs for recs in answers.values())]
        if len(answers) < 2 or not done:
            continue  # ranking compares at least two policies' answers to the same prompt
        path = _judge_path(out, setting["slug"])
        key = dict(policies=list(answers), ids=[it.id for it in done], seed=seed)
        if path.exists() and json.loads(path.read_text()).get("key") == key:
            written.append(path)
            continue
        if progress:
            progress(f"judging {setting['label']}: {len(answers)} policies x {len(done)} prompts")
        prompts = [it.prompt for it in done]
        ranking = rank_systems(judge, prompts, {pol: [recs[it.id]["completion"] for it in done]
                                                for pol, recs in answers.items()}, seed=seed, retries=retries)
        with_ref = [i for i, it in enumerate(done) if it.reference]
        critic = {}
        if with_ref:
            for pol, recs in answers.items():
                critic[pol] = critic_rate(judge, [prompts[i] for i in with_ref],
                                          [recs[done[i].id]["completion"] for i in with_ref],
                                          [done[i].reference for i in with_ref], retries=retries).to_dict()
        path.parent.mkdir(exist_ok=True)
        atomic_write_json(path, dict(key=key, ranking=ranking.to_dict(), critic=critic))
        written.append(path)
    return written


def apply_judgements(out: Path, rows: list, settings: list) -> list:
    """``rows`` with metric = average rank, plus top_two_rate and critic_rate, where RUN/judge/ has them.
    ``settings`` are the manifest's settings (label and slug)."""
    slugs = {s["label"]: s["slug"] for s in settings}
    cache = {}
    for row in rows:
        path = _judge_path(out, slugs[row["setting"]])
        if path not in cache:
            cache[path] = json.loads(path.read_text()) if path.exists() else None
        judged = cache[path]
        if judged is None or row["policy"] not in judged["key"]["policies"]:
            continue
        row["metric"] = judged["ranking"]["average_rank"][row["policy"]]
        row["top_two_rate"] = judged["ranking"]["top_two_rate"][row["policy"]]
        row["critic_rate"] = judged["critic"].get(row["policy"], {}).get("rate")
    return rows
