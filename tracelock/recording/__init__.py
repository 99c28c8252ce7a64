"""Trace producers: decode prompts with a policy and record what each step committed (`recorder`), or run that
over a prompt set into a trace store (`collect`, ``tracelock collect``). They sit above the decoders they drive
and beside `tracelock.traces`, which holds the trace data they write (docs/design.md, "Layers")."""
