"""Progress for a long sweep: a tqdm bar on a terminal, one plain line per step in a log.

The GPU machine's output is captured, not a terminal: a bar would fill its log with
carriage returns, so there (and wherever tqdm is missing) each step prints one line.
"""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int):
        self.total = total
        self.done = 0
        self.started = time.perf_counter()
        self.bar = None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self.bar = tqdm(total=total, unit="run", dynamic_ncols=True)

    def step(self, line: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update()
            self.bar.write(line)
        else:
            elapsed = time.perf_counter() - self.started
            print(f"[{self.done:>{len(str(self.total))}}/{self.total} {elapsed:5.0f}s] {line}", flush=True)

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
