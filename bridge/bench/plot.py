"""`--plot FILE.png`: where the time goes, as stacked bars of the stages' p50s — a panel per
payload size (each with its own scale: a step and a 64 MB window differ 1000-fold), a bar per
transport and backend, the floor drawn across each bar."""

from __future__ import annotations

import math

# Bottom up: the transport first, so that it stands right beside the dashed floor (an echo of
# the same bytes over the same channel), then the codecs, copies, overhead, and the kernel on top.
STACK_ORDER = ("transport", "client_encode", "server_decode", "server_encode", "client_decode",
               "h2d", "d2h", "queue", "server_other", "kernel")
# Moving bytes in blues (darkest: the transport itself), copies in greens, compute in red,
# overhead in greys: the picture answers "pipe, codec, copies or kernel?" by colour.
STAGE_STYLE = {
    "transport": ("#08519c", "transport (both ways)"),
    "client_encode": ("#9ecae1", "client encode"),
    "server_decode": ("#6baed6", "server decode"),
    "server_encode": ("#4292c6", "server encode"),
    "client_decode": ("#c6dbef", "client decode"),
    "h2d": ("#74c476", "h2d copy"),
    "d2h": ("#31a354", "d2h copy"),
    "queue": ("#d9d9d9", "queue"),
    "server_other": ("#969696", "server, outside the stages"),
    "kernel": ("#de2d26", "kernel"),
}


def plot(rows: list[dict], path: str, labels: dict[str, str], title: str) -> str | None:
    """Write the figure to `path`; returns why not (None when written)."""
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib)"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r["case"] for r in rows))
    lanes = list(dict.fromkeys((r["transport"], r["backend"]) for r in rows))
    columns = min(3, math.ceil(math.sqrt(len(cases))))
    panel_rows = math.ceil(len(cases) / columns)
    fig, axes = plt.subplots(panel_rows, columns, figsize=(4.2 * columns + 0.6, 3.6 * panel_rows + 1.2),
                             squeeze=False)
    for ax in axes.flat[len(cases):]:
        ax.set_visible(False)
    for ax, case in zip(axes.flat, cases):
        mine = {(r["transport"], r["backend"]): r for r in rows if r["case"] == case}
        unit, scale = ("ms", 1000.0) if max(r["round_trip_p50_us"] for r in mine.values()) >= 1000 else ("µs", 1.0)
        for x, lane in enumerate(lanes):
            row = mine.get(lane)
            if row is None:
                continue
            bottom = 0.0
            for stage in STACK_ORDER:
                colour, name = STAGE_STYLE[stage]
                height = max(row[f"{stage}_p50_us"], 0.0) / scale
                ax.bar(x, height, bottom=bottom, width=0.6, color=colour, label=name)
                bottom += height
            if row["floor_p50_us"] is not None:
                floor = row["floor_p50_us"] / scale
                ax.hlines(floor, x - 0.4, x + 0.4, colors="black", linestyles="--", linewidth=1.2,
                          label="floor: echo of the same bytes, same channel")
        first = next(iter(mine.values()))
        ax.set_title(f"{labels.get(case, case)}\n{first['request_bytes'] / 1e6:.2f} MB in, "
                     f"{first['reply_bytes'] / 1e6:.2f} MB out", fontsize=9)
        ax.set_xticks(range(len(lanes)), [f"{t}\n{b}" for t, b in lanes], fontsize=8)
        ax.set_xlim(-0.8, len(lanes) - 0.2)
        ax.set_ylabel(unit)
        ax.tick_params(axis="y", labelsize=8)
        ax.grid(axis="y", alpha=0.3)
    handles, names = axes.flat[0].get_legend_handles_labels()
    unique = dict(zip(names, handles))
    fig.legend(unique.values(), unique.keys(), loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=10)
    legend_rows = math.ceil(len(unique) / 3)
    fig.tight_layout(rect=(0, 0.035 * legend_rows + 0.02 / panel_rows, 1, 0.97))
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:  # the path was checked before the run; the disk may have filled since
        return f"cannot write {path}: {exc.strerror}"
    finally:
        plt.close(fig)
    return None
