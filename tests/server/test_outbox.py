"""The outgoing-event queue: queued deltas of a response absorb its later text, sequence
numbers count sent deltas, and a response's last delta still goes out before its done."""

from __future__ import annotations

from quickdraft.server.outbox import Outbox


def test_merge_while_queued_and_order_kept():
    box = Outbox()
    box.delta("r1", "i1", "a", 1)
    box.emit({"type": "other"})
    box.delta("r1", "i1", "b", 2)  # merges into the queued delta, ahead of "other"
    box.delta("r2", "i2", "x", 1)
    assert len(box) == 3
    first = box.pop()
    assert first == {"type": "response.output_text.delta", "response_id": "r1",
                     "item_id": "i1", "sequence_number": 0, "delta": "ab", "num_tokens": 3}
    box.delta("r1", "i1", "c", 1)  # the first one is sent: a new delta, next number
    assert box.pop() == {"type": "other"}
    assert box.pop()["response_id"] == "r2"
    second = box.pop()
    assert second["delta"] == "c" and second["sequence_number"] == 1
    assert box.pop() is None


def test_end_keeps_the_queued_delta_and_resets_numbering():
    box = Outbox()
    box.delta("r1", "i1", "tail", 1)
    box.end("r1")
    box.emit({"type": "response.done"})
    assert box.pop()["delta"] == "tail"
    assert box.pop() == {"type": "response.done"}
    box.delta("r1", "i1", "new", 1)
    assert box.pop()["sequence_number"] == 0
    box.delta("r3", "i3", "x", 1)
    box.clear()
    assert len(box) == 0 and box.pop() is None
