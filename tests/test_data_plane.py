"""Where a batch's bytes go: only to the ranks that need them, never through the
scheduler or the driver (issue 9). Bytes are counted with the kernel's per-socket
``TCP_INFO`` counters in the driver and, via ``client.run``, in the workers.

The issue's 64 MiB batches are scaled down to 16 MiB to keep the shared test machine
responsive; every asserted ratio is the issue's.
"""

from __future__ import annotations

import gc
import pickle
import re
import sys
import threading
import types
import warnings

import cloudpickle
import dask
import numpy as np
import pytest
import torch
from conftest import CLICluster, process_cluster, wait_for_workers
from dask.sizeof import sizeof
from distributed import Client, wait
from plane_workers import (
    Consumer,
    Producer,
    Stateful,
    count_part_info_asks,
    gathered_files,
    no_shared_memory,
    tcp_bytes_received,
    tcp_bytes_sent,
)

from daskwg import (
    DataProto,
    DataProtoFuture,
    DispatchError,
    RankError,
    ResourcePool,
    WorkerGroup,
    serialization,
)
from daskwg.wire.frames import received_bytes

MiB = 1 << 20
ROWS, COLS = 1024, 2048  # x and noise: 8 MiB each; the batch is 16 MiB


@pytest.fixture(scope="module")
def plane():
    """Six one-thread worker processes: producers and consumers on separate workers."""
    with process_cluster(6) as cluster, Client(cluster) as client:
        client.wait_for_workers(6)
        yield client, ResourcePool(client, world_size=6)


def seed(rows: int = ROWS, cols: int = COLS) -> DataProto:
    return DataProto.from_dict({"id": torch.arange(rows)}, meta_info={"cols": cols})


def batch_bytes(rows: int, cols: int = COLS) -> int:
    return rows * (2 * cols * 4 + 8)


def received(client: Client, workers: list[str]) -> dict[str, int]:
    return client.run(tcp_bytes_received, workers=workers)


def groups(client: Client, pool: ResourcePool, sizes: list[int], *classes):
    rest = pool.world_size - sum(sizes)
    subs = pool.split([*sizes, rest] if rest else sizes)
    return [WorkerGroup(client, cls, workers=sub) for cls, sub in zip(classes, subs)]


# --------------------------------------------------------------------- resharding


@pytest.mark.timeout(600)
@pytest.mark.parametrize("shared_memory", [False, True], ids=["comm", "shared-memory"])
@pytest.mark.parametrize(("m", "n", "rows"), [(4, 2, 1022), (2, 4, 1024)])
def test_each_consumer_rank_receives_only_its_rows_when_dp_sizes_differ(plane, m, n, rows, shared_memory):
    # With daskwg.shared-memory off (the route between hosts) each consumer receives its rows
    # over TCP, and nothing else; on (one host) it maps the parts it reads a quarter or more
    # of from their workers' shared-memory files, and receives over TCP only the rest (here
    # one row of 1022 rows on 4 producers): reshard 4 -> 2 of 64 MiB 76 -> 50 ms here.
    client, pool = plane
    producers, consumers = groups(client, pool, [m, n], Producer, Consumer)
    try:
        with dask.config.set({"daskwg.shared-memory": shared_memory}):
            future = producers.make(seed(rows))  # 1022 rows over 4 ranks: 2 rows of padding
            wait(list(future.futures))
            before = received(client, consumers.workers)
            out = consumers.summary(future)
            after = received(client, consumers.workers)

        share = batch_bytes(rows) / n
        for rank, address in enumerate(consumers.workers):
            got = after[address] - before[address]
            if shared_memory:
                assert got < 0.05 * share, (rank, got, share)
            else:
                assert 0.5 * share < got <= 1.25 * share, (rank, got, share)
        bounds = np.cumsum([0] + [rows // n + (r < rows % n) for r in range(n)])
        assert [o["ids"] for o in out] == [list(range(bounds[r], bounds[r + 1])) for r in range(n)]
        assert all(o["x_ok"] for o in out)
        assert [o["tag"][0] for o in out] == [f"row{bounds[r]}" for r in range(n)]
        assert all(o["meta"] == {"producer_world": m} for o in out)
    finally:
        producers.shutdown()
        consumers.shutdown()


@pytest.mark.timeout(300)
def test_rows_mapped_from_shared_memory_are_the_consuming_ranks_own(plane):
    # Copy-on-write: a consumer that changes its mapped rows in place changes nothing the
    # producer holds, so the next consumer of the same future reads the rows as made.
    client, pool = plane
    producers, consumers = groups(client, pool, [2, 2], Producer, Consumer)
    try:
        future = producers.make(seed())
        wait(list(future.futures))
        before = received(client, consumers.workers)
        ids = consumers.scribble(future)
        after = received(client, consumers.workers)
        assert [i for part in ids for i in part] == list(range(ROWS))
        assert all(after[a] - before[a] < 0.05 * batch_bytes(ROWS) / 2 for a in consumers.workers)  # mapped
        again = consumers.summary(future)
        assert all(o["x_ok"] for o in again), "a consumer's in-place change reached the producer's part"
    finally:
        producers.shutdown()
        consumers.shutdown()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("side", ["producer", "consumer"])
def test_rows_that_cannot_be_mapped_come_over_the_comm_and_only_they(plane, side):
    # The producer's worker cannot make shared-memory files, or the consumers cannot map
    # them (another PID namespace): each consumer receives its rows over TCP, as between hosts.
    client, pool = plane
    producers, consumers = groups(client, pool, [2, 2], Producer, Consumer)
    where = producers.workers if side == "producer" else consumers.workers
    client.run(no_shared_memory, side, workers=where)
    try:
        future = producers.make(seed())
        wait(list(future.futures))
        before = received(client, consumers.workers)
        out = consumers.summary(future)
        after = received(client, consumers.workers)
        assert [o["ids"] for o in out] == [list(range(ROWS // 2)), list(range(ROWS // 2, ROWS))]
        assert all(o["x_ok"] for o in out)
        share = batch_bytes(ROWS) / 2
        assert all(0.5 * share < after[a] - before[a] <= 1.25 * share for a in consumers.workers)
    finally:
        client.run(no_shared_memory, "undo", workers=where)
        producers.shutdown()
        consumers.shutdown()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("m", "n", "rows"), [(4, 2, 1024), (3, 2, 1022)])
def test_rows_spanning_parts_of_one_host_are_written_by_their_producers_into_the_consumers_file(
    plane, m, n, rows
):
    # A consumer reading rows of several parts on its host (dense tensors only) lays its
    # batch out in a file of its own and each producer writes its rows there: no socket
    # carries them, the rank gets them concatenated, and changing them in place reaches no
    # producer. The file comes back to the consumer's pool when the rank lets go of it.
    client, pool = plane
    producers, consumers = groups(client, pool, [m, n], Producer, Consumer)
    try:
        future = producers.make_dense(seed(rows))
        wait(list(future.futures))
        made = client.run(gathered_files, workers=consumers.workers)
        before = received(client, consumers.workers)
        ids = consumers.scribble(future)  # x negated in place on the consumers
        after = received(client, consumers.workers)
        between = client.run(gathered_files, workers=consumers.workers)
        assert [i for part in ids for i in part] == list(range(rows))  # 1022 rows on 3: parts cut unevenly
        share = rows * (COLS * 4 + 8 + 3) / n
        assert all(after[a] - before[a] < 0.05 * share for a in consumers.workers), (before, after, share)
        out = consumers.summary(future)  # the same rows again: as made, into the same files
        bounds = np.cumsum([0] + [rows // n + (r < rows % n) for r in range(n)])
        assert [o["ids"] for o in out] == [list(range(bounds[r], bounds[r + 1])) for r in range(n)]
        assert all(o["x_ok"] and o["mask_ok"] for o in out), "a consumer's in-place change reached a producer"
        assert all(o["meta"] == {"producer_world": m} for o in out)
        assert all(o["keys"] == ["id", "mask", "x"] and o["non_tensor"] == [] for o in out)
        now = client.run(gathered_files, workers=consumers.workers)
        assert all(between[a]["made"] >= 1 for a in consumers.workers), between  # the consumers' own files
        assert all(between[a]["made"] - made[a]["made"] <= 1 for a in consumers.workers), (made, between)
        assert all(now[a]["made"] == between[a]["made"] for a in consumers.workers), (between, now)  # reused
        picked = consumers.summary(future.select(batch_keys=["id", "x"]))
        assert [o["keys"] for o in picked] == [["id", "x"]] * n and all(o["x_ok"] for o in picked)
    finally:
        producers.shutdown()
        consumers.shutdown()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("shared_memory", [False, True], ids=["comm", "shared-memory"])
def test_consumers_of_a_finished_batch_get_its_part_infos_from_the_driver(plane, shared_memory):
    # A finished non-blocking call's reply carries its batch's PartInfo (rows, meta_info,
    # columns): the driver sends it with the consuming call, so no consuming rank asks the
    # producers for it (one round trip less before it can fetch its rows).
    client, pool = plane
    producers, consumers = groups(client, pool, [4, 2], Producer, Consumer)
    try:
        with dask.config.set({"daskwg.shared-memory": shared_memory}):
            future = producers.make(seed(1022))
            wait(list(future.futures))
            asked = client.run(count_part_info_asks, workers=producers.workers)
            out = consumers.summary(future)
            now = client.run(count_part_info_asks, workers=producers.workers)
        assert now == asked, (asked, now)
        assert [i for o in out for i in o["ids"]] == list(range(1022)) and all(o["x_ok"] for o in out)
        assert all(o["meta"] == {"producer_world": 4} for o in out)
    finally:
        producers.shutdown()
        consumers.shutdown()


@pytest.mark.timeout(300)
def test_rows_a_producer_cannot_write_into_the_consumers_file_come_the_usual_way(plane):
    client, pool = plane
    producers, consumers = groups(client, pool, [4, 2], Producer, Consumer)
    client.run(no_shared_memory, "producer", workers=producers.workers[1:2])
    try:
        future = producers.make_dense(seed())
        wait(list(future.futures))
        out = consumers.summary(future)
        assert [i for o in out for i in o["ids"]] == list(range(ROWS))
        assert all(o["x_ok"] and o["mask_ok"] for o in out)
    finally:
        client.run(no_shared_memory, "undo", workers=producers.workers[1:2])
        producers.shutdown()
        consumers.shutdown()


@pytest.mark.timeout(300)
def test_a_large_call_and_its_reply_cross_through_shared_memory_files_on_one_host(plane):
    """A DP_COMPUTE_PROTO call with a 16 MiB batch from the driver to ranks of its host, and
    its reply: the bytes go through shared-memory files (``daskwg.wire.memfiles``), not TCP; the
    ranks change their rows in place without touching the driver's batch; rows a rank keeps
    stay as they were while later calls come; once the ranks let go, the next call's
    files are the same ones again (on both sides)."""
    client, pool = plane
    (consumers,) = groups(client, pool, [2], Consumer)

    def batch(seed: int) -> DataProto:
        g = torch.Generator().manual_seed(seed)
        return DataProto.from_dict({"x": torch.rand(ROWS, COLS, generator=g), "id": torch.arange(ROWS)})

    def files_held() -> int:
        from daskwg.wire import memfiles

        return memfiles.send_files().nbytes

    try:
        first, second = batch(1), batch(2)
        x1, x2 = first.batch["x"].clone(), second.batch["x"].clone()
        sent, got = tcp_bytes_sent(), tcp_bytes_received()
        out = consumers.bump_and_keep(first)
        over_tcp = tcp_bytes_sent() - sent + tcp_bytes_received() - got
        assert over_tcp < ROWS * COLS * 4 // 16, over_tcp  # 8 MiB each way over TCP otherwise
        assert torch.equal(out.batch["x"], x1 + 1) and torch.equal(first.batch["x"], x1)
        assert torch.equal(out.batch["id"], torch.arange(ROWS))
        out2 = consumers.bump_and_keep(second)  # the ranks still hold the first call's rows
        assert torch.equal(out2.batch["x"], x2 + 1) and torch.equal(out.batch["x"], x1 + 1)
        half = ROWS // 2
        expected = [[float((x[r * half : (r + 1) * half] + 1).sum()) for x in (x1, x2)] for r in range(2)]
        assert consumers.kept() == [pytest.approx(e, rel=1e-5) for e in expected]
        del out, out2
        gc.collect()
        consumers.bump_and_keep(batch(3))
        consumers.kept()
        driver, ranks = files_held(), client.run(files_held, workers=consumers.workers)
        for seed in (4, 5):
            x = batch(seed)
            assert torch.equal(consumers.bump_and_keep(x).batch["x"], x.batch["x"] + 1)
            consumers.kept()
        assert files_held() == driver
        assert client.run(files_held, workers=consumers.workers) == ranks
    finally:
        consumers.shutdown()


def _j(n: int) -> DataProto:
    return DataProto.from_dict({"j": torch.arange(n) * 10})


# Found by trying it: 6 rows of a future and 4 of another in one call on 2 ranks were cut
# on their own and paired by position (3 + 2 rows per rank, no error); 7 rows of a future
# beside 8 of a DataProto were both padded to 9 and paired. Two DataProtos of 6 and 4 rows
# raise DispatchError in the driver, as verl asserts: so do futures, once their producers replied.
_UNEQUAL = {
    "future-future": (
        lambda f6, f4: ((f6, f4.rename("id", "j")), {}),
        "positional argument 1 \\(a DataProtoFuture\\): 4",
    ),
    "future-batch": (lambda f6, f4: ((f6, _j(4)), {}), "positional argument 1: 4"),
    "batch-future-keywords": (
        lambda f6, f4: ((), {"data": seed(4, 4), "other": f6.rename("id", "j")}),
        "argument 'other' \\(a DataProtoFuture\\): 6",
    ),
    "future-longer-batch": (lambda f6, f4: ((f4, _j(6)), {}), "positional argument 1: 6"),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "non-blocking"])
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("case", list(_UNEQUAL))
def test_batches_of_different_lengths_are_refused_in_the_driver_once_their_producers_replied(
    plane, case, n, blocking
):
    client, pool = plane
    producers, consumers = groups(client, pool, [2, n], Producer, Consumer)
    try:
        f6, f4 = producers.make(seed(6, 4)), producers.make(seed(4, 4))
        wait([*f6.futures, *f4.futures])
        args, kwargs = _UNEQUAL[case][0](f6, f4)
        call = consumers.pair if blocking else consumers.zip_async
        with pytest.raises(DispatchError, match=_UNEQUAL[case][1]):
            call(*args, **kwargs)
        pairs = consumers.pair(f6, f6.rename("id", "j"))  # equal lengths still pair row by row
        assert [p for rank in pairs for p in rank] == [(i, i) for i in range(6)]
    finally:
        producers.shutdown()
        consumers.shutdown()


def _gated(n: int, gate) -> DataProto:
    return DataProto.from_dict({"id": torch.arange(n)}, meta_info={"gate": str(gate)})


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("beside", ["future", "batch", "finished-future"])
def test_batches_of_different_lengths_are_refused_by_the_ranks_while_a_producer_runs(
    plane, tmp_path, beside, n
):
    # The driver does not know the running producer's rows: each consuming rank compares the
    # arguments' lengths from the parts' PartInfo before it fetches a row, and the error names
    # the arguments and their rows, not the producer (which did nothing wrong).
    client, pool = plane
    producers, consumers = groups(client, pool, [2, n], Producer, Consumer)
    try:
        other = {"batch": lambda: _j(4), "future": lambda: producers.make_gated(_gated(4, tmp_path / "gate"))}
        if beside == "finished-future":
            done = producers.make(seed(4, 4))
            wait(list(done.futures))
            other["finished-future"] = lambda: done
        running = producers.make_gated(_gated(6, tmp_path / "gate"))
        beside_it = other[beside]()
        if isinstance(beside_it, DataProtoFuture):
            beside_it = beside_it.rename("id", "j")
        out = consumers.zip_async(running, other=beside_it)
        (tmp_path / "gate").touch()
        with pytest.raises(RankError) as caught:
            out.get()
        assert isinstance(caught.value.exception, DispatchError)
        assert "positional argument 0 (a DataProtoFuture): 6" in caught.value.message
        assert re.search(r"argument 'other'( \(a DataProtoFuture\))?: 4\b", caught.value.message)
        assert caught.value.method == "zip_async" and "make_gated" not in str(caught.value).split("---")[0]
    finally:
        producers.shutdown()
        consumers.shutdown()


@pytest.mark.timeout(300)
def test_futures_of_one_length_from_running_producers_pair_row_by_row(plane, tmp_path):
    client, pool = plane
    producers, consumers = groups(client, pool, [2, 3], Producer, Consumer)
    try:
        a = producers.make_gated(_gated(5, tmp_path / "gate"))
        b = producers.make_gated(_gated(5, tmp_path / "gate")).rename("id", "j")
        out = consumers.zip_async(a, b)
        (tmp_path / "gate").touch()
        got = out.get()
        assert got.batch["id"].tolist() == got.batch["j"].tolist() == [0, 1, 2, 3, 4]
    finally:
        producers.shutdown()
        consumers.shutdown()


# Found by trying it: ``for mb in fut.chunk(k): wg.update(mb)`` on an 8-row future in 2 parts
# worked for k=2 only; k=3, 4 raised "this DataProtoFuture is already a piece of a chunk()".
@pytest.mark.timeout(600)
@pytest.mark.parametrize("n", [2, 3])
def test_micro_batches_of_a_future_feed_a_group_as_the_same_rows_in_the_driver_do(plane, n):
    client, pool = plane
    producers, consumers = groups(client, pool, [2, n], Producer, Consumer)
    try:
        future = producers.make(seed(8, 4))
        whole = future.get()
        for k in (2, 3, 4, 5, 8):
            for mb, rows in zip(future.chunk(k), whole.chunk(k)):
                assert [o["ids"] for o in consumers.summary(mb)] == [
                    o["ids"] for o in consumers.summary(rows)
                ]
                assert consumers.ids(mb).batch["id"].tolist() == rows.batch["id"].tolist()
                assert consumers.ids_async(mb).get().batch["id"].tolist() == rows.batch["id"].tolist()
        inner = future.chunk(2)[1].chunk(3)[0]  # a micro-batch of a micro-batch: rows 4 and 5 of 0..7
        assert consumers.ids(inner).batch["id"].tolist() == [4, 5]
        pairs = consumers.pair(future.chunk(4)[1], _j(2))
        assert [p for rank in pairs for p in rank][:2] == [(2, 0), (3, 10)]
        with pytest.raises(DispatchError, match="positional argument 1: 3"):
            consumers.pair(future.chunk(4)[1], _j(3))
    finally:
        producers.shutdown()
        consumers.shutdown()


@pytest.mark.timeout(300)
def test_a_future_is_cut_into_no_more_pieces_than_rows_as_a_data_proto_is(plane, tmp_path):
    client, pool = plane
    (producers,) = groups(client, pool, [2], Producer)
    try:
        future = producers.make(seed(8, 4))
        wait(list(future.futures))
        with pytest.raises(ValueError, match="cannot split 8 rows into 9 non-empty chunks"):
            future.chunk(9)  # its rows are known: refused at once
        running = producers.make_gated(_gated(8, tmp_path / "gate"))
        pieces = running.chunk(9)  # not known yet: refused where the piece is materialised
        (tmp_path / "gate").touch()
        with pytest.raises(ValueError, match="cannot split 8 rows into 9"):
            pieces[0].get()
        with pytest.raises(TypeError, match="chunks must be an int"):
            future.chunk(2.0)
    finally:
        producers.shutdown()


@pytest.mark.timeout(600)
def test_a_future_shorter_than_the_consuming_group_is_padded_as_the_same_rows_in_the_driver(plane):
    client, pool = plane
    producers, consumers = groups(client, pool, [2, 3], Producer, Consumer)
    try:
        future = producers.make(seed(2, 4))  # 2 rows, one per producing rank
        in_driver = future.get()
        # Every consuming rank gets the rows the driver's padding gives it: 2 rows padded to 3.
        assert [o["ids"] for o in consumers.summary(future)] == [[0], [1], [0]]
        assert [o["ids"] for o in consumers.summary(in_driver)] == [[0], [1], [0]]
        # The padding row is taken off the output on both paths, blocking or not.
        assert consumers.ids(future).batch["id"].tolist() == [0, 1]
        assert consumers.ids(in_driver).batch["id"].tolist() == [0, 1]
        later = consumers.ids_async(future)
        assert later.get().batch["id"].tolist() == [0, 1]
        assert producers.echo(later).batch["id"].tolist() == [0, 1]  # and its parts feed the next call
    finally:
        producers.shutdown()
        consumers.shutdown()


@pytest.mark.timeout(300)
def test_futures_fed_to_calls_while_another_thread_makes_and_drops_results(plane):
    # verl's one-step off-policy shape (examples/grpo.py --async): one thread's calls take
    # futures while results are made, finish and are dropped by another thread's calls.
    # The driver's shared records were iterated while the client's loop or the other
    # thread changed them: "RuntimeError: dictionary changed size during iteration"
    # (the result records, planning relays) and "Set changed size during iteration"
    # (the futures in flight per worker, checking its queue's room).
    client, pool = plane
    producers, consumers = groups(client, pool, [2, 2], Producer, Consumer)
    errors: list[BaseException] = []
    stop = threading.Event()

    def churn():
        held = []
        try:
            while not stop.is_set():
                held.append(producers.make(seed(4, 2)))
                if len(held) > 300:
                    del held[:100]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        for i in range(30):
            out = consumers.summary(producers.make(seed(8, 2)))
            assert [o["ids"] for o in out] == [[0, 1, 2, 3], [4, 5, 6, 7]], i
    finally:
        stop.set()
        thread.join(60)
        producers.shutdown()
        consumers.shutdown()
    assert not errors, errors


# --------------------------------------------------------------------- lazy algebra


@pytest.mark.timeout(600)
def test_union_select_chain_moves_almost_nothing_through_the_driver(plane):
    client, pool = plane
    producers, consumers = groups(client, pool, [2, 2], Producer, Consumer)
    try:
        before = tcp_bytes_received()
        consumers_before = received(client, consumers.workers)
        fa = producers.make(seed())
        fb = producers.derive(fa)
        out = consumers.summary(fa.union(fb).select(batch_keys=["x", "y", "id"]))
        driver = tcp_bytes_received() - before
        consumers_after = received(client, consumers.workers)

        assert driver < batch_bytes(ROWS) / 16, driver  # the issue: < 4 MiB of 64 MiB
        assert [o["keys"] for o in out] == [["id", "x", "y"]] * 2
        assert [o["ids"] for o in out] == [list(range(512)), list(range(512, 1024))]
        assert [o["y"] for o in out] == [[10 * i for i in o["ids"]] for o in out]
        assert all(o["x_ok"] for o in out)
        # "noise" was not selected, so no consumer fetched it: about half the batch each.
        x_share = ROWS * (COLS * 4 + 16) / 2
        for address in consumers.workers:
            assert consumers_after[address] - consumers_before[address] <= 1.25 * x_share
    finally:
        producers.shutdown()
        consumers.shutdown()


@pytest.mark.timeout(600)
def test_repeat_interleaves_rows_in_the_driver_and_on_the_ranks(plane):
    client, pool = plane
    producers, consumers = groups(client, pool, [2, 4], Producer, Consumer)
    try:
        future = producers.make(seed(8, 4))
        assert future.repeat(2, interleave=True).get().batch["id"].tolist() == [
            0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7,
        ]  # fmt: skip
        out = consumers.ids(future.repeat(3, interleave=False))
        assert out.batch["id"].tolist() == list(range(8)) * 3
    finally:
        producers.shutdown()
        consumers.shutdown()


@pytest.mark.timeout(600)
def test_union_and_rename_with_a_driver_data_proto_on_the_ranks(plane):
    client, pool = plane
    producers, consumers = groups(client, pool, [2, 2], Producer, Consumer)
    try:
        future = producers.make(seed(6, 4))
        extra = DataProto.from_dict({"z": torch.arange(6) + 100})
        lazy = future.union(extra).rename("z", "y").select(batch_keys=["id", "y"])
        out = consumers.summary(lazy)
        assert [o["y"] for o in out] == [[100, 101, 102], [103, 104, 105]]
        assert lazy.get().batch["y"].tolist() == [100, 101, 102, 103, 104, 105]
    finally:
        producers.shutdown()
        consumers.shutdown()


@pytest.mark.timeout(600)
def test_a_failed_producer_fails_the_consuming_call_and_later_calls_still_run(plane):
    client, pool = plane
    producers, consumers = groups(client, pool, [2, 4], Producer, Consumer)
    try:
        with pytest.raises(RankError, match="rank 0 cannot make its rows"):
            consumers.summary(producers.make_or_fail(seed(8, 4)).select(batch_keys=["id"]))
        out = consumers.summary(producers.make(seed(8, 4)))
        assert [o["ids"] for o in out] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    finally:
        producers.shutdown()
        consumers.shutdown()


def _failing_chain(shape: str, producers: WorkerGroup, consumers: WorkerGroup) -> None:
    made = producers.make(seed(8, 1 << 16))  # 4 MiB of x and noise
    if shape == "union":  # the input
        consumers.summary(made.union(producers.make_or_fail(seed(8, 4))))
    elif shape == "second-argument":
        consumers.pair(made, producers.make_or_fail(seed(8, 4)))
    elif shape == "non-blocking":
        consumers.ids_async(made.union(producers.make_or_fail(seed(8, 4)))).get()
    elif shape == "consumer-fails":
        consumers.pair(made, made)  # no "j": the consuming rank raises KeyError


def _keys_held(client: Client, group: str) -> tuple[list, dict]:
    futures = [k for k in client.futures if group in str(k)]
    data = client.run(lambda dask_worker: sum(group in str(k) for k in dask_worker.data))
    return futures, {w: n for w, n in data.items() if n}


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("shape", "chains"), [("union", 15), ("second-argument", 3), ("non-blocking", 3), ("consumer-fails", 3)]
)
def test_failed_chains_whose_errors_were_dropped_leave_nothing_on_the_cluster(plane, shape, chains):
    client, pool = plane
    producers, consumers = groups(client, pool, [2, 2], Producer, Consumer)
    try:
        for _ in range(chains):
            with pytest.raises(RankError):
                _failing_chain(shape, producers, consumers)
        gc.collect()
        # Releases travel to the scheduler and the workers asynchronously.
        for _ in range(300):
            held = _keys_held(client, producers.name)
            if held == ([], {}):
                break
            threading.Event().wait(0.1)
        assert held == ([], {})
    finally:
        producers.shutdown()
        consumers.shutdown()


def test_lazy_algebra_checks_its_arguments_in_the_driver():
    future = DataProtoFuture(futures=["part-0"])
    with pytest.raises(TypeError, match="union takes a DataProtoFuture or a DataProto"):
        future.union({"x": 1})
    with pytest.raises(ValueError, match="repeat_times must be a positive int"):
        future.repeat(0)
    with pytest.raises(ValueError, match="old_keys has 2 keys but new_keys has 1"):
        future.rename(["a", "b"], ["c"])
    with pytest.raises(ValueError, match="apply select before chunk"):
        future.chunk(2)[0].select(["a"])


def test_union_of_different_lengths_fails_when_materialised():
    parts = {"a": DataProto.from_dict({"x": torch.zeros(3)}), "b": DataProto.from_dict({"y": torch.zeros(4)})}
    gather = lambda keys: [parts[k] for k in keys]  # noqa: E731
    left = DataProtoFuture(futures=["a"], gather=gather)
    right = DataProtoFuture(futures=["b"], gather=gather)
    with pytest.raises(ValueError, match="cannot union DataProtos of 3 and 4 rows"):
        left.union(right).get()


# --------------------------------------------------------------------- driver-fed calls


@pytest.mark.timeout(600)
def test_non_blocking_call_from_the_driver_keeps_the_batch_off_the_scheduler(plane):
    client, pool = plane
    (producers,) = groups(client, pool, [2], Producer)
    try:
        data = DataProto.from_dict({"x": torch.ones(1024, 8192)})  # 32 MiB, as in the issue
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            future = producers.echo_async(data)
            held = client.run_on_scheduler(_task_spec_bytes)
        assert not [w for w in caught if "large graph" in str(w.message)]
        assert held < MiB, held
        assert torch.equal(future.get().batch["x"], data.batch["x"])
        # The results stay on the ranks' workers; the scheduler learns their keys (never
        # their bytes) once something waits on them through Dask.
        wait(future.futures, timeout=60)
        assert min(client.nbytes(summary=False)[f.key] for f in future.futures) >= 16 * MiB
    finally:
        producers.shutdown()


@pytest.mark.timeout(600)
def test_non_blocking_calls_work_when_the_scheduler_cannot_import_torch(tmp_path):
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('no torch on this scheduler')\n")
    cluster = CLICluster(2, scheduler_path=str(tmp_path))
    try:
        with Client(cluster.address, timeout=120) as client:
            wait_for_workers(client, 2)
            with pytest.raises(Exception, match="no torch on this scheduler"):
                client.run_on_scheduler(_import_torch)
            with WorkerGroup(client, Producer, world_size=2) as producers:
                data = DataProto.from_dict(
                    {"x": torch.arange(8 * 4096, dtype=torch.float32).reshape(8, 4096)}
                )
                future = producers.echo_async(data)  # 128 KiB: sent straight to the workers
                assert torch.equal(future.get().batch["x"], data.batch["x"])
                small = producers.echo_async(DataProto.from_dict({"x": torch.ones(4, 2)}))
                assert producers.echo(small).batch["x"].tolist() == [[1.0, 1.0]] * 4
                assert producers.make(seed(6, 4)).repeat(2).get().batch["id"].tolist() == [
                    0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5,
                ]  # fmt: skip
    finally:
        cluster.close()


def _import_torch(dask_scheduler) -> None:
    import torch  # noqa: F401


def _task_spec_bytes(dask_scheduler) -> int:
    return sum(len(pickle.dumps(ts.run_spec)) for ts in dask_scheduler.tasks.values() if ts.run_spec)


# --------------------------------------------------------------------- results and views


@pytest.mark.timeout(600)
def test_a_result_is_its_value_when_the_method_returned(plane):
    client, pool = plane
    (group,) = groups(client, pool, [4], Stateful)
    try:
        futures = group.weights_async()
        group.step()
        assert [r["w"].tolist() for r in client.gather(futures)] == [[0.0] * 4] * 4
        assert [r["w"].tolist() for r in group.weights()] == [[1.0] * 4] * 4
    finally:
        group.shutdown()


@pytest.mark.timeout(60)
def test_a_consumers_files_of_gathered_rows_are_reused_and_their_number_bounded(monkeypatch):
    # In this process, as on a consuming worker: the "producers" write their rows into the
    # file through /proc/<pid>/fd as daskwg_write_rows does.
    from tensordict import TensorDict

    from daskwg.plugin import gathered

    columns = (("x", "float32", (256,), None), ("m", "bool", (), None))
    requests = [(0, 0, 1000, None), (1, 24, 1024, None)]  # 2 MB of rows from two parts

    def write(asks):
        for part, start, stop, target in asks:
            n = 1024
            made = {"x": torch.arange(n, dtype=torch.float32)[:, None].expand(-1, 256) + 10_000 * part}
            made["m"] = torch.arange(n) % 2 == part
            gathered._write_rows(
                TensorDict({k: v.contiguous() for k, v in made.items()}, [n]), start, stop, target
            )
        return [{"status": "OK"}] * len(asks)

    def check(data):
        x, m = data.batch["x"], data.batch["m"]
        assert x.shape == (2000, 256) and m.shape == (2000,) and not data.non_tensor_batch
        assert torch.equal(x[:1000, 0], torch.arange(1000.0)) and torch.equal(
            x[1000:, 7], torch.arange(24.0, 1024) + 10_000
        )
        assert torch.equal(m[:1000], torch.arange(1000) % 2 == 0) and torch.equal(
            m[1000:], torch.arange(24, 1024) % 2 == 1
        )

    first = gathered.gather(requests, columns, write)
    check(first)
    made = gathered.counts()["made"]
    del first
    gc.collect()
    second = gathered.gather(requests, columns, write)  # the first one's file, given back
    check(second)
    assert gathered.counts()["made"] == made
    monkeypatch.setattr(gathered, "_max_open", lambda: gathered.counts()["open"])
    assert gathered.gather(requests, columns, write) is None  # no file past the limit: the usual way
    del second
    gc.collect()
    check(gathered.gather(requests, columns, write))
    assert (
        gathered.columns_of(
            DataProto.from_dict(
                {"x": torch.zeros(2, 3)}, non_tensors={"t": np.array(["a", "b"], dtype=object)}
            )
        )
        is None
    )


def test_snapshot_copies_only_tensors_something_else_can_change():
    kept = torch.zeros(1 << 16)

    def fresh():
        return {"a": torch.ones(1 << 16)}

    result = fresh()
    packed = serialization.snapshot(result)
    assert _shares_memory(packed, result["a"])  # nothing else refers to it: no copy

    result = {"a": kept}
    packed = serialization.snapshot(result)
    kept.add_(1)
    assert not _shares_memory(packed, kept)
    assert serialization.loads(packed)["a"].sum().item() == 0

    result = [kept[:16]]
    packed = serialization.snapshot(result)
    kept.add_(1)
    assert serialization.loads(packed)[0].tolist() == [1.0] * 16


def test_tensors_with_autograd_conjugate_or_negative_bits_travel_as_their_values():
    """codec.reduce_tensor makes only the torch calls a tensor needs: a leaf that requires
    grad, a lazily conjugated and a lazily negated view still travel as their values."""
    leaf = torch.arange(4.0, requires_grad=True)
    z = torch.tensor([1 + 2j, 3 - 4j])
    values = {"leaf": leaf, "conj": z.conj(), "neg": torch.ops.aten._neg_view(z), "plain": torch.arange(3)}
    assert values["conj"].is_conj() and values["neg"].is_neg()
    for packed in (serialization.dumps(values), serialization.snapshot(dict(values))):
        back = serialization.loads(packed)
        assert back["leaf"].requires_grad and back["leaf"].tolist() == [0.0, 1.0, 2.0, 3.0]
        assert back["conj"].tolist() == [1 - 2j, 3 + 4j] and not back["conj"].is_conj()
        assert back["neg"].tolist() == [-1 - 2j, -3 + 4j] and not back["neg"].is_neg()
        assert back["plain"].tolist() == [0, 1, 2]


def test_objects_of_a_module_registered_by_value_travel_by_value():
    """``cloudpickle.register_pickle_by_value(module)``: workers that cannot import the
    module (a script's helper module) still load its objects."""
    module = types.ModuleType("daskwg_by_value_probe")
    exec("class Point:\n    def __init__(self, x):\n        self.x = x\n", module.__dict__)
    sys.modules[module.__name__] = module
    cloudpickle.register_pickle_by_value(module)
    try:
        packed = serialization.dumps(module.Point(3))
    finally:
        cloudpickle.unregister_pickle_by_value(module)
        del sys.modules[module.__name__]
    assert serialization.loads(packed).x == 3  # loads without the module


def test_a_method_returning_its_received_argument_costs_no_copy():
    received = serialization.loads(
        serialization.dumps(((DataProto.from_dict({"a": torch.zeros(1024)}),), {}))
    )
    args, kwargs = received

    def host(payload):
        args, kwargs = payload
        result = _add_one(*args, **kwargs)
        return serialization.snapshot(result, arguments=(args, kwargs))

    packed = host(received)
    assert _shares_memory(packed, args[0].batch["a"])
    assert serialization.loads(packed).batch["a"].tolist() == [1.0] * 1024


def _add_one(data: DataProto) -> DataProto:
    data.batch["a"] += 1
    return data


def _shares_memory(packed, tensor) -> bool:
    return any(np.frombuffer(b, np.uint8).ctypes.data == tensor.data_ptr() for b in packed.buffers)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("blocking", [True, False])
def test_a_returned_view_carries_only_its_own_bytes(plane, blocking):
    client, pool = plane
    (group,) = groups(client, pool, [2], ClassWithInitArgsOf(Stateful, big_elements=16 * MiB))
    try:
        before = tcp_bytes_received()
        out = group.head(16) if blocking else client.gather(group.head_async(16))
        assert tcp_bytes_received() - before < 256 * 1024
        assert [t.tolist() for t in out] == [list(map(float, range(16)))] * 2
    finally:
        group.shutdown()


def ClassWithInitArgsOf(cls, **kwargs):
    from daskwg import ClassWithInitArgs

    return ClassWithInitArgs(cls, **kwargs)


def _views():
    storage = torch.arange(MiB, dtype=torch.float32)  # 4 MiB
    view = storage[:1024]  # 4 KiB
    return {
        "keyword": ((), {"value": view}),
        "positional": ((view,), {}),
        "nested": (([{"a": (1, [view])}],), {}),
        "meta_info": ((DataProto(meta_info={"t": view}),), {}),
        "object array": ((DataProto.from_dict(non_tensors={"o": np.array([view, None], dtype=object)}),), {}),
    }


@pytest.mark.timeout(600)
@pytest.mark.parametrize("blocking", [True, False])
@pytest.mark.parametrize("where", list(_views()))
def test_an_argument_view_carries_only_its_own_bytes(plane, where, blocking):
    client, pool = plane
    (group,) = groups(client, pool, [1], Stateful)
    try:
        args, kwargs = _views()[where]
        before = received(client, group.workers)[group.workers[0]]
        call = group.same if blocking else group.same_async
        out = call(*args, **kwargs)
        if not blocking:
            out = client.gather(out)
        got = received(client, group.workers)[group.workers[0]] - before
        assert got < 256 * 1024, got  # the view is 4 KiB, its storage 4 MiB
        assert out[0] is not None
    finally:
        group.shutdown()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("blocking", [True, False])
def test_sparse_tensors_of_any_size_travel(plane, blocking):
    client, pool = plane
    (group,) = groups(client, pool, [1], Stateful)
    try:
        generator = torch.Generator().manual_seed(0)
        indices = torch.randint(0, 4096, (2, 200_000), generator=generator)
        sparse = torch.sparse_coo_tensor(indices, torch.ones(200_000), (4096, 4096))  # about 4 MiB
        out = group.same(sparse) if blocking else client.gather(group.same_async(sparse))
        assert torch.equal(out[0].to_dense(), sparse.to_dense())
        csr = sparse.coalesce().to_sparse_csr()
        assert torch.equal(group.same(csr)[0].to_dense(), csr.to_dense())
    finally:
        group.shutdown()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("blocking", [True, False])
def test_expanded_and_channels_last_tensors_keep_their_strides_and_travel_as_their_memory(plane, blocking):
    client, pool = plane
    (group,) = groups(client, pool, [1], Stateful)
    try:
        expanded = torch.zeros(1, 64).expand(1_000_000, 64)  # 256 MB if materialised
        # What daskwg's call streams brought the driver, over every transport (the kernel's
        # TCP count would also see Dask's own traffic of the moment: heartbeats, other tests').
        before = sum(received_bytes().values())
        (out,) = group.same(expanded) if blocking else client.gather(group.same_async(expanded))
        got = sum(received_bytes().values()) - before
        print(
            f"\n[codec] an expand()-ed 1,000,000 x 64 float tensor there and back: {got} bytes to the driver"
        )
        assert got < 64 * 1024, got
        assert out.shape == (1_000_000, 64) and out.stride() == (0, 1) and torch.equal(out[-1], expanded[-1])
        channels_last = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
        (out,) = group.same(channels_last) if blocking else client.gather(group.same_async(channels_last))
        assert out.is_contiguous(memory_format=torch.channels_last) and out.stride() == channels_last.stride()
        assert torch.equal(out, channels_last)
        transposed = torch.arange(12.0).reshape(3, 4).t()
        (out,) = group.same(transposed) if blocking else client.gather(group.same_async(transposed))
        assert out.stride() == (1, 4) and torch.equal(out, transposed)
    finally:
        group.shutdown()


def test_a_strided_slice_still_travels_as_its_own_elements_only():
    big = torch.arange(1 << 20, dtype=torch.float32)
    every_other = big[::2]  # reaches all of big's storage: copied to its own 2 MiB
    packed = serialization.dumps(every_other)
    assert packed.nbytes < (1 << 21) + 1024
    assert torch.equal(serialization.loads(packed), every_other)


def test_dask_sizeof_sees_the_bytes_of_data_protos_and_tensordicts():
    data = DataProto.from_dict({"x": torch.zeros(4, MiB // 4)}, non_tensors={"s": np.arange(4)})
    assert sizeof(data) >= 4 * MiB
    assert sizeof(data.batch) >= 4 * MiB
    assert sizeof(torch.zeros(MiB)[:16]) == 64
