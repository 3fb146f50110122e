"""The start-time fair-queuing primitive both the ingest scheduler and the match pool run on
(coordinator_stub/fairness.py): its ordering rules and its bounded state. The schedulers'
guarantees under floods are tested against them (tests/hostile/test_hostile_ingest.py,
test_hostile_reader_fairness.py)."""

from coordinator_stub.fairness import FairQueues

LANE = "unit"


def _serve(queues: FairQueues, cost: int, turns: int) -> list:
    """Run `turns` turns of `cost` each, FIFO within a flow; the flows served, in order."""
    served = []
    for _ in range(turns):
        start, flow = queues.next_turn()
        queue = queues.queues[flow]
        queue.popleft()
        served.append(flow)
        if queue:
            queues.wait(flow, start + cost, 0)
        else:
            queues.went_idle(flow, start + cost)
    return served


def test_backlogged_flows_take_turns_whatever_they_queued():
    queues = FairQueues()
    for i in range(10):
        queues.append("flood", i, 0)
    for i in range(2):
        queues.append("light", i, 0)
    assert _serve(queues, 100, 5) == ["flood", "light", "flood", "light", "flood"]


def test_ties_go_to_the_cheaper_turn_then_to_arrival():
    queues = FairQueues()
    queues.append("late-cheap", 0, 10)
    queues.append("early", 0, 50)
    queues.append("late", 0, 50)
    assert [queues.next_turn()[1] for _ in range(3)] == ["late-cheap", "early", "late"]


def test_a_flow_that_ran_ahead_keeps_its_place_beyond_the_credit():
    queues = FairQueues(credit=100)
    queues.append("other", 0, 0)
    queues.append("other", 1, 0)
    queues.append("heavy", 0, 0)
    start, flow = queues.next_turn()  # "other", at 0
    queues.wait(flow, start + 10, 0)
    start, flow = queues.next_turn()  # "heavy", at 0: a turn of 1,000
    assert flow == "heavy"
    queues.queues[flow].popleft()
    queues.went_idle(flow, start + 1000)
    queues.append("heavy", 1, 0)  # back at once: starts at its finish less the credit
    assert queues.newly_active_start("other") == queues.clock  # "other" never ran ahead
    assert [queues.next_turn()[1] for _ in range(2)] == ["other", "heavy"]


def test_a_light_flow_that_returns_goes_first():
    queues = FairQueues(credit=100)
    for i in range(3):
        queues.append("flood", i, 0)
    queues.append("light", 0, 0)
    assert _serve(queues, 50, 2) == ["flood", "light"]  # light went idle at finish 50
    queues.append("light", 1, 0)  # within the credit: starts at the clock, ahead of flood
    assert queues.next_turn()[1] == "light"


def test_state_is_per_flow_with_work_and_does_not_grow_with_flows_served():
    queues = FairQueues()
    queues.append("steady", 0, 0)
    for i in range(10_000):  # 10,000 readers, each served once while "steady" waits
        queues.append(f"reader-{i}", 0, 0)
        start, flow = queues.next_turn()
        queues.queues[flow].popleft()  # one item a flow: its queue is empty now
        queues.went_idle(flow, start + 1)
        if flow == "steady":
            queues.append("steady", 0, 0)
    assert len(queues._finish) <= 2 * len(queues.queues) + 65  # noqa: SLF001
    assert queues.queued() == len(queues.queues)
    leftover = queues.clear()
    assert len(leftover) >= 1 and not queues.queues and not queues.waiting
