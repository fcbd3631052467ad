"""The runner's scheduling policy and admission's KV accounting, without MLX or Trio runs."""

from __future__ import annotations

import pytest

from trio_mlx.actors.admission import AdmissionBook
from trio_mlx.engine.scheduling import PrefillPacer, kv_bytes_at_limit, kv_tokens_limit
from trio_mlx.errors import EngineBusy


def test_the_pacer_sizes_chunks_by_measured_time() -> None:
    pacer = PrefillPacer(max_tokens=2048, target_seconds=0.25)
    assert pacer.chunk_tokens() == pacer.first_tokens  # nothing measured yet
    pacer.observe_chunk(8, 1.6)  # 5 tokens/s: a slow CPU
    assert pacer.chunk_tokens() == 1  # 0.25 s of it
    slow = PrefillPacer(max_tokens=2048, target_seconds=0.5)
    slow.observe_chunk(100, 1.0)
    assert slow.chunk_tokens() == 50
    fast = PrefillPacer(max_tokens=2048)
    fast.observe_chunk(64, 0.001)
    assert fast.chunk_tokens() == 2048  # capped at the prefill step


def test_chunks_shrink_while_others_decode_and_stay_whole_blocks() -> None:
    pacer = PrefillPacer(max_tokens=2048, block=64, target_seconds=0.25)
    pacer.observe_chunk(1000, 0.1)  # 10,000 tokens/s
    assert pacer.chunk_tokens(decoding=0) == 2048
    pacer.observe_decode(0.01)  # a decode step takes 10 ms: a chunk gets 2 of them
    assert pacer.chunk_tokens(decoding=4, waiting=1) == 192  # 200 tokens, cut to whole blocks
    pacer.observe_chunk(10, 1.0)  # very slow now: still one whole block
    assert pacer.chunk_tokens(decoding=4, waiting=1) == 64


def test_a_pass_with_a_fixed_cost_gets_chunks_sized_by_the_fitted_line() -> None:
    """A GPU-like device: every pass costs 7 ms plus 10 us a token. From a 64-token chunk alone
    the rate (~9,000 tokens/s) would give a 20 ms budget 180 tokens; the line gives 1,300, which
    the pacer reaches one doubling at a time past the largest chunk seen to keep within it."""
    pacer = PrefillPacer(max_tokens=4096, target_seconds=0.25)
    pacer.observe_chunk(64, 0.007 + 64e-5)
    assert pacer.per_token is None  # one size: no line yet
    pacer.observe_decode(0.01)
    assert int(0.02 * 64 / (0.007 + 64e-5)) == 167  # what the rate alone would allow
    assert pacer.chunk_tokens(decoding=1, waiting=1) == 128  # twice the 64 seen to fit
    pacer.observe_chunk(512, 0.007 + 512e-5)
    assert pacer.per_token == pytest.approx(1e-5) and pacer.overhead == pytest.approx(0.007)
    assert pacer.chunk_tokens(decoding=1, waiting=1) == 1024  # twice the 512 seen to fit
    pacer.observe_chunk(1024, 0.007 + 1024e-5)
    assert pacer.chunk_tokens(decoding=1, waiting=1) in (1299, 1300)  # (20 ms - 7 ms) / 10 us
    assert pacer.chunk_tokens(decoding=0) == 4096  # nothing decodes: the line alone
    # A budget under the fixed cost still buys a quarter of it in tokens (a pass costs 7 ms
    # however small): 1.75 ms / 10 us, by the line and by the last chunk's own line (it took
    # 17.2 ms, over the 8.75 ms such a chunk may take, so the next is cut along it).
    pacer.decode_step = 0.002  # a 2 ms step, as learned
    assert pacer.budget_seconds(decoding=1, waiting=1) < pacer.overhead
    assert pacer.chunk_tokens(decoding=1, waiting=1) in (174, 175)


def test_while_rows_decode_a_chunk_grows_one_doubling_past_what_was_seen_to_fit() -> None:
    """The H100's 8B case: chunks of 64 and 256 tokens took 18-20 ms, so the line promises ~600
    tokens in a 24 ms budget, where a larger chunk over a longer key length took 134 ms: only
    twice the 256 seen to fit may go, and more once a larger chunk has kept within it."""
    pacer = PrefillPacer(max_tokens=2048, block=64, target_seconds=0.25)
    for tokens, seconds in ((64, 0.0182), (256, 0.0199), (256, 0.0194)):
        pacer.observe_chunk(tokens, seconds)
    pacer.observe_decode(0.012)
    assert pacer.chunk_tokens(decoding=0) == 2048  # nothing decodes: the line alone
    assert pacer.chunk_tokens(decoding=16, waiting=1) == 512
    pacer.observe_chunk(512, 0.021)
    assert pacer.chunk_tokens(decoding=16, waiting=1) > 512
    # The prompt's keys grow and the same chunk no longer fits: what fitted at a narrower width
    # stops vouching for it, and the next is cut along the last one's line from the fixed cost
    # (18.2 ms as fitted): 256 * (24 - 18.2) / (30 - 18.2) = 125 tokens, one whole block.
    pacer.observe_chunk(256, 0.030)
    assert pacer.overhead == pytest.approx(0.0182, abs=1e-4)
    assert pacer.chunk_tokens(decoding=16, waiting=1) == 64
    pacer.observe_chunk(64, 0.0195)  # it fits again: twice it may go
    assert pacer.chunk_tokens(decoding=16, waiting=1) == 128


def test_a_crowd_waiting_beside_a_small_batch_gets_a_longer_chunk() -> None:
    pacer = PrefillPacer(max_tokens=4096, target_seconds=0.25)
    pacer.observe_chunk(1000, 0.1)  # 10,000 tokens/s
    pacer.observe_decode(0.01)
    assert pacer.budget_seconds(decoding=4, waiting=4) == 0.02  # as many waiting as decoding
    assert pacer.budget_seconds(decoding=1, waiting=7) == 0.14  # seven newcomers, one stream
    assert pacer.chunk_tokens(decoding=1, waiting=7) == 1400
    assert pacer.budget_seconds(decoding=1, waiting=100) == 0.25  # never past the chunk target


def test_kv_limits_count_prompt_and_completion_bounded_by_max_kv_size() -> None:
    assert kv_tokens_limit(100, 50, None) == 150
    assert kv_tokens_limit(100, 50, 64) == 64
    assert kv_bytes_at_limit(100, 50, 10, None) == 256 * 10  # mlx-lm grows in 256-token steps


def test_admission_queues_on_kv_memory_even_with_free_slots() -> None:
    book = AdmissionBook(slots=4, mode="wait", max_waiting=2)
    book.account_kv(1000, 1)
    assert book.try_admit(1, 600)
    assert not book.try_admit(2, 600)  # a slot is free, the memory is not
    book.enqueue(2, 600)
    assert not book.try_admit(3, 100)  # nobody overtakes the queue
    book.release(1)
    assert book.statistics().running == 1 and book.statistics().kv_reserved_bytes == 600
    assert book.statistics().memory_waits == 1


def test_admission_counts_every_row_at_the_widest_ones_limit() -> None:
    """The batch pads its rows to the longest: two short requests and a long one whose own
    limits sum to 800 of a 1,000 budget would hold 3 x 600 once the long one joined, so it
    waits until it fits (here, alone) although a slot is free."""
    book = AdmissionBook(slots=4, mode="wait", max_waiting=2)
    book.account_kv(1000, 1)
    assert book.try_admit(1, 100) and book.try_admit(2, 100)
    assert book.kv_footprint() == 200 and book.kv_footprint(600) == 1800
    assert not book.try_admit(3, 600)
    waiter = book.enqueue(3, 600)
    book.release(1)
    assert not waiter.granted  # 2 x 600 still over
    book.release(2)
    assert waiter.granted and book.statistics().kv_reserved_bytes == 600
    assert not book.try_admit(4, 100)  # beside it a short row is padded to 600 too: 1,200


def test_a_request_larger_than_the_budget_runs_alone() -> None:
    book = AdmissionBook(slots=4, mode="fail-fast")
    book.account_kv(1000, 1)
    assert book.try_admit(1, 5000)  # alone: admitted
    assert not book.try_admit(2, 10)
    with pytest.raises(EngineBusy):
        book.enqueue(2, 10)  # fail-fast: 429 at once


def test_while_rows_decode_a_chunk_grows_along_the_line_of_the_last_one_that_fitted() -> None:
    """Two small chunks, then a chunk as large that took twice as long (its prompt's keys grew):
    the fitted line spans all three and allows more in a 24 ms budget than the last chunk that
    fitted does, scaled along its own line from the fixed cost; the smaller figure wins."""
    pacer = PrefillPacer(max_tokens=4096, target_seconds=0.25)
    for tokens, seconds in ((64, 0.010), (128, 0.011), (128, 0.020)):
        pacer.observe_chunk(tokens, seconds)
    pacer.observe_decode(0.012)
    assert pacer.per_token is not None
    budget, fixed = 0.024, pacer.overhead
    by_line = int((budget - fixed) / pacer.per_token)
    by_last = int(128 * (budget - fixed) / (0.020 - fixed))
    assert 128 < by_last < by_line <= 2 * 128
    assert pacer.chunk_tokens(decoding=16, waiting=1) == by_last


def test_a_chunk_in_the_decode_pass_is_sized_by_what_it_adds_to_the_step() -> None:
    """The 8B-like device: a chunk of its own costs 18 ms of fixed cost and ~7.8 µs a token;
    riding in a 12 ms decode step's pass (a 24 ms budget at a share of 2) the first chunk aims
    at half the budget by that slope, but at most `MIXED_FIRST_TOKENS`. Then the costliest
    token of the last chunks sizes the next, at most twice the largest of them: a chunk whose
    keys grew cuts it, one that seemed to add nothing (the step's noise) does not grow it, and
    once the costly chunk has left the window the chunks grow again."""
    from trio_mlx.engine.scheduling import MIXED_FIRST_SHARE, MIXED_FIRST_TOKENS, MIXED_WINDOW

    pacer = PrefillPacer(max_tokens=4096, block=64, target_seconds=0.25, mixed_share=2.0)
    for tokens, seconds in ((64, 0.018), (256, 0.0195)):
        pacer.observe_chunk(tokens, seconds)
    pacer.observe_decode(0.012)
    assert pacer.per_token is not None
    assert int(MIXED_FIRST_SHARE * 0.024 / pacer.per_token) == 1535  # by that slope...
    assert pacer.mixed_tokens(decoding=16) == MIXED_FIRST_TOKENS == 128  # ... at most 128
    pacer.observe_mixed(256, 0.006)  # 23 µs a token: 1,024 would fit, but twice 256 at most
    assert pacer.mixed_tokens(decoding=16) == 512
    pacer.observe_mixed(1024, 0.048)  # its keys grew: twice the budget
    assert pacer.mixed_tokens(decoding=16) == 512
    pacer.observe_mixed(512, -0.001)  # within the step's noise: no measure, no growth
    assert pacer.mixed_tokens(decoding=16) == 512
    for _ in range(MIXED_WINDOW - 1):
        pacer.observe_mixed(512, 0.006)  # 12 µs a token
    assert pacer.mixed_tokens(decoding=16) == 1024  # 2,048 would fit: twice 512 at most
    assert pacer.decode_step == 0.012  # a mixed step's time is not a plain step's


def test_a_first_chunk_in_the_decode_pass_without_a_fitted_line_takes_the_rate() -> None:
    """On the CPU the pacer has a rate, no line (a pass costs by its tokens): the first chunk in
    a decode step's pass takes half its budget at that rate; with nothing measured at all,
    `first_tokens`."""
    from trio_mlx.engine.scheduling import DEFAULT_MIXED_SHARE, MIXED_FIRST_SHARE

    pacer = PrefillPacer(max_tokens=4096, first_tokens=16)
    assert pacer.mixed_tokens(decoding=4) == 16
    pacer.observe_chunk(1000, 0.05)  # 20,000 tokens a second
    pacer.observe_decode(0.004)
    assert pacer.per_token is None
    budget = DEFAULT_MIXED_SHARE * 0.004
    assert pacer.mixed_tokens(decoding=4) == int(MIXED_FIRST_SHARE * budget * 20_000) == 50


def test_a_step_that_carried_a_chunk_is_never_a_plain_steps_time() -> None:
    """The runner's accounting (`batch_loop._observe_step`): pipelined, a step's wait is mostly
    the pass queued a step before, so its time costs that pass's chunk; the first step with a
    chunk in its own pass is not a plain step either (its wait may include that pass)."""
    from trio_mlx.actors.batch_loop import _observe_step
    from trio_mlx.engine.batch_join import PrefillResult

    pacer = PrefillPacer(max_tokens=4096, block=64, target_seconds=0.25)
    pacer.observe_decode(0.0074)
    chunk = [PrefillResult(seq=None, prefilled=512)]  # type: ignore[arg-type]
    later = _observe_step(pacer, 0.080, chunk, 0, True)  # the first carried a chunk: 80 ms
    assert later == 512 and pacer.decode_step == 0.0074 and not pacer._mixed
    later = _observe_step(pacer, 0.060, [], later, True)  # the next waits for that chunk
    assert later == 0 and pacer._mixed[-1] == (512, pytest.approx(0.0526))
    assert pacer.decode_step == 0.0074
    _observe_step(pacer, 0.0080, [], 0, True)  # a plain step again
    assert pacer.decode_step == pytest.approx(0.8 * 0.0074 + 0.2 * 0.008)
    _observe_step(pacer, 0.030, chunk, 0, False)  # read at once: its own chunk's cost
    assert pacer._mixed[-1] == (512, pytest.approx(0.030 - pacer.decode_step))


def test_a_chunk_in_the_decode_pass_keeps_to_its_own_smaller_share() -> None:
    """By default a chunk in the decode pass may add `DEFAULT_MIXED_SHARE` step times, less
    than a chunk of its own's `decode_share`: with a 12 ms step, 15 ms, so 1,024 tokens that
    added 48 ms are cut to 320 (whole blocks of 64), where a share of 2 (24 ms) gives 512."""
    from trio_mlx.engine.scheduling import DEFAULT_DECODE_SHARE, DEFAULT_MIXED_SHARE

    assert DEFAULT_MIXED_SHARE < DEFAULT_DECODE_SHARE
    pacer = PrefillPacer(max_tokens=4096, block=64, target_seconds=0.25)
    pacer.observe_decode(0.012)
    assert pacer.budget_seconds(decoding=16, share=pacer.mixed_share) == 0.012 * DEFAULT_MIXED_SHARE
    pacer.observe_mixed(1024, 0.048)
    assert pacer.mixed_tokens(decoding=16) == int(1024 * 0.012 * DEFAULT_MIXED_SHARE / 0.048)
    assert pacer.mixed_tokens(decoding=16) == 320
    pacer.mixed_share = 2.0
    assert pacer.mixed_tokens(decoding=16) == 512
