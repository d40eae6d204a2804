"""Admission counters: the in-flight limit, refusal while draining, slots released once."""

from __future__ import annotations

import pytest

from quickdraft.server.limits import Admission, ConnectionLimit, Slot


def test_admission():
    a = Admission(2)
    assert a.try_acquire() is None and a.try_acquire() is None
    refused = a.try_acquire()
    assert refused is not None and refused.code == "rate_limited" and refused.status == 429
    assert refused.headers() == {"Retry-After": "1"}
    slot = Slot(a)
    slot.release()
    slot.release()  # idempotent
    assert a.in_flight == 1
    a.draining = True
    refused = a.try_acquire()
    assert refused is not None and refused.code == "server_shutting_down"
    assert refused.status == 503
    a.release()
    with pytest.raises(AssertionError):
        a.release()


def test_connection_limit():
    c = ConnectionLimit(1)
    assert c.try_open() and not c.try_open()
    c.close()
    assert c.try_open()
