"""Bar chart of a benchmark report: tokens/s per engine, grouped by batch size (matplotlib, imported lazily)."""

from __future__ import annotations

from pathlib import Path

from runtime.errors import InputError


def require_matplotlib() -> None:
    """Fail before a long benchmark, not after it, when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise InputError("--plot needs matplotlib, which is not installed; install it with "
                         "pip install matplotlib (or 'onnxformer[dev]'), or drop --plot") from None


def engine_label(row: dict) -> str:
    """'base-int8 [cpu]': the model directory's name and the engine."""
    return f"{row['label']} [{row['engine']}]"


def plot_report(report: dict, path: str | Path) -> Path:
    """Write a PNG: one group of bars per batch size, one bar per engine, labelled with its ratio to the first."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    batches = sorted({r["batch_size"] for r in rows})
    engines = list(dict.fromkeys(engine_label(r) for r in rows))
    width = 0.8 / len(engines)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(batches) * len(engines) ** 0.5 + 3), 4.5))
    for i, name in enumerate(engines):
        xs, ys, ratios = [], [], []
        for j, batch in enumerate(batches):
            row = next((r for r in rows if engine_label(r) == name and r["batch_size"] == batch), None)
            if row is not None:
                xs.append(j + (i - (len(engines) - 1) / 2) * width)
                ys.append(row["tokens_per_s"])
                ratios.append(row["ratio_to_first"])
        bars = ax.bar(xs, ys, width * 0.95, label=name)
        ax.bar_label(bars, labels=[f"{r:.2f}x" for r in ratios], fontsize=7, padding=2)
    ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax.set_ylabel("generated tokens/s")
    s = report["settings"]
    ax.set_title(f"onnxformer bench: {s['new_tokens']} new tokens, src {s['src_len']}, {s['threads']} threads",
                 fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    ax.margins(y=0.15)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
