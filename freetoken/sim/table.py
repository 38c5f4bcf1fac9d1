"""Plain-text tables for the simulators' reports: columns sized to their widest cell, right-aligned except the
``left`` ones, a dashed rule under the header, and a blank line between consecutive rows of different groups."""

from __future__ import annotations

from collections.abc import Sequence


def text_table(header: Sequence[str], body: Sequence[Sequence[str]], left: frozenset[int] | set[int] = frozenset(),
               groups: Sequence | None = None) -> list[str]:
    """The table's lines (trailing blanks stripped). ``groups``: one key per body row; a blank line separates
    rows whose keys differ."""
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]

    def line(cells):
        pairs = enumerate(zip(cells, widths, strict=True))
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in pairs).rstrip()

    out = [line(header), "  ".join("-" * w for w in widths)]
    prev = None
    for i, b in enumerate(body):
        key = groups[i] if groups is not None else None
        if i and key != prev:
            out.append("")
        prev = key
        out.append(line(b))
    return out
