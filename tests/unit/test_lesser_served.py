"""dht.lesser_served: holders that serve a group round's lesser variant are passed over, a
bounded number of times per id, and counted."""

from __future__ import annotations

import pytest

from dht.lesser_served import LesserServed


def test_another_holder_is_asked_until_the_tries_are_spent() -> None:
    lesser = LesserServed(max_tries=3, max_ids=2)
    assert lesser.served(("g", 1)) and lesser.served(("g", 1))
    assert not lesser.served(("g", 1))  # the third: given up on, forgotten
    assert lesser.tries(("g", 1)) == 0 and lesser.num_given_up == 1
    assert lesser.served(("g", 1))  # asked again later: counted afresh
    assert lesser.served(("g", 2)) and lesser.served(("g", 3))  # at most two ids held
    assert lesser.tries(("g", 1)) == 0 and lesser.tries(("g", 3)) == 1
    assert lesser.num_served == 6


def test_bounds_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_tries"):
        LesserServed(max_tries=0)
