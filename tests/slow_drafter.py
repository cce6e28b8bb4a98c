"""A drafter on a slow device, for tests of what the verifier and the planner do about one: every
draft call of its sessions (`draft` and `draft_many`) takes `seconds` longer than the wrapped
drafter's."""

from __future__ import annotations

import time


class SlowDrafter:
    def __init__(self, inner, seconds: float) -> None:
        self.inner, self.seconds = inner, seconds

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def open(self, context, features=None):
        return SlowSession(self.inner.open(context, features), self.seconds)


class SlowSession:
    def __init__(self, inner, seconds: float) -> None:
        self.inner, self.seconds = inner, seconds

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def draft(self, *args, **kwargs):
        time.sleep(self.seconds)
        return self.inner.draft(*args, **kwargs)

    def draft_many(self, *args, **kwargs):
        time.sleep(self.seconds)
        return self.inner.draft_many(*args, **kwargs)
