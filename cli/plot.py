"""`cuflash2 bench --plot`: TFLOP/s against seqlen, a line per implementation, a panel per (head dim, mask)."""

from __future__ import annotations

import click


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise click.UsageError("--plot needs matplotlib: pip install matplotlib") from None


def _series(rows, impl, head_dim, causal):
    points = sorted((r["seqlen"], r["tflops"]) for r in rows
                    if r["impl"] == impl and r["head_dim"] == head_dim and r["causal"] == causal
                    and r.get("tflops") is not None)
    return [x for x, _ in points], [y for _, y in points]


def _draw_panel(ax, rows, impls, seqlens, head_dim, causal) -> None:
    for impl in impls:
        xs, ys = _series(rows, impl, head_dim, causal)
        if xs:
            ax.plot(xs, ys, marker="o", label=impl)
    ax.set_xscale("log", base=2)
    ax.set_xticks(seqlens, [str(s) for s in seqlens], minor=False)
    ax.set_xticks([], minor=True)
    ax.set_title(f"head dim {head_dim}, {'causal' if causal else 'non-causal'}")
    ax.set_xlabel("seqlen")
    ax.set_ylabel("TFLOP/s")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)


def plot_results(rows: list[dict], path: str, title: str = "") -> None:
    """Save the figure to `path` (format from its extension); no pyplot, so no global backend state."""
    from matplotlib.figure import Figure

    head_dims = sorted({r["head_dim"] for r in rows})
    causals = sorted({r["causal"] for r in rows})
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    seqlens = sorted({r["seqlen"] for r in rows})
    fig = Figure(figsize=(5 * len(causals), 3.6 * len(head_dims)))
    axes = fig.subplots(len(head_dims), len(causals), squeeze=False)
    for i, head_dim in enumerate(head_dims):
        for j, causal in enumerate(causals):
            _draw_panel(axes[i][j], rows, impls, seqlens, head_dim, causal)
    axes[0][0].legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
