"""Tool calls found in a choice's text as it is generated, so they stream as deltas.

    scan = ToolCallScanner(names={"get_weather"}, framing="hermes", parallel=True)
    for piece in pieces:
        for ev in scan.feed(piece): ...     # ("content", text) | ("call", k, name) | ("args", k, text)
    for ev in scan.finish(): ...
    scan.content, scan.calls                # the whole answer: content (or None), [(name, arguments)]

Framing "hermes": content, with calls inside <tool_call>...</tool_call>;
"json": the whole text is one call object or a list of them (tool_choice
required, or --tool-call-parser json); text that does not start with { or [
is content. A call is announced once its "name" is complete and names a
given tool (another name: the block is content after all); its "arguments"
value goes out as it arrives, character for character as the model wrote it,
so a streamed call reassembles to exactly the arguments of the non-streamed
answer, which is built by this same scanner over the whole text. Content is
sent with leading and trailing whitespace held back (the answer's content is
stripped), and with any tail that could begin "<tool_call>" held until it
cannot.
"""
from __future__ import annotations

import json
from typing import Optional

OPEN, CLOSE = "<tool_call>", "</tool_call>"
ARG_KEYS = ("arguments", "parameters")


def _decode(raw: str) -> Optional[str]:
    try:
        v = json.loads('"' + raw + '"')
    except ValueError:
        return None
    return v if isinstance(v, str) else None


class _Object:
    """An incremental scan of one JSON call object, from its "{": the name when complete, the
    arguments value's raw text as it comes. `feed` returns (events, chars used); done at "}"."""

    def __init__(self):
        self.depth, self.in_str, self.esc = 0, False, False
        self.key: Optional[str] = None
        self.expect_key = True
        self.raw = ""               # the string (key or value) being read at depth 1
        self.value_kind = None      # what the current depth-1 value is: "str" | "nested" | "scalar"
        self.name: Optional[str] = None
        self.args = ""              # raw text of the arguments value so far
        self.args_done = False
        self.done = False

    def _in_args(self) -> bool:
        return self.key in ARG_KEYS and not self.expect_key

    def feed(self, text: str) -> tuple[list, int]:
        events = []
        for i, ch in enumerate(text):
            piece = self._char(ch)
            if piece:
                events.append(("args", piece))
            if self.done:
                return events, i + 1
        return events, len(text)

    def _char(self, ch: str) -> str:
        """One character; returns the text it adds to the arguments ("" if none)."""
        if self.depth == 0:
            if ch == "{":
                self.depth = 1
            return ""
        if self.depth >= 2:                       # inside a nested value (only arguments are kept)
            self._track(ch)
            return ch if self._in_args() else ""
        return self._top(ch)

    def _track(self, ch: str) -> None:
        if self.in_str:
            if self.esc:
                self.esc = False
            elif ch == "\\":
                self.esc = True
            elif ch == '"':
                self.in_str = False
        elif ch == '"':
            self.in_str = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1

    def _top(self, ch: str) -> str:
        """A character at depth 1: keys, ':' and ',', and the start and end of each value."""
        if self.value_kind == "str":                     # a string value (or key) at depth 1
            if self.esc:
                self.esc = False
            elif ch == "\\":
                self.esc = True
            elif ch == '"':
                return self._end_string()
            self.raw += ch
            return ""
        if ch == '"':
            self.value_kind, self.raw = "str", ""
            return ""
        if ch in "{[":
            self.value_kind, self.depth = "nested", 2
            return ch if self._in_args() else ""
        if ch == ":":
            self.expect_key = False
            return ""
        if ch in ",}":
            out = ""
            if self._in_args() and self.value_kind == "scalar":
                out, self.args_done = "", True
            if self._in_args() and self.value_kind in ("nested", "scalar"):
                self.args_done = True
            self.expect_key, self.value_kind, self.key = True, None, None
            if ch == "}":
                self.done = True
            return out
        if ch.isspace():
            return ""
        if not self.expect_key:                          # a number, true, false, null
            self.value_kind = "scalar"
            return ch if self._in_args() else ""
        return ""

    def _end_string(self) -> str:
        raw, self.raw, self.value_kind = self.raw, "", None
        if self.expect_key:
            self.key = _decode(raw)
            return ""
        if self.key == "name":
            self.name = _decode(raw)
        elif self.key in ARG_KEYS:                       # arguments given as a JSON string: its text
            self.args_done = True
            return _decode(raw) or ""
        return ""


class ToolCallScanner:
    def __init__(self, names: set, framing: str = "hermes", parallel: bool = True):
        self.names, self.framing, self.parallel = set(names), framing, parallel
        self.calls: list[list] = []          # [name, arguments] of each announced call
        self._content: list[str] = []        # content sent so far
        self._pending = ""                   # text not yet decided (a possible tag start, whitespace)
        self._obj: Optional[_Object] = None
        self._raw_call = ""                  # the text of the call being read (content if it is not one)
        self._mode = "start" if framing == "json" else "content"   # content | tag | object | after | list
        self._list = False
        self._held_args = ""                 # arguments that came before the name
        self._held_ws = ""                   # content whitespace waiting for more content

    # ------------------------------------------------------------------ results
    @property
    def content(self) -> Optional[str]:
        text = "".join(self._content).strip()
        return text or None

    def tool_calls(self) -> list[tuple[str, str]]:
        return [(n, a) for n, a in self.calls]

    # ------------------------------------------------------------------ feeding
    def feed(self, text: str) -> list:
        events: list = []
        buf = self._pending + text
        self._pending = ""
        while buf:
            buf = self._step(buf, events)
        return events

    def finish(self) -> list:
        events: list = []
        if self._obj is not None and self._obj.name is None:    # a call that never named itself
            self._emit_content(self._raw_call, events, final=True)
        self._emit_content(self._pending, events, final=True)
        self._pending = ""
        return events

    def _step(self, buf: str, events: list) -> str:
        mode = self._mode
        if mode == "start":                       # json framing: a call, a list of calls, or content
            stripped = buf.lstrip()
            if not stripped:
                self._pending = buf
                return ""
            if stripped[0] in "[{":
                self._list = stripped[0] == "["
                self._mode = "list" if self._list else "object"
                self._raw_call = "[" if self._list else ""
                return stripped[1:] if self._list else stripped
            self._mode = "content"
            return buf
        if mode == "content":
            return self._content_step(buf, events)
        if mode == "tag":                         # after <tool_call>: whitespace, then "{"
            stripped = buf.lstrip()
            self._raw_call += buf[:len(buf) - len(stripped)]
            if not stripped:
                return ""
            if stripped[0] != "{":                # not a call after all
                self._mode = "content"
                self._emit_content(self._raw_call, events)
                self._raw_call = ""
                return stripped
            self._mode = "object"
            return stripped
        if mode == "object":
            return self._object_step(buf, events)
        if mode == "list":                        # between the objects of a list: , whitespace ]
            stripped = buf.lstrip().lstrip(",").lstrip()
            if not stripped:
                return ""
            if stripped[0] == "{":
                self._mode = "object"
                return stripped
            self._mode = "after"
            return stripped[1:] if stripped[0] == "]" else stripped
        if mode == "after":                       # hermes: the closing tag; json: trailing text
            return self._after_step(buf, events)
        return ""

    def _content_step(self, buf: str, events: list) -> str:
        if self.framing == "hermes":
            at = buf.find(OPEN)
            if at >= 0:
                self._emit_content(buf[:at], events)
                self._mode, self._raw_call = "tag", OPEN
                return buf[at + len(OPEN):]
            keep = next((k for k in range(min(len(OPEN) - 1, len(buf)), 0, -1) if buf.endswith(OPEN[:k])), 0)
            self._emit_content(buf[:len(buf) - keep], events)
            self._pending += buf[len(buf) - keep:]
            return ""
        self._emit_content(buf, events)
        return ""

    def _after_step(self, buf: str, events: list) -> str:
        if self.framing != "hermes":              # after the JSON: content only if it held no call
            if not self.calls:
                self._emit_content(buf, events)
            return ""
        stripped = buf.lstrip()
        if not stripped:
            return ""
        if CLOSE.startswith(stripped[:len(CLOSE)]) and len(stripped) < len(CLOSE):
            self._pending = buf
            return ""
        self._mode = "content"
        return stripped[len(CLOSE):] if stripped.startswith(CLOSE) else stripped

    def _object_step(self, buf: str, events: list) -> str:
        if self._obj is None:
            self._obj, self._held_args = _Object(), ""
        obj = self._obj
        named_before = obj.name is not None
        evs, used = obj.feed(buf)
        self._raw_call += buf[:used]
        k = len(self.calls)
        if not named_before and obj.name is not None:
            if obj.name not in self.names or (self.calls and not self.parallel):
                return self._not_a_call(buf[used:], events, keep=obj.name in self.names)
            self.calls.append([obj.name, ""])
            events.append(("call", k, obj.name))
            evs = [("args", self._held_args)] + evs if self._held_args else evs
        for _, piece in evs:
            if obj.name is None:
                self._held_args += piece
            elif piece:
                self.calls[-1][1] += piece
                events.append(("args", len(self.calls) - 1, piece))
        if obj.done:
            if obj.name is None:                  # a closed object without a name: content
                return self._not_a_call(buf[used:], events, keep=False)
            self._obj, self._raw_call = None, ""
            self._mode = "list" if self._list else "after"
        return buf[used:]

    def _not_a_call(self, rest: str, events: list, keep: bool) -> str:
        """The object is not a call of a given tool (or one call too many): its text is content,
        or (an extra call with parallel_tool_calls false) dropped."""
        if not keep:
            self._emit_content(self._raw_call, events)
        self._obj, self._raw_call = None, ""
        self._mode = "content" if self.framing == "hermes" else "after"
        return rest

    def _emit_content(self, text: str, events: list, final: bool = False) -> None:
        """Send content, holding trailing whitespace back (dropped if nothing follows it) and
        dropping the answer's leading whitespace, so the streamed content is the stripped one."""
        text = self._held_ws + text
        if not self._content:
            text = text.lstrip()
        body = text.rstrip()
        if body:
            self._content.append(body)
            events.append(("content", body))
        self._held_ws = "" if final else text[len(body):]
