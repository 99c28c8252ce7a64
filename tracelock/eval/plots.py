"""The diagnostics' figures as PNG bytes (matplotlib's object API on the Agg canvas: no display, no global pyplot
state), drawn from what `tracelock.eval.diagnostics` computes. `tracelock report` writes them to disk."""

from __future__ import annotations

import io

import numpy as np

from tracelock.eval.diagnostics import GRID_DIFFERENT, GRID_MASKED, GRID_SAME, Divergence

GRID_COLOURS = {GRID_MASKED: "#c8c8c8", GRID_SAME: "#2ca02c", GRID_DIFFERENT: "#d62728"}
DIVERGENCE_TITLES = {"mask_sym_diff": "mask symmetric difference (% of G)", "mask_jaccard": "mask Jaccard (%)",
                     "common_token_diff": "common-token difference (% of G)",
                     "committed_jaccard": "committed-set Jaccard (%)"}
LINESTYLES = ("-", "--", ":", "-.")


def _figure(panels: int, width: float = 4.6, height: float = 3.4, columns: int | None = None, sharex=False):
    from matplotlib.figure import Figure

    columns = min(panels, columns or 3)
    rows = -(-panels // columns)
    fig = Figure(figsize=(width * columns, height * rows), layout="constrained")
    axes = fig.subplots(rows, columns, squeeze=False, sharex=sharex).ravel()
    for ax in axes[panels:]:
        ax.set_visible(False)
    return fig, axes[:panels]


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return buf.getvalue()


def acceptance_figure(curves: dict) -> bytes:
    """Cumulative acceptance, one panel per setting and one line per policy.

    Args:
        curves (dict): {setting label: {policy label: (steps [S], fraction [S])}}.
    """
    fig, axes = _figure(len(curves))
    for ax, (setting, per_policy) in zip(axes, curves.items()):
        for k, (policy, (steps, fraction)) in enumerate(per_policy.items()):
            # dashes as well as colours: policies that commit alike draw on top of each other
            ax.plot(steps, 100 * np.asarray(fraction), linestyle=LINESTYLES[k % len(LINESTYLES)], label=policy)
        ax.set(title=f"setting {setting}", xlabel="decoding step", ylabel="committed positions (%)", ylim=(0, 101))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle("Cumulative acceptance over decoding steps")
    return _png(fig)


def divergence_figure(per_setting: dict, title: str) -> bytes:
    """Divergence curves of one policy pair: one panel per metric, one line per setting.

    Args:
        per_setting (dict): {setting label: `Divergence`}.
        title (str): the figure title (the pair).
    """
    # one step axis for all panels: the mask Jaccard stops where every item is fully committed
    fig, axes = _figure(len(Divergence.METRICS), columns=2, sharex=True)
    for k, (ax, metric) in enumerate(zip(axes, Divergence.METRICS)):
        for setting, div in per_setting.items():
            ax.plot(div.step, 100 * getattr(div, metric), marker="o", label=f"{setting} ({div.items} items)")
        ax.set(title=DIVERGENCE_TITLES[metric], xlabel="decoding step" if k >= 2 else "", ylabel="%", ylim=(0, 101))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title)
    return _png(fig)


def correlation_figure(per_setting: dict) -> bytes:
    """Step-wise confidence-vs-score correlation, one panel per setting; Pearson solid, Spearman dashed.

    Args:
        per_setting (dict): {setting label: {policy label: `score_confidence_correlation` output}}.
    """
    fig, axes = _figure(len(per_setting))
    for ax, (setting, per_policy) in zip(axes, per_setting.items()):
        for k, (policy, corr) in enumerate(per_policy.items()):
            colour = f"C{k}"
            ax.plot(corr["step"], corr["pearson"], color=colour, label=f"{policy} Pearson")
            ax.plot(corr["step"], corr["spearman"], color=colour, linestyle="--", label=f"{policy} Spearman")
        ax.axhline(0, color="black", linewidth=0.6)
        ax.set(title=f"setting {setting}", xlabel="decoding step", ylabel="corr(confidence, score a)",
               ylim=(-1.05, 1.05))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle("Confidence vs controller score over decoding steps (active slots of all rows)")
    return _png(fig)


def threshold_figure(per_setting: dict) -> bytes:
    """The learned threshold sigmoid(tau) over steps: mean line and the 25-75% band, one panel per setting.

    Args:
        per_setting (dict): {setting label: {policy label: `threshold_over_steps` output}}.
    """
    fig, axes = _figure(len(per_setting))
    for ax, (setting, per_policy) in zip(axes, per_setting.items()):
        for k, (policy, thr) in enumerate(per_policy.items()):
            colour = f"C{k}"
            q = list(np.round(thr["q"], 6))
            ax.plot(thr["step"], thr["mean"], color=colour, label=f"{policy} mean")
            if 0.25 in q and 0.75 in q:
                lo, hi = thr["quantiles"][:, q.index(0.25)], thr["quantiles"][:, q.index(0.75)]
                ax.fill_between(thr["step"], lo, hi, color=colour, alpha=0.2, label=f"{policy} 25-75%")
        ax.set(title=f"setting {setting}", xlabel="decoding step", ylabel="sigmoid(tau)", ylim=(0, 1))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle("Learned threshold over decoding steps")
    return _png(fig)


def _tick_columns(steps: np.ndarray) -> np.ndarray:
    """At most about ten column indices whose steps are round numbers (the last column may be off the grid)."""
    K = len(steps)
    stride = next(s for s in (1, 2, 5, 10, 20, 25, 50, 100, 200, 500, 1000) if K / s <= 10 or s == 1000)
    return np.arange(stride - 1, K, stride) if K >= stride else np.arange(K)


def grid_figure(steps: np.ndarray, grid: np.ndarray, title: str) -> bytes:
    """A trace grid (`trace_grid`): generation positions down, probe steps across; green = same token committed in
    both, red = different tokens or committed in one only, grey = masked in both."""
    from matplotlib.colors import BoundaryNorm, ListedColormap
    from matplotlib.patches import Patch

    G, K = grid.shape
    # wide enough for the title and the legend underneath, a cell at most ~0.1 inch
    fig, (ax,) = _figure(1, width=min(14.0, max(8.0, 2.0 + 0.1 * K)), height=min(12.0, 2.6 + 0.1 * G))
    cmap = ListedColormap([GRID_COLOURS[c] for c in (GRID_MASKED, GRID_SAME, GRID_DIFFERENT)])
    norm = BoundaryNorm([-0.5, 0.5, 1.5, 2.5], cmap.N)
    ax.imshow(grid, cmap=cmap, norm=norm, aspect="auto", interpolation="nearest",
              extent=(-0.5, K - 0.5, G - 0.5, -0.5))
    ticks = _tick_columns(steps)
    ax.set_xticks(ticks, [str(s) for s in steps[ticks]])
    ax.set(xlabel="decoding step", ylabel="generation position")
    ax.set_title(title, fontsize="medium")
    ax.legend(handles=[Patch(color=GRID_COLOURS[GRID_SAME], label="same token"),
                       Patch(color=GRID_COLOURS[GRID_DIFFERENT], label="differs / mask disagreement"),
                       Patch(color=GRID_COLOURS[GRID_MASKED], label="masked in both")],
              loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, fontsize="small", frameon=False)
    return _png(fig)
