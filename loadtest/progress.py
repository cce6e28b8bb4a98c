"""Progress of a load test on stderr. On a terminal: tqdm when it is installed, else one line
rewritten in place; elsewhere (a log): a line per tenth of the requests, no control characters."""

from __future__ import annotations

import importlib.util
import sys
import time

from loadtest.metrics import RequestRecord


class Progress:
    def __init__(self, total: int, enabled: bool = True, stream=None) -> None:
        self.total, self.enabled = total, enabled
        self.stream = stream or sys.stderr
        self.done = self.failed = self.tokens = 0
        self.t0 = time.monotonic()
        self._next_line = 0
        self._bar = None
        if enabled and self.stream.isatty() and importlib.util.find_spec("tqdm") is not None:
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="req", file=self.stream, dynamic_ncols=True, leave=False)

    def text(self) -> str:
        s = time.monotonic() - self.t0
        return (f"{self.done}/{self.total} requests, {self.failed} failed, {self.tokens} tokens, "
                f"{self.tokens / max(s, 1e-9):.1f} tok/s, {s:.0f}s")

    def update(self, rec: RequestRecord) -> None:
        self.done += 1
        self.failed += not rec.success
        self.tokens += rec.output_tokens
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(1)
            rate = self.tokens / max(time.monotonic() - self.t0, 1e-9)
            self._bar.set_postfix(failed=self.failed, tok_s=f"{rate:.1f}")
        elif self.stream.isatty():
            self.stream.write(f"\rloadtest: {self.text()}  ")
            self.stream.flush()
        elif self.done >= self._next_line or self.done == self.total:
            self.stream.write(f"loadtest: {self.text()}\n")
            self.stream.flush()
            self._next_line = self.done + max(1, self.total // 10)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled and self.stream.isatty():
            self.stream.write("\n")
        if self.enabled:
            self.stream.write(f"loadtest: {self.text()}\n")
            self.stream.flush()
