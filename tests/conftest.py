"""Fixtures shared by the test files."""
import pytest


@pytest.fixture
def count_calls(monkeypatch):
    """``count_calls(owner, name)`` wraps ``owner.name`` (a function, or a
    classmethod looked up on its class) so that every call appends to the
    returned list and then runs the original."""
    def install(owner, name):
        calls = []
        orig = getattr(owner, name)          # a classmethod comes back bound to owner

        def counting(*args, **kwargs):
            calls.append(1)
            return orig(*args, **kwargs)
        monkeypatch.setattr(owner, name, staticmethod(counting) if isinstance(owner, type) else counting)
        return calls
    return install
