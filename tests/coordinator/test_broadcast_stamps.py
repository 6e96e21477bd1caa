"""Stamps on the TP broadcaster's messages (coordinator/broadcast_stamps.py), in process.

The distributed cases (a reader that skipped a broadcast gets a
CollectiveMismatch at its next one, never the skipped call's data) are in the
fault matrix: tests/faults/test_fault_matrix.py, ``skip`` / ``other-op`` of
``broadcast_object-mq`` and ``broadcast_tensor_dict-mq``.
"""

from __future__ import annotations

import pytest

from coordinator.broadcast_stamps import stamp, unstamp
from coordinator.errors import CollectiveMismatch, DecodeError


def test_a_message_of_this_call_is_returned() -> None:
    payload = {"step": 3}
    assert unstamp(stamp(payload, 12, "broadcast_object"), 12, "broadcast_object", "tp:0", 0,
                   20) is payload


@pytest.mark.parametrize("theirs,mine", [(11, 12), (13, 12)], ids=["stale", "ahead"])
def test_a_message_of_another_call_raises_naming_both_calls(theirs: int, mine: int) -> None:
    msg = stamp([1, 2], theirs, "broadcast_object")
    with pytest.raises(CollectiveMismatch) as info:
        unstamp(msg, mine, "broadcast_tensor_dict", "tp:0", 0, 30)
    text = str(info.value)
    assert info.value.peers == (0,)
    for part in ("group 'tp:0'", "op broadcast_tensor_dict", "call #30", "rank 0's broadcast_object",
                 f"collective call {theirs}", f"collective call {mine}"):
        assert part in text, (part, text)


@pytest.mark.parametrize("message", [None, [1, "x"], ["1", "x", 3], [1, 2, 3], {"a": 1}],
                         ids=["none", "short", "str-number", "int-op", "dict"])
def test_a_message_without_a_stamp_is_refused(message: object) -> None:
    with pytest.raises(DecodeError, match="without a call stamp"):
        unstamp(message, 1, "broadcast_object", "tp:0", 0, 1)
