"""Read the records of a JSON array one by one, surviving a file that is cut off.

The packaged ShareGPT file stops in the middle of a record; ``json.load`` rejects it whole.
``iter_json_array`` decodes one element at a time with ``JSONDecoder.raw_decode`` over a
sliding buffer, yields every complete element, and records in a ``ReadReport`` whether
(and where) the input ended early.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

_CHUNK = 1 << 20
_MAX_ELEMENT_CHARS = 64 << 20   # larger undecodable elements are taken as a syntax error
_WS = " \t\r\n"


@dataclass
class ReadReport:
    records: int = 0
    truncated: bool = False
    stopped_at_char: int | None = None   # character offset of the first unreadable element
    error: str | None = None

    def describe(self, path: str | Path) -> str:
        if not self.truncated:
            return f"{path}: {self.records} records"
        return (f"{path}: recovered {self.records} complete records; input cut off at "
                f"character {self.stopped_at_char} ({self.error})")


def iter_json_array(path: str | Path, report: ReadReport | None = None) -> Iterator[Any]:
    report = report if report is not None else ReadReport()
    with Path(path).open(encoding="utf-8") as f:
        yield from _iter_stream(f, report)


def _iter_stream(f: TextIO, report: ReadReport) -> Iterator[Any]:
    decoder = json.JSONDecoder()
    buf = f.read(_CHUNK)
    consumed = 0          # characters dropped from the front of buf so far
    pos = _skip(buf, 0, _WS)
    eof = False
    if pos >= len(buf) or buf[pos] != "[":
        raise ValueError("input is not a JSON array")
    pos += 1
    while True:
        pos = _skip(buf, pos, _WS + ",")
        while pos >= len(buf) and not eof:
            buf, pos, consumed, eof = _refill(f, buf, pos, consumed)
            pos = _skip(buf, pos, _WS + ",")
        if pos >= len(buf):
            _mark_truncated(report, consumed + pos, "no closing ']'")
            return
        if buf[pos] == "]":
            return
        try:
            obj, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError as e:
            if eof or len(buf) - pos > _MAX_ELEMENT_CHARS:
                _mark_truncated(report, consumed + pos, e.msg)
                return
            buf, pos, consumed, eof = _refill(f, buf, pos, consumed)
            continue
        if end == len(buf) and not eof:
            # A number at the very end of the buffer may continue in the next chunk.
            buf, pos, consumed, eof = _refill(f, buf, pos, consumed)
            continue
        report.records += 1
        pos = end
        yield obj


def _refill(f: TextIO, buf: str, pos: int, consumed: int) -> tuple[str, int, int, bool]:
    chunk = f.read(_CHUNK)
    return buf[pos:] + chunk, 0, consumed + pos, not chunk


def _skip(buf: str, pos: int, chars: str) -> int:
    n = len(buf)
    while pos < n and buf[pos] in chars:
        pos += 1
    return pos


def _mark_truncated(report: ReadReport, at: int, msg: str) -> None:
    report.truncated = True
    report.stopped_at_char = at
    report.error = msg
