"""Waiting queues: FCFS and priority order, preemption to the front, removal."""

from kvferry.engine.core.request import Request
from kvferry.engine.core.request_queue import FCFSQueue, PriorityQueue, make_request_queue
from kvferry.engine.sampling_params import SamplingParams


def make_request(req_id: str, priority: int = 0, arrival_time: float = 0.0) -> Request:
    return Request(
        request_id=req_id,
        prompt_token_ids=[1, 2, 3],
        sampling_params=SamplingParams(),
        priority=priority,
        arrival_time=arrival_time,
    )


def req_ids(queue: FCFSQueue | PriorityQueue) -> list[str]:
    return [r.request_id for r in queue]


def test_make_request_queue_picks_the_policy() -> None:
    assert isinstance(make_request_queue("fcfs"), FCFSQueue)
    assert isinstance(make_request_queue("priority"), PriorityQueue)


def test_fcfs_keeps_arrival_order_and_prepends_to_the_front() -> None:
    queue = FCFSQueue()
    a, b, c, d = (make_request(x) for x in "abcd")
    for request in (a, b, c):
        queue.add(request)
    assert req_ids(queue) == ["a", "b", "c"]
    assert queue.peek() is a
    assert queue.pop() is a
    queue.prepend(d)
    assert req_ids(queue) == ["d", "b", "c"]
    queue.remove(b)
    assert req_ids(queue) == ["d", "c"]
    assert len(queue) == 2
    assert [queue.pop().request_id, queue.pop().request_id] == ["d", "c"]
    assert len(queue) == 0


def test_fcfs_ignores_priority() -> None:
    queue = FCFSQueue()
    queue.add(make_request("low", priority=9))
    queue.add(make_request("high", priority=-9))
    assert queue.pop().request_id == "low"


def test_priority_orders_by_value_then_arrival() -> None:
    queue = PriorityQueue()
    queue.add(make_request("p2-t0", priority=2, arrival_time=0.0))
    queue.add(make_request("p0-t2", priority=0, arrival_time=2.0))
    queue.add(make_request("p1-t1", priority=1, arrival_time=1.0))
    queue.add(make_request("p0-t1", priority=0, arrival_time=1.0))
    queue.add(make_request("neg", priority=-1, arrival_time=5.0))
    assert req_ids(queue) == ["neg", "p0-t1", "p0-t2", "p1-t1", "p2-t0"]
    assert queue.peek().request_id == "neg"
    popped = [queue.pop().request_id for _ in range(len(queue))]
    assert popped == ["neg", "p0-t1", "p0-t2", "p1-t1", "p2-t0"]


def test_priority_ties_keep_insertion_order() -> None:
    queue = PriorityQueue()
    for req_id in ("x", "y", "z"):
        queue.add(make_request(req_id, priority=1, arrival_time=3.0))
    assert [queue.pop().request_id for _ in range(3)] == ["x", "y", "z"]


def test_priority_prepend_places_by_key_not_at_the_front() -> None:
    queue = PriorityQueue()
    queue.add(make_request("a", priority=0, arrival_time=0.0))
    queue.add(make_request("c", priority=2, arrival_time=2.0))
    queue.prepend(make_request("b", priority=1, arrival_time=1.0))
    assert req_ids(queue) == ["a", "b", "c"]


def test_priority_remove_keeps_heap_order() -> None:
    queue = PriorityQueue()
    requests = [make_request(f"r{i}", priority=i % 3, arrival_time=float(i)) for i in range(6)]
    for request in requests:
        queue.add(request)
    queue.remove(requests[0])
    queue.remove(requests[4])
    assert len(queue) == 4
    assert [queue.pop().request_id for _ in range(4)] == ["r3", "r1", "r2", "r5"]
