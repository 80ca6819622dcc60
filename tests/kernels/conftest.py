"""The kernel tests' fixture: buffers the kernels allocate start as garbage."""

import pytest
import torch


def _poisoned(factory):
    """Wrap torch.empty / torch.empty_like so that freshly allocated buffers hold NaN (or -7 for ints)."""

    def allocate(*args, **kwargs):
        tensor = factory(*args, **kwargs)
        return tensor.fill_(float("nan") if tensor.is_floating_point() else -7)

    return allocate


@pytest.fixture
def poison(monkeypatch):
    """Every buffer the kernels allocate without initialising starts as garbage, so an element the
    kernels forget to write shows up as NaN / -7 in the result."""
    monkeypatch.setattr(torch, "empty", _poisoned(torch.empty))
    monkeypatch.setattr(torch, "empty_like", _poisoned(torch.empty_like))
