"""Figures for notebook 02 (kernel fusion): the bytes an unfused chain of
kernels and the fused kernel move, the bandwidth each variant achieves next to
a plain copy, and how decode attention's bytes grow with the context length.
"""

from __future__ import annotations

import numpy as np

from tinyserve.book.plots.common import ensure_axes, finish, SMALL, TITLE


def bytes_moved_bars(labels, unfused, fused, ax=None, title="Bytes moved per call",
                     unit=2**20, unit_name="MiB"):
    """Grouped bars: bytes an unfused chain and the fused kernel move, for each shape in ``labels``."""
    ax = ensure_axes(ax, (5, 3.2))
    x = np.arange(len(labels))
    width = 0.38
    for offset, values, name, color in [(-width / 2, unfused, "unfused (eager)", "tab:red"),
                                        (width / 2, fused, "fused", "tab:green")]:
        vals = np.asarray(values, dtype=float) / unit
        bars = ax.bar(x + offset, vals, width, label=name, color=color, alpha=0.8)
        for bar, v in zip(bars, vals):
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{v:.3g}",
                    ha="center", va="bottom", fontsize=SMALL)
    ax.set_xticks(x, labels)
    ax.set_yscale("log")
    ax.set_ylabel(f"bytes read + written ({unit_name})")
    ax.set_title(title, fontsize=TITLE)
    ax.margins(y=0.2)
    ax.legend(fontsize=SMALL)
    return ax


def bandwidth_bars(rows, copy_gbps, ax=None, title="Achieved bandwidth", label_key="variant"):
    """Bars of GB/s (bytes moved by each variant / its median time), the copy bandwidth as a line.

    ``rows`` are dicts with at least ``GBps`` and ``label_key`` (``tinyserve.bench`` rows);
    the bar text gives the GB/s and, where the row has one, the speed-up over eager.
    """
    ax = ensure_axes(ax, (5, 3.2))
    labels = [str(r[label_key]) for r in rows]
    values = [r["GBps"] for r in rows]
    colors = ["tab:green" if any(k in lab for k in ("compile", "triton", "fused")) else "tab:red"
              for lab in labels]
    bars = ax.bar(range(len(rows)), values, color=colors, alpha=0.8)
    for bar, r in zip(bars, rows):
        s = r.get("speedup_vs_eager")
        text = f"{r['GBps']:.1f} GB/s" + (f"\n{s:.1f}x faster" if s and abs(s - 1) > 1e-9 else "")
        # On a white box: a bar near the copy bandwidth puts its label on the copy line.
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), text, ha="center", va="bottom",
                fontsize=SMALL, bbox=dict(boxstyle="square,pad=0.1", fc="white", ec="none", alpha=0.85), zorder=3)
    ax.axhline(copy_gbps, color="black", ls="--", lw=1.2, label=f"copy: {copy_gbps:.1f} GB/s")
    ax.set_xticks(range(len(rows)), [lab.replace(", ", "\n") for lab in labels], fontsize=SMALL)
    ax.set_ylabel("GB/s (bytes moved / time)")
    ax.set_title(title, fontsize=TITLE)
    ax.margins(y=0.2)
    ax.legend(fontsize=SMALL, loc="upper right")
    return ax


def bytes_vs_context(contexts, series, ax=None, title="Decode attention: bytes per step",
                     unit=2**20, unit_name="MiB"):
    """Bytes moved against context length (log-log), one line per variant in ``series``."""
    ax = ensure_axes(ax, (5, 3.2))
    styles = [("o-", "tab:red"), ("s-", "tab:green"), ("^--", "0.45"), ("d:", "0.6"), ("v-.", "0.3")]
    for i, (label, values) in enumerate(series.items()):
        style, color = styles[i % len(styles)]
        ax.plot(contexts, np.asarray(values, dtype=float) / unit, style, color=color, ms=4, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(contexts, [f"{c // 1024}k" if c >= 1024 else str(c) for c in contexts])
    return finish(ax, title, xlabel="context length (tokens per request)",
                  ylabel=f"bytes read + written ({unit_name})", title_size=TITLE, grid="both")
