"""The one HTML page style of autopar: the plan report (``autopar plan --html``,
``autopar report``) and the profile report (``autopar profile report --html``) are built
in it, so they read alike.

A page stands alone: its style is inline and its figures are base64 PNG, so it can be
mailed, attached to a ticket or opened from a job's output directory. Wide content (a
long explanation line, a wide table) scrolls inside its own box; the page itself never
scrolls sideways.
"""

from __future__ import annotations

import base64
import html

PAGE_CSS = (
    "body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}"
    "pre{background:#f6f6f6;padding:1em;overflow-x:auto}"
    ".table{overflow-x:auto}table{border-collapse:collapse;margin:1em 0;font-size:0.9em}"
    "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}th{background:#f3f3f3}"
    "td:first-child,th:first-child{text-align:left}"
    "figure{margin:1em 0}figcaption{font-size:0.85em;color:#555}img{max-width:100%;height:auto}"
)


def page(title: str, body: str) -> str:
    """A standalone HTML document titled ``title`` (plain text) around ``body`` (HTML)."""
    return (
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<title>{html.escape(title)}</title><style>{PAGE_CSS}</style></head>"
        f"<body><h1>{html.escape(title)}</h1>\n{body}\n</body></html>\n"
    )


def figure(png: bytes, alt: str, caption: str = "") -> str:
    """A PNG image embedded in a ``<figure>``, with its caption when there is one."""
    data = base64.b64encode(png).decode("ascii")
    text = f"<figcaption>{html.escape(caption)}</figcaption>" if caption else ""
    return f"<figure><img alt='{html.escape(alt)}' src='data:image/png;base64,{data}'>{text}</figure>"


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A table of plain-text cells, in a box that scrolls sideways when it is wider than
    the page."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<div class='table'><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"
