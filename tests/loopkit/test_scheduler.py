from __future__ import annotations

import pytest

import loopkit
import jax.numpy as jnp
from loopkit.loop.scheduler import Scheduler
from loopkit.testing import FakeClock


def test_step_trigger_fires_on_multiples():
    sched = Scheduler(FakeClock())
    fired = []
    sched.add(lambda s: fired.append(step), secs=None, steps=3, name="t", step=0)
    for step in range(1, 11):
        if step >= sched.next_step or sched.clock() >= sched.next_time:
            sched.run_due(None, step)
    assert fired == [3, 6, 9]


def test_step_trigger_is_aligned_after_a_resume():
    sched = Scheduler(FakeClock())
    fired = []
    sched.add(lambda s: fired.append(step), secs=None, steps=5, name="t", step=7)
    assert sched.next_step == 10
    for step in range(8, 21):
        if step >= sched.next_step:
            sched.run_due(None, step)
    assert fired == [10, 15, 20]


def test_time_trigger_rearms_after_the_action_returns():
    clock = FakeClock()
    sched = Scheduler(clock)
    fired = []

    def slow(_):
        fired.append(clock())
        clock.advance(7)  # the action itself takes 7 s

    sched.add(slow, secs=10, steps=None, name="slow", step=0)
    for step in range(1, 100):
        clock.advance(1)
        if step >= sched.next_step or clock() >= sched.next_time:
            sched.run_due(None, step)
    # due at 10; returns at 17; next due 27 (not 20): never back to back
    assert fired[:3] == [10.0, 27.0, 44.0]


def test_either_trigger_rearms_both():
    clock = FakeClock()
    sched = Scheduler(clock)
    fired = []
    sched.add(lambda s: fired.append((step, clock())), secs=10, steps=4, name="t", step=0)
    for step in range(1, 13):
        clock.advance(3 if step != 2 else 20)
        if step >= sched.next_step or clock() >= sched.next_time:
            sched.run_due(None, step)
    # the time trigger at step 2 (the clock jumped) re-arms the step trigger too; the
    # step trigger then fires at every multiple of 4 and re-arms the time trigger, which
    # never comes due again (3 s per step: 10 s is 4 steps away)
    assert [s for s, _ in fired] == [2, 4, 8, 12]


def test_every_without_a_trigger_names_the_timer():
    class Bad:
        @loopkit.hookimpl
        def session_create(self, session):
            session.every(self.tick, name="tick")

        def tick(self, session):
            pass

    with pytest.raises(ValueError, match=r"name='tick', plugin 'Bad'.*secs= or steps="):
        loopkit.train(lambda s: (s + 1, {}), init=jnp.zeros(()), max_steps=2,
                      plugins=[Bad()], progress=False)


def test_cancel_stops_a_timer_and_handles_are_returned():
    seen = []

    class P:
        @loopkit.hookimpl
        def session_create(self, session):
            self.handle = session.every(self.tick, steps=2)

        def tick(self, session):
            seen.append(session.step)
            if session.step == 6:
                self.handle.cancel()

    loopkit.train(lambda s: (s + 1, {}), init=jnp.zeros(()), max_steps=20,
                  plugins=[P()], progress=False)
    assert seen == [2, 4, 6]


def test_timers_run_in_registration_order_and_not_at_the_stop():
    order = []

    class P:
        @loopkit.hookimpl
        def session_create(self, session):
            session.every(lambda s: order.append(("a", s.step)), steps=5, name="a")
            session.every(lambda s: order.append(("b", s.step)), steps=5, name="b")

    loopkit.train(lambda s: (s + 1, {}), init=jnp.zeros(()), max_steps=10,
                  plugins=[P()], progress=False)
    # step 10 is the stop: timers do not fire there
    assert order == [("a", 5), ("b", 5)]


def test_fake_clock_drives_time_timers_through_train():
    clock = FakeClock()
    seen = []

    class P:
        @loopkit.hookimpl
        def session_create(self, session):
            session.every(lambda s: seen.append(s.step), secs=60, name="minute")

    def step(s):
        clock.advance(25)  # each step "takes" 25 s
        return s + 1, {}

    loopkit.train(step, init=jnp.zeros(()), max_steps=10, plugins=[P()], progress=False,
                  clock=clock, jit=False)
    # due at t>=60 -> step 3 (t=75); re-armed at 75 -> due 135 -> step 6 (150); 210 -> step 9 (225)
    assert seen == [3, 6, 9]


def test_agreement_decides_time_triggers_only_at_agreement_steps():
    from loopkit.loop.scheduler import Agreement

    clock = FakeClock()
    sched = Scheduler(clock)
    other_process_due = {"value": 0}
    calls = []

    def allreduce_max(vector):
        calls.append(list(vector))
        # the "other process" votes every time slot due (its clock runs ahead)
        return [max(v, other_process_due["value"]) if i < Agreement.SLOTS else v
                for i, v in enumerate(vector)]

    signal = {"pending": False}
    stopped = []
    agreement = Agreement(allreduce_max, lambda: signal["pending"], lambda: stopped.append(1),
                          clock, interval=4, target_secs=10**9, max_interval=4)
    fired = []
    sched.add(lambda s: fired.append(step), secs=100, steps=None, name="ckpt", step=0)
    sched.agree_with(agreement, step=0)
    assert sched.next_time == float("inf")  # no local time check on the per-step path
    for step in range(1, 13):
        clock.advance(1)
        if step == 6:
            other_process_due["value"] = 1
        if step == 10:
            signal["pending"] = True
        if step >= sched.next_step or clock() >= sched.next_time:
            sched.run_due(None, step)
    assert [len(c) for c in calls] == [Agreement.SLOTS + 4] * 3  # at steps 4, 8, 12
    assert fired == [8, 12]  # locally never due (100 s); the other process said so at 8
    assert stopped == [1]  # the signal seen at step 10 was agreed at step 12


def test_agreement_refuses_two_timer_names_that_would_share_a_vote():
    from loopkit.loop.scheduler import Agreement

    clock = FakeClock()
    a = Agreement(lambda v: v, lambda: False, lambda: None, clock)
    sched = Scheduler(clock)
    # "t7" and "t30" hash to the same of the 64 slots: merged, one would fire the other
    timers = [sched.add(lambda s: None, secs=5, name=n) for n in ("t7", "t30")]
    with pytest.raises(ValueError, match="timers 't7' and 't30' share agreement slot"):
        a.decide(10, 1.0, timers)
    # a step-only timer casts no time vote: no clash
    steps_only = sched.add(lambda s: None, steps=5, name="t30")
    assert a.decide(10, 1.0, [timers[0], steps_only]) == [False, False]


def test_agreement_interval_is_the_same_function_of_agreed_numbers():
    from loopkit.loop.scheduler import Agreement

    clock = FakeClock()
    a = Agreement(lambda v: v[:-1] + [500], lambda: False, lambda: None, clock, interval=10,
                  target_secs=1.0)
    a.decide(10, 1.0, [])
    # 500 ms for 10 steps -> 50 ms/step -> 20 steps per second, capped at doubling
    assert a.interval == 20 and a.next_step == 30


def test_agreement_stops_every_process_after_the_last_step_all_have_a_batch_for():
    from loopkit.loop.scheduler import Agreement

    clock = FakeClock()
    other_has = {"n": 10**6}  # the other process's batches read ahead

    def allreduce_max(vector):
        longest = 2 * a.interval
        short = vector[Agreement.SLOTS + 2]
        return vector[:Agreement.SLOTS + 2] + [max(short, longest - min(longest, other_has["n"])),
                                               vector[-1]]

    ends = []
    a = Agreement(allreduce_max, lambda: False, lambda: None, clock, interval=4,
                  target_secs=10**9, on_exhausted=ends.append)
    a.supply = lambda n: n + 5  # this process holds more than asked: never a shortfall
    a.decide(4, 1.0, [])
    assert ends == [] and a.interval == 8
    other_has["n"] = 3  # the other process's data ends 3 batches on
    a.decide(12, 2.0, [])
    assert ends == [15] and a.next_step == 15


def test_a_background_error_on_one_process_stops_every_process_at_the_agreement():
    from loopkit.loop.coordinator import Coordinator
    from loopkit.loop.scheduler import Agreement

    coord = Coordinator()
    coord.agreed = True
    err = OSError("disk full")
    coord.request_stop(err, agreed=True)  # from a commit thread: not a local stop
    assert not coord.stopped and coord.error_pending is err

    errors = []
    # process 1 reports its error (1 + 1) in the all-reduce; this process has none
    a = Agreement(lambda v: v[:Agreement.SLOTS + 1] + [2] + v[Agreement.SLOTS + 2:],
                  lambda: False, lambda: None, FakeClock(), error_pending=lambda: None,
                  on_error=errors.append)
    a.decide(10, 1.0, [])
    assert errors == [1]
