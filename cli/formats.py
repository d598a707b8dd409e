"""Renderers for result lists (list of dicts): aligned text table, CSV, JSON and Markdown."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math

FORMATS = ("table", "csv", "json", "markdown")


@dataclasses.dataclass(frozen=True)
class Column:
    key: str
    header: str
    spec: str = ""  # format spec for numbers, e.g. ".1f"
    align: str = ">"  # ">" right, "<" left


def cell(value, spec: str = "") -> str:
    """A value as table text: None / NaN -> '-', bools -> yes/no, numbers through `spec`."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if spec and isinstance(value, (int, float)):
        return format(value, spec)
    return str(value)


def _cells(rows, columns) -> list[list[str]]:
    return [[cell(row.get(c.key), c.spec) for c in columns] for row in rows]


def render_table(rows, columns) -> str:
    """Columns aligned on the widest entry, a dashed rule under the header."""
    body = _cells(rows, columns)
    widths = [max([len(c.header)] + [len(r[i]) for r in body]) for i, c in enumerate(columns)]

    def line(values):
        return "  ".join(format(v, f"{c.align}{w}") for v, c, w in zip(values, columns, widths)).rstrip()

    out = [line([c.header for c in columns]), line(["-" * w for w in widths])]
    out += [line(r) for r in body]
    return "\n".join(out) + "\n"


def render_markdown(rows, columns) -> str:
    def line(values):
        return "| " + " | ".join(v.replace("|", "\\|") for v in values) + " |"

    rule = ["---:" if c.align == ">" else ":---" for c in columns]
    out = [line([c.header for c in columns]), "|" + "|".join(rule) + "|"]
    out += [line(r) for r in _cells(rows, columns)]
    return "\n".join(out) + "\n"


def render_csv(rows, columns) -> str:
    """Raw values under the column keys (machine-readable: no rounding, empty for missing)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow([c.key for c in columns])
    for row in rows:
        writer.writerow(["" if _missing(row.get(c.key)) else row.get(c.key) for c in columns])
    return buffer.getvalue()


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def json_safe(value):
    """NaN / inf -> None (JSON has neither), recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def render_json(rows, environment: dict | None = None) -> str:
    payload = {"environment": environment or {}, "results": list(rows)}
    return json.dumps(json_safe(payload), indent=2) + "\n"


def render(fmt: str, rows, columns, environment: dict | None = None) -> str:
    if fmt == "table":
        return render_table(rows, columns)
    if fmt == "markdown":
        return render_markdown(rows, columns)
    if fmt == "csv":
        return render_csv(rows, columns)
    if fmt == "json":
        return render_json(rows, environment)
    raise ValueError(f"format: expected one of {FORMATS}, got {fmt!r}")
