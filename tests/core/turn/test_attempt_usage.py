"""`AttemptStats.usage`: the usage frames are read once, and again after a new frame."""

from __future__ import annotations

from unbroken.core.turn.attempt import AttemptStats
from unbroken.core.wire.protocols import usage_from


def test_usage_is_read_again_once_a_frame_arrives() -> None:
    stats = AttemptStats()
    stats.first_raw = b'data: {"usage":{"prompt_tokens":7}}\n\n'
    stats.received_frames = 1
    assert stats.usage() == (7, None) == usage_from(stats.usage_frames())
    stats.recent.append(b'data: {"usage":{"prompt_tokens":9,"completion_tokens":3}}\n\n')
    assert stats.usage() == (
        7,
        None,
    )  # keyed on the frame count (the ledger counts every frame it keeps)
    stats.received_frames = 2
    assert stats.usage() == (9, 3) == usage_from(stats.usage_frames())
