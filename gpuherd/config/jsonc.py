"""JSON with comments: `//` and `/* */` are stripped outside strings, line numbers kept,
so a parse error still points at the user's line."""

from __future__ import annotations


def strip_json_comments(text: str) -> str:
    """Remove // and /* */ comments outside JSON strings, keeping line numbers."""
    out: list[str] = []
    i, n, in_string = 0, len(text), False
    while i < n:
        ch = text[i]
        if in_string:
            out.append(ch)
            if ch == "\\" and i + 1 < n:
                out.append(text[i + 1])
                i += 1
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
            out.append(ch)
        elif text.startswith("//", i):
            while i < n and text[i] != "\n":
                i += 1
            continue
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end < 0 else end + 2
            out.append("\n" * text.count("\n", i, end))
            i = end
            continue
        else:
            out.append(ch)
        i += 1
    return "".join(out)
