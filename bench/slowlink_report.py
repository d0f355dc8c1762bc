"""bench.slowlink's tables: the rows and the link probe as the terminal shows them. Moved out
of bench/slowlink.py unchanged (session 24).
"""

from __future__ import annotations

COLUMNS = (
    ("codec", "<8"),
    ("P", ">3"),
    ("link", ">6"),
    ("to target s", ">12"),
    ("x bf16", ">8"),
    ("update KB", ">10"),
    ("MB sent/node", ">13"),
    ("wire MB", ">8"),
    ("link use", ">9"),
    ("merged", ">7"),
    ("delay s", ">8"),
    ("fetch s", ">8"),
    ("final val", ">10"),
)


def format_table(report: dict) -> str:
    lines = ["".join(f"{title:{align}}" for title, align in COLUMNS)]
    for r in report["rows"]:
        if not r["ran"]:
            lines.append(f"{r['codec']:<8}{r['fragments']:>3}  {r['note']}")
            continue
        cells = (
            r["codec"],
            r["fragments"],
            "none" if r["link_mbit"] is None else f"{r['link_mbit']:g}",
            f"{r['time_to_target_s']:.1f}" if r["reached"] else f">{r['elapsed_s']:.0f}",
            _ratio_cell(r),
            _fmt(_kb(r["update_bytes"]), 0),
            _fmt(_mb(r["bytes_sent_per_node"]), 2),
            _fmt(_mb(r["wire_bytes_sent_per_node"]), 2),
            _fmt(r["link_use"], 2),
            _fmt(r["peer_updates_merged"], 1),
            _fmt(r["merge_delay_s"], 1),
            _fmt(r["fetch_s"], 1),
            _fmt(r["final_val_loss"], 3),
        )
        lines.append("".join(f"{c:{align}}" for c, (_, align) in zip(cells, COLUMNS, strict=True)))
    return "\n".join(lines)


def _ratio_cell(row: dict) -> str:
    below = row.get("ratio_vs_bf16_below")
    if row["ratio_vs_bf16"] is None and below:
        return f"<{below:.2f}"
    return _fmt(row["ratio_vs_bf16"], 2)


def _kb(num_bytes: int | None) -> float | None:
    return num_bytes / 1e3 if num_bytes is not None else None


def _mb(num_bytes: int | None) -> float | None:
    return num_bytes / 1e6 if num_bytes is not None else None


def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_probe(report: dict) -> str:
    probe = report["probe"]
    if not probe:
        return "link check skipped (--probe-bytes 0)"
    return (
        f"link {report['link_mbit']} Mbit/s (tbf): a TCP transfer measured "
        f"{probe['limited_mbit']:.2f} Mbit/s ({probe['limited_mbit_reverse']:.2f} the other way), "
        f"{probe['unlimited_mbit']:.0f} Mbit/s unlimited"
    )
