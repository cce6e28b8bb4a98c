"""verifier_service.servicer.run_ahead: the turn runs in its own thread while gRPC sends; the
stream sees every item in order (coalesced when it fell behind), the turn's errors, and a
closed stream stops and closes the turn before it returns (the turn must not outlive the RPC)."""

from __future__ import annotations

import threading
import time

import pytest

from verifier_service.servicer import run_ahead


def test_every_item_in_order() -> None:
    got = [x for batch in run_ahead(iter(range(200))) for x in batch]
    assert got == list(range(200))


def test_items_produced_while_the_stream_was_busy_come_as_one_batch() -> None:
    produced = threading.Event()

    def turn():
        yield from range(5)
        produced.set()

    stream = run_ahead(turn())
    assert produced.wait(5)  # the turn ran ahead without anyone reading
    time.sleep(0.05)
    assert next(stream) == [0, 1, 2, 3, 4]
    assert list(stream) == []


def test_the_turns_error_is_raised_in_the_stream_after_its_items() -> None:
    def turn():
        yield 1
        yield 2
        raise ValueError("max_tokens: bad")

    got = []
    with pytest.raises(ValueError, match="max_tokens: bad"):
        for batch in run_ahead(turn()):
            got.extend(batch)
    assert got == [1, 2]


def test_closing_the_stream_stops_and_closes_the_turn() -> None:
    closed_in = []
    step = threading.Semaphore(0)

    def turn():
        try:
            i = 0
            while True:
                step.acquire()
                yield i
                i += 1
        finally:
            closed_in.append(threading.current_thread().name)

    stream = run_ahead(turn())
    step.release()
    assert next(stream) == [0]
    threading.Timer(0.2, step.release).start()  # the turn's next item comes while close() waits
    stream.close()  # the client went away: returns once the turn stopped at that item
    assert closed_in == ["turn"]  # closed in its own thread, before close() returned
