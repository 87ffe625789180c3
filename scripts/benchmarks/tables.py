"""Number formatting and plain-text / markdown tables, shared by the report and every mode's sections.

Invariant: pure functions of their arguments (no imports of the modes or the report), so any module may use them.
"""
from __future__ import annotations

MiB = 1 << 20


def _f(v, kind="rate"):
    if v is None:
        return "-"
    if kind == "rate":
        return f"{v:,.0f}" if v >= 100 else f"{v:,.1f}"
    if kind == "mib":
        return f"{v / MiB:,.0f}"
    if kind == "bpt":
        return f"{v:,.0f}" if v >= 100 else f"{v:,.1f}"
    if kind == "x":
        return f"{v:.2f}x"
    if kind == "pct":
        return f"{100 * v:.1f}%"
    return str(v)


def table(headers, rows) -> str:
    w = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
    lines = [" | ".join(str(h).rjust(w[i]) for i, h in enumerate(headers)),
             "-|-".join("-" * x for x in w)]
    lines += [" | ".join(str(c).rjust(w[i]) for i, c in enumerate(r)) for r in rows]
    return "\n".join(lines)


def md_table(headers, rows) -> str:
    lines = ["| " + " | ".join(str(h) for h in headers) + " |",
             "|" + "|".join("---:" if i else "---" for i in range(len(headers))) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)
