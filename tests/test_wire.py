"""The wire's records (``daskwg.wire.messages``): each message and reply as a plain tuple
on a call stream (``to_wire``) and back (``from_wire``); and the comm handlers a worker's
host plugin installs, all named by ``Handler``."""

from __future__ import annotations

import pytest
from workers import AddWorker

from daskwg import WorkerGroup
from daskwg.wire.messages import (
    HANDLERS,
    Call,
    CallMessage,
    FetchMessage,
    FreeMessage,
    PlanMessage,
    Reply,
)

pytestmark = pytest.mark.timeout(120)

CALL = Call("client-1", 7, "gid", "actor", 1, "generate", "client-1", "worker-1", "control")


def test_a_call_reads_back_from_its_fields():
    assert Call.from_wire(CALL.to_wire()) == CALL


def test_a_call_message_is_a_tuple_of_plain_fields_on_the_wire():
    message = CallMessage(CALL, b"header", "key-1", 1024, 3.0, b"refs").to_wire()
    assert message == ("call", 0, CALL.to_wire(), b"header", "key-1", 1024, 3.0, b"refs")


def test_a_call_message_reads_back_with_the_id_its_stream_gave_it():
    wire = CallMessage(CALL, b"header", None, 0, 10.0, None).to_wire()
    on_stream = (wire[0], 42, *wire[2:])  # what CallStreams writes
    assert CallMessage.from_wire(on_stream) == CallMessage(CALL, b"header", None, 0, 10.0, None, cid=42)


def test_a_plan_message_reads_back():
    entries = [(CALL.to_wire(), "key-1", "keep", 1, True)]
    message = PlanMessage(entries, b"header", 512, cid=3)
    assert message.to_wire() == ("plan", 3, entries, b"header", 512)
    assert PlanMessage.from_wire(message.to_wire()) == message


def test_a_fetch_message_reads_back():
    message = FetchMessage("key-1", "client-1", 7, "actor.generate", cid=5)
    assert message.to_wire() == ("fetch", 5, "key-1", "client-1", 7, "actor.generate")
    assert FetchMessage.from_wire(message.to_wire()) == message


def test_a_free_message_carries_the_keys():
    assert FreeMessage(["a", "b"]).to_wire() == ("free", 0, ["a", "b"])
    assert FreeMessage.from_wire(("free", 0, ("a", "b"))).keys == ["a", "b"]


def test_a_reply_reads_back():
    reply = Reply(9, "OK", 128, None, b"header", b"info")
    assert reply.to_wire() == ("reply", 9, "OK", 128, None, b"header", b"info")
    assert Reply.from_wire(reply.to_wire()) == reply


def test_the_records_are_frozen():
    reply = Reply(9, "OK")
    with pytest.raises(AttributeError):
        reply.status = "error"


def test_every_handler_the_host_plugin_installs_is_a_named_handler(client4):
    with WorkerGroup(client4, AddWorker, world_size=1):
        installed = client4.run(lambda dask_worker: sorted(k for k in dask_worker.handlers if "daskwg" in k))
    for names in installed.values():
        assert set(names) == set(HANDLERS)
