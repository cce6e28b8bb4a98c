"""Fixtures shared across the test packages."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny matmuls run fastest on one torch thread, and results do not depend on the CPU count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
