"""The system clock's timers: in time order on one thread of the clock's (no thread per timer),
cancellable, one failing callback leaving the others running, and the thread gone once idle."""

from __future__ import annotations

import threading

from synchronizer.clock import SystemClock

WAIT_S = 10.0  # how long a test waits for something due within milliseconds


def test_timers_run_in_time_order_on_one_thread_and_a_cancelled_one_never_runs() -> None:
    clock = SystemClock()
    ran: list[tuple[str, str]] = []
    done = threading.Event()

    def record(name: str) -> None:
        ran.append((name, threading.current_thread().name))
        if name == "last":
            done.set()

    before = threading.active_count()
    clock.call_later(0.06, lambda: record("last"))
    clock.call_later(0.02, lambda: record("second"))
    cancelled = clock.call_later(0.03, lambda: record("cancelled"))
    clock.call_later(0.0, lambda: record("first"))
    cancelled.cancel()
    assert threading.active_count() <= before + 1  # one timer thread, however many timers
    assert done.wait(WAIT_S)
    assert [name for name, _ in ran] == ["first", "second", "last"]
    assert len({thread for _, thread in ran}) == 1


def test_a_failing_callback_does_not_stop_the_timers_after_it() -> None:
    clock = SystemClock()
    done = threading.Event()

    def fail() -> None:
        raise RuntimeError("a callback's own bug")

    clock.call_later(0.0, fail)
    clock.call_later(0.01, done.set)
    assert done.wait(WAIT_S)


def test_the_timer_thread_ends_when_idle_and_a_later_timer_starts_it_again() -> None:
    clock = SystemClock()
    clock.IDLE_S = 0.05
    first = threading.Event()
    clock.call_later(0.0, first.set)
    assert first.wait(WAIT_S)
    assert clock.thread is not None
    clock.thread.join(WAIT_S)  # it ends by itself once nothing is pending
    assert not clock.thread.is_alive() and not clock.running
    again = threading.Event()
    clock.call_later(0.0, again.set)
    assert again.wait(WAIT_S)
