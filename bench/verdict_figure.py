"""The picture of a verdict folder's judged cells (those with a learned curve), from its frontier.json and records.json:

    python bench/verdict_figure.py bench/results/verdict-testbed-llada docs/verdict.png
"""

import sys
from pathlib import Path

from tracelock.atomic import atomic_write
from tracelock.eval.frontier import frontier_figure
from tracelock.eval.matched import recompute_matched

folder, png = sys.argv[1:3]
result = recompute_matched(folder, resamples=10)  # only which cells are judged matters here
judged = {t: {s: d for s, d in cells.items() if d["matched"]} for t, cells in result["tasks"].items()}
figure = frontier_figure(dict(result, tasks={t: cells for t, cells in judged.items() if cells}))
atomic_write(png, lambda path: Path(path).write_bytes(figure))  # a killed run leaves the old picture whole
