"""Training: the supervised TraceLock controller (`tracelock train`) and its held-out metrics."""
