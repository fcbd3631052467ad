"""The bounded map of the server's stores and the vision cache (`bounded_map.py`): the oldest
evicted first by count and by bytes, touch making an entry the newest, sizes changed in place,
entries too large for the budget, limits of 0."""

from __future__ import annotations

from trio_mlx.bounded_map import BoundedMap


def test_the_oldest_goes_first_beyond_the_count() -> None:
    entries: BoundedMap[str, int] = BoundedMap(max_count=2, max_bytes=1000)
    assert entries.put("a", 1, 10) and entries.put("b", 2, 10) and entries.put("c", 3, 10)
    assert entries.get("a") is None and (entries.get("b"), entries.get("c")) == (2, 3)
    assert (len(entries), entries.bytes, entries.evicted) == (2, 20, 1)


def test_the_oldest_go_first_until_the_bytes_fit() -> None:
    entries: BoundedMap[str, int] = BoundedMap(max_count=10, max_bytes=100)
    for n, key in enumerate("abcd"):
        entries.put(key, n, 30)
    assert list(entries) == ["b", "c", "d"] and entries.bytes == 90
    entries.put("e", 4, 70)  # b and c must go for it to fit
    assert list(entries) == ["d", "e"]
    assert (entries.bytes, entries.evicted) == (100, 3)


def test_touch_makes_an_entry_the_newest_and_get_does_not() -> None:
    entries: BoundedMap[str, int] = BoundedMap(max_count=3, max_bytes=1000)
    for n, key in enumerate("abc"):
        entries.put(key, n, 1)
    entries.touch("a")  # b is now the least recently used
    assert entries.get("b") == 1  # a read that leaves its place
    entries.put("d", 3, 1)
    assert list(entries) == ["c", "a", "d"]


def test_putting_a_key_again_replaces_it_as_the_newest_without_counting_an_eviction() -> None:
    entries: BoundedMap[str, str] = BoundedMap(max_count=2, max_bytes=1000)
    entries.put("a", "first", 10)
    entries.put("b", "b", 10)
    entries.put("a", "second", 25)
    assert (entries.get("a"), entries.bytes, entries.evicted) == ("second", 35, 0)
    entries.put("c", "c", 1)  # b is the oldest now
    assert entries.get("b") is None and entries.get("a") == "second"


def test_pop_forgets_an_entry_and_its_bytes() -> None:
    entries: BoundedMap[str, int] = BoundedMap(max_count=5, max_bytes=1000)
    entries.put("a", 1, 10)
    entries.put("b", 2, 20)
    assert entries.pop("a") == 1 and entries.pop("a") is None and entries.pop("z") is None
    assert (len(entries), entries.bytes, entries.evicted) == (1, 20, 0)


def test_an_entry_larger_than_the_budget_is_not_put() -> None:
    entries: BoundedMap[str, int] = BoundedMap(max_count=5, max_bytes=100)
    entries.put("a", 1, 60)
    assert not entries.put("a", 2, 101)  # the entry under its key stays, in its place
    assert entries.get("a") == 1 and entries.bytes == 60
    assert entries.put("b", 3, 100)  # exactly the budget fits, alone
    assert list(entries) == ["b"] and entries.evicted == 1


def test_limits_of_0() -> None:
    none: BoundedMap[str, int] = BoundedMap(max_count=0, max_bytes=1000)
    assert not none.put("a", 1, 0) and len(none) == 0
    empty_only: BoundedMap[str, int] = BoundedMap(max_count=5, max_bytes=0)
    assert not empty_only.put("a", 1, 1) and empty_only.put("b", 2, 0)
    assert list(empty_only) == ["b"]


def test_resizing_an_entry_evicts_the_oldest_others() -> None:
    entries: BoundedMap[str, int] = BoundedMap(max_count=5, max_bytes=100)
    for n, key in enumerate("abc"):
        entries.put(key, n, 30)
    entries.resize("b", 35)  # 95 bytes: within the budget, nothing goes
    assert list(entries) == ["a", "b", "c"] and entries.evicted == 0
    entries.resize("c", 70)  # 135 bytes: a goes, then b; c keeps its place
    assert list(entries) == ["c"] and (entries.bytes, entries.evicted) == (70, 2)
    entries.resize("c", 5)  # shrinking evicts nothing
    assert entries.bytes == 5 and entries.evicted == 2


def test_resizing_keeps_the_entry_resized_even_when_it_is_the_oldest() -> None:
    entries: BoundedMap[str, int] = BoundedMap(max_count=5, max_bytes=100)
    for n, key in enumerate("abcd"):
        entries.put(key, n, 20)
    entries.resize("a", 50)  # 130 bytes: a is the oldest, so it moves to the newest place
    assert list(entries) == ["c", "d", "a"] and entries.bytes == 90
    entries.put("e", 4, 20)  # c, the oldest now, goes
    assert list(entries) == ["d", "a", "e"]


def test_an_entry_resized_beyond_the_budget_stays_alone() -> None:
    entries: BoundedMap[str, int] = BoundedMap(max_count=5, max_bytes=100)
    entries.put("a", 1, 40)
    entries.put("b", 2, 40)
    entries.resize("b", 120)
    assert list(entries) == ["b"] and entries.bytes == 120 and entries.evicted == 1
    entries.put("c", 3, 10)  # the next put evicts it
    assert list(entries) == ["c"] and entries.bytes == 10
