"""Dask's own verbs on the futures of non-blocking group calls (issue 46): ``distributed.wait``,
``as_completed``, ``client.gather`` and ``Future.result`` read the results the driver already
knows where to find without a round trip to the scheduler (``daskwg.transport.gather``), and
the scheduler still knows every key waited for through Dask whenever this client asks it
or sends it a graph naming one.

``REGISTER_AFTER`` (results held that long are registered anyway) is set far beyond a test's
length, so what the scheduler hears is what the verbs themselves cause.
"""

from __future__ import annotations

import pytest
from distributed import Client, as_completed, wait
from workers import AddWorker

from daskwg import WorkerGroup
from daskwg.transport import owned as owned_module

pytestmark = pytest.mark.timeout(120)

RANKS = 2


@pytest.fixture(scope="module")
def client(cluster4):
    with Client(cluster4) as client:
        yield client


@pytest.fixture(scope="module")
def wg(client):
    group = WorkerGroup(client, AddWorker, world_size=RANKS)
    yield group
    group.shutdown()


@pytest.fixture
def no_timer(monkeypatch):
    monkeypatch.setattr(owned_module, "REGISTER_AFTER", 3600.0)


def _count_registrations(dask_scheduler, start: bool) -> list:
    """Record the keys the scheduler is told of or asked where they are (``update_data``,
    ``who_has``, ``gather``, ``client-desires-keys``) from ``start``; stop and say which,
    as ``(handler, key)``."""
    handlers, streams = dask_scheduler.handlers, dask_scheduler.stream_handlers
    names = [(handlers, "update_data"), (handlers, "who_has"), (handlers, "gather")]
    names.append((streams, "client-desires-keys"))
    if start:
        seen: list = []

        def counting(table, name):
            original = table[name]

            def handler(*args, **kwargs):
                keys = kwargs.get("keys") or list(kwargs.get("who_has") or ())
                seen.extend((name, str(k)) for k in keys)
                return original(*args, **kwargs)

            handler.original, handler.seen = original, seen
            return handler

        for table, name in names:
            table[name] = counting(table, name)
        return []
    seen = handlers["update_data"].seen
    for table, name in names:
        table[name] = table[name].original
    return seen


def _ours(seen: list, futures: list) -> list:
    keys = {str(f.key) for f in futures}
    return [(name, key) for name, key in seen if key in keys]


VERBS = {
    "distributed.wait + client.gather": lambda client, futures: (wait(futures), client.gather(futures))[1],
    "as_completed + Future.result": lambda client, futures: sorted(f.result() for f in as_completed(futures)),
    "as_completed(with_results=True)": lambda client, futures: sorted(
        r for _, r in as_completed(futures, with_results=True)
    ),
    "client.gather": lambda client, futures: client.gather(futures),
    "Future.result": lambda client, futures: [f.result() for f in futures],
}


@pytest.mark.parametrize("verb", list(VERBS))
def test_dasks_verbs_read_results_without_telling_or_asking_the_scheduler(client, wg, no_timer, verb):
    client.run_on_scheduler(_count_registrations, start=True)
    try:
        futures = wg.record(7)
        assert VERBS[verb](client, futures) == [7] * RANKS
        keys = [f.key for f in futures]
        del futures
    finally:
        seen = client.run_on_scheduler(_count_registrations, start=False)
    assert [(name, key) for name, key in seen if key in set(map(str, keys))] == []


def test_the_scheduler_knows_keys_waited_for_through_dask_when_this_client_asks(client, wg, no_timer):
    futures = wg.record(3)
    wait(futures)
    keys = {str(f.key) for f in futures}
    assert keys <= {str(k) for k in client.who_has(futures)}
    assert all(client.nbytes(summary=False)[f.key] > 0 for f in futures)


def test_keys_waited_for_through_dask_are_registered_once_in_one_batch(client, wg, no_timer):
    client.run_on_scheduler(_count_registrations, start=True)
    try:
        futures = wg.record(4)
        wait(futures)
        client.who_has(futures)
        client.who_has(futures)
    finally:
        seen = client.run_on_scheduler(_count_registrations, start=False)
    updates = [key for name, key in _ours(seen, futures) if name == "update_data"]
    assert sorted(updates) == sorted(str(f.key) for f in futures)


@pytest.mark.parametrize("pure", [True, False])
def test_a_task_named_on_a_result_waited_for_through_dask_gets_its_value(client, wg, no_timer, pure):
    futures = wg.record(5)
    wait(futures)
    # pure=False: Dask does not tokenize the argument; the graph waits on the client's stream.
    assert client.submit(lambda x: x + 1, futures[1], pure=pure).result(timeout=60) == 6
