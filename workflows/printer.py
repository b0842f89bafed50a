"""Every line moeflow prints goes through a console from here: markup off.

rich's markup treats `[...]` in text as style tags, so a path like `x[red]/t.jsonl`
lost its brackets and an error quoting HAProxy's `[/tmp/.../haproxy.cfg:95]` raised
a MarkupError instead of printing. Here text is always literal; colour comes from
`style=` or `rich.text.Text` spans, never from brackets inside a message.
"""

from __future__ import annotations

import sys

from rich.console import Console
from rich.text import Text


def make_console(stderr: bool = False, width: int | None = None) -> Console:
    """A markup-off console: the terminal's width on a terminal, `width` (default 160) in a log."""
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, markup=False, highlight=False, emoji=False,
                   width=None if stream.isatty() else (width or 160))


def styled(text: object, style: str | None) -> Text:
    """`text` verbatim, in `style` (a table cell or a line with colour, no markup)."""
    return Text(str(text), style=style or "")


def error_line(message: object, prefix: str = "error:") -> Text:
    """`error: <message>` with only the prefix in red; the message is printed as is."""
    return Text.assemble((prefix, "red"), " ", str(message))


console = make_console()
err_console = make_console(stderr=True)
