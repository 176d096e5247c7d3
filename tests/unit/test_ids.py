"""Random ids (``_internal/ids.py``): their shape, their alphabet used in full, and a draw of too many
dropped bytes drawn again rather than cut short."""

from __future__ import annotations

import re
import secrets

import pytest

from pilldrops._internal import ids


def test_ids_have_their_prefix_length_and_alphabet() -> None:
    made = [ids.new_id("req", 12) for _ in range(2000)]
    assert all(re.fullmatch(r"req_[a-z0-9]{12}", i) for i in made)
    assert len(set(made)) == len(made)
    assert set("".join(i[4:] for i in made)) == set(ids._ALPHABET)     # every character comes up
    assert re.fullmatch(r"sb_[a-z0-9]{16}", ids.new_id("sb"))


def test_bytes_past_the_last_whole_alphabet_are_dropped_not_folded(monkeypatch: pytest.MonkeyPatch) -> None:
    """252..255 would favour 4 characters if taken modulo 36: they are dropped, and a draw left short is
    drawn again."""
    draws = [bytes([255, 254, 253, 252] * 6), bytes([0, 35, 36, 251, 252, 71] + [1] * 18)]
    monkeypatch.setattr(secrets, "token_bytes", lambda n: draws.pop(0)[:n])
    assert ids.new_id("x", 5) == "x_a9a99"      # 0, 35, 36, 251, (252 dropped), 71
    assert draws == []
