"""Evaluation: tasks and scoring (GSM8K, HumanEval, QA, the testbed), sandboxed execution, the QA judge,
`tracelock eval` runs, trace diagnostics and `tracelock report`.

Names load lazily, so `tracelock --help` does not import torch or matplotlib through this package.
"""

import importlib

_EXPORTS = {
    "extract_gsm8k_answer": ("tracelock.tasks.gsm8k", "extract_answer"),
    "is_gsm8k_correct": ("tracelock.tasks.gsm8k", "is_correct"),
    "run_sandboxed": ("tracelock.eval.sandboxed", "run_sandboxed"),
    "humaneval_check": ("tracelock.eval.humaneval", "humaneval_check"),
    "load_humaneval": ("tracelock.eval.humaneval", "load_problems"),
    "make_task": ("tracelock.eval.tasks", "make_task"),
    "run_eval": ("tracelock.eval.runner", "run_eval"),
    "Judge": ("tracelock.eval.judge", "Judge"),
    "rank_systems": ("tracelock.eval.judge", "rank_systems"),
    "critic_rate": ("tracelock.eval.judge", "critic_rate"),
    "RankingResult": ("tracelock.eval.judge", "RankingResult"),
    "CriticResult": ("tracelock.eval.judge", "CriticResult"),
    "HTTPJudge": ("tracelock.eval.judge_backends", "HTTPJudge"),
    "LocalJudge": ("tracelock.eval.judge_backends", "LocalJudge"),
    "ControllerStepRecorder": ("tracelock.eval.diagnostics", "ControllerStepRecorder"),
    "write_controller_steps": ("tracelock.eval.diagnostics", "write_controller_steps"),
    "read_controller_steps": ("tracelock.eval.diagnostics", "read_controller_steps"),
    "trace_divergence": ("tracelock.eval.diagnostics", "trace_divergence"),
    "divergence_over_items": ("tracelock.eval.diagnostics", "divergence_over_items"),
    "cumulative_acceptance": ("tracelock.eval.diagnostics", "cumulative_acceptance"),
    "score_confidence_correlation": ("tracelock.eval.diagnostics", "score_confidence_correlation"),
    "threshold_over_steps": ("tracelock.eval.diagnostics", "threshold_over_steps"),
    "trace_grid": ("tracelock.eval.diagnostics", "trace_grid"),
    "write_report": ("tracelock.eval.report", "write_report"),
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tracelock.eval' has no attribute {name!r}")
    module, attr = _EXPORTS[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value
