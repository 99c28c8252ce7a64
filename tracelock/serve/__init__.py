"""`tracelock serve`: an OpenAI-compatible HTTP server with continuous batching at step granularity.

- `config`: the served model's settings and what a request may choose (policy, max_tokens -> generation length).
- `protocol`: request bodies, their validation, OpenAI-style JSON errors.
- `scheduler`: one decode thread that admits requests into the slots of static-shape decode engines between steps.
- `stream`: a request's text as its committed prefix grows (stop strings, max_tokens, incremental detokenizing).
- `metrics`: counters and gauges in Prometheus' text format.
- `app`: the FastAPI application; `cli`: the ``tracelock serve`` command.
"""
