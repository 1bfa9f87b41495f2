"""The progress display of `kvcompress eval` and `calibrate`: a rich bar on a terminal, plain lines anywhere else.

rich draws nothing while its console is not a terminal (a batch job's log, `eval ... > log 2>&1`, a
process on a remote machine), so a run of many minutes would print nothing before its table. There the
runner gets `LineProgress` instead: one line when a phase starts and then at most one every `every_s`
seconds, with the steps done and an estimate of the time left.
"""

from __future__ import annotations

import sys
import time
from contextlib import nullcontext
from typing import Callable, TextIO

LOG_EVERY_S = 30.0  # a line every half minute: one 4096-token row takes about 13 minutes on one CPU thread


def progress_display(enabled: bool, stream: TextIO | None = None, every_s: float = LOG_EVERY_S):
    """A context manager giving None (disabled), a rich Progress (terminal) or a LineProgress (not a terminal).

    stream: where to draw (default: stderr)."""
    if not enabled:
        return nullcontext(None)
    from rich.console import Console

    console = Console(stderr=True) if stream is None else Console(file=stream)
    if not console.is_terminal:
        return LineProgress(stream if stream is not None else sys.stderr, every_s)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
        console=console, transient=True,
    )


class LineProgress:
    """The part of rich.progress.Progress the runner uses (add_task, update, advance), as log lines."""

    def __init__(self, stream: TextIO, every_s: float = LOG_EVERY_S, clock: Callable[[], float] = time.monotonic):
        self.stream, self.every_s, self.clock = stream, every_s, clock
        self.description, self.total, self.done = "", 0, 0
        self.start = self.last = clock()
        self.shown: tuple[str, int] | None = None  # (description, done) of the last line

    def __enter__(self) -> "LineProgress":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None and self.total and self.shown != (self.description, self.done):
            self._line()  # the last count, unless the last line already said it

    def add_task(self, description: str, total: int) -> int:
        self.description, self.total, self.done = description, int(total), 0
        self.start = self.last = self.clock()
        return 0

    def update(self, task: int, description: str | None = None) -> None:
        if description is not None and description != self.description:
            self.description = description
            self._line()

    def advance(self, task: int, steps: int = 1) -> None:
        self.done += steps
        if self.clock() - self.last >= self.every_s:
            self._line()

    def _line(self) -> None:
        now = self.clock()
        self.last, self.shown = now, (self.description, self.done)
        elapsed = now - self.start
        share = self.done / self.total if self.total else 0.0
        left = f", about {_clock(elapsed * (1 - share) / share)} left" if 0 < share < 1 else ""
        print(f"{self.description}: {self.done}/{self.total} ({100 * share:.0f} %) after {_clock(elapsed)}{left}",
              file=self.stream, flush=True)


def _clock(seconds: float) -> str:
    """Seconds as h:mm:ss."""
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
