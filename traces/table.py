"""Fixed-width text tables for the printed reports (in the bottom layer, so every layer prints
its tables alike).

Invariant of :func:`format_table`: no line is longer than ``width`` characters (default
:data:`WIDTH`). The first column (the row label) is cut to ``label_width`` characters, any
other cell to what fits beside it, and the columns that do not fit beside the labels continue
in a further block, under the same labels, after a blank line. Cut text ends in ``...``.
"""

from __future__ import annotations

#: The widest line a printed table may have.
WIDTH = 120
#: The widest row label (a workload's short label, say).
LABEL_WIDTH = 32
GAP = "  "


def cut(text: str, width: int) -> str:
    """``text``, or its first characters and ``...`` when it is longer than ``width``."""
    return text if len(text) <= width else text[:max(width - 3, 0)] + "..."


def format_table(header: list[str], rows: list[list], *, align: str | None = None, width: int = WIDTH,
                 label_width: int = LABEL_WIDTH) -> str:
    """``rows`` (each as long as ``header``, cells shown with ``str``) as a text table.

    ``align`` has one letter per column, ``l`` or ``r`` (default: the label column left, the
    others right). See the module docstring for how it keeps within ``width``."""
    align = align or "l" + "r" * (len(header) - 1)
    table = [[str(cell) for cell in row] for row in [header, *rows]]
    label = min(label_width, max(len(row[0]) for row in table))
    room = max(width - label - len(GAP), 1)
    table = [[cut(row[0], label), *(cut(cell, room) for cell in row[1:])] for row in table]
    widths = [max(len(row[j]) for row in table) for j in range(len(header))]
    blocks, block, used = [], [], label
    for j in range(1, len(header)):
        if block and used + len(GAP) + widths[j] > width:
            blocks.append(block)
            block, used = [], label
        block.append(j)
        used += len(GAP) + widths[j]
    blocks.append(block)
    lines = []
    for number, columns in enumerate(blocks):
        if number:
            lines.append("")
        for row in table:
            cells = [_aligned(row[j], widths[j], align[j]) for j in (0, *columns)]
            lines.append(GAP.join(cells).rstrip())
    return "\n".join(lines)


def _aligned(text: str, width: int, how: str) -> str:
    return text.ljust(width) if how == "l" else text.rjust(width)
