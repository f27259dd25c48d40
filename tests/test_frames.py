"""Call-stream frames (``daskwg.wire.frames.FrameStream``) on real Dask TCP comms, in this process:
messages of every shape arrive whole and in order, and reading them keeps the socket
registered with the event loop from one message to the next."""

from __future__ import annotations

import asyncio
import uuid

import numpy as np
import pytest
from distributed.comm import connect, listen

from daskwg.wire import frames, local_link, memfiles
from daskwg.wire.frames import FrameStream

pytestmark = pytest.mark.timeout(60)


async def _pair(link: str = "tcp"):
    """A connected (writer, reader) pair of FrameStreams over loopback TCP (``link="unix"``:
    over a Unix-domain socket, as call streams between processes of one host are), and a
    function that closes both and the listener."""
    if link == "unix":
        return await _unix_pair()
    accepted: asyncio.Queue = asyncio.Queue()
    done = asyncio.Event()

    async def handle(comm):
        await accepted.put(comm)
        await done.wait()  # the listener closes a comm whose handler returned

    listener = listen("tcp://127.0.0.1:0", handle)
    await listener.start()
    comm = await connect(listener.contact_address)
    other = await asyncio.wait_for(accepted.get(), 10)

    async def close():
        await comm.close()
        await other.close()
        done.set()
        listener.stop()

    return close, FrameStream(comm), FrameStream(other)


async def _unix_pair():
    accepted: asyncio.Queue = asyncio.Queue()
    done = asyncio.Event()

    async def serve(comm, files):
        assert files == {"probe": 1}  # what the opening carried
        await accepted.put(comm)
        await done.wait()  # the listener closes a comm whose handler returned

    server_id = f"test-frames-{uuid.uuid4()}"
    stop = local_link.listen(server_id, serve)
    comm = await local_link.connect("tcp://127.0.0.1:1", server_id)
    assert local_link.is_local(comm)
    await comm.write({"op": "daskwg_stream", "reply": False, "files": {"probe": 1}})
    other = await asyncio.wait_for(accepted.get(), 10)
    assert local_link.is_local(other)

    async def close():
        await comm.close()
        done.set()
        stop()

    return close, FrameStream(comm), FrameStream(other)


def _messages():
    """Messages around every size the reader treats apart: no buffers, small buffers that
    share one allocation, exactly and just over that size, an empty buffer among large ones,
    a pickle larger than the read buffer, and many in a row."""
    rng = np.random.default_rng(0)
    small, read = frames._SMALL, frames._READ_BUFFER

    def b(n):
        return rng.integers(0, 256, n, dtype=np.uint8).tobytes()

    out = [
        (("call", 0, "no buffers"), []),
        (("call", 1, "small"), [b(10), b(0), b(300)]),
        (("call", 2, "exactly small"), [b(small)]),
        (("call", 3, "just over"), [b(small + 1)]),
        (("call", 4, "large and empty"), [b(3 * read), b(0), b(5)]),
        (("call", 5, "big pickle", b(2 * read + 7)), []),
        (("call", 6, "big pickle and buffers", b(read)), [b(7), b(read + 3)]),
    ]
    out += [(("call", 7 + i, "tiny", b(i % 50)), [b(i % 9)]) for i in range(200)]
    return out


@pytest.mark.parametrize("link", ["tcp", "unix"])
def test_messages_of_every_size_arrive_whole_and_in_order(link):
    async def main():
        close, writer, reader = await _pair(link)
        sent = _messages()

        async def write_all():
            for message, buffers in sent:
                await writer.write(message, buffers)

        writing = asyncio.ensure_future(write_all())
        for message, buffers in sent:
            got, got_buffers = await asyncio.wait_for(reader.read(), 10)
            assert got == message
            assert [bytes(g) for g in got_buffers] == buffers, message[:3]
            assert all(g.flags.writeable for g in got_buffers)
        await writing
        await close()

    asyncio.run(main())


@pytest.mark.parametrize("link", ["tcp", "unix"])
def test_reading_a_stream_of_small_messages_keeps_its_socket_registered(link):
    # tornado unregisters a socket whose read left bytes in its own buffer and registers it
    # again at the next read: two epoll_ctl calls per message, a fifth of a small call's
    # driver time here. The reader must keep it registered between messages.
    async def main():
        close, writer, reader = await _pair(link)
        loop = asyncio.get_running_loop()
        calls = {"add_reader": 0, "remove_reader": 0}
        for name in calls:
            original = getattr(loop, name)

            def counted(*args, _original=original, _name=name):
                calls[_name] += 1
                return _original(*args)

            setattr(loop, name, counted)
        n = 300
        for i in range(n):
            # One reply at a time, each coming while its reader waits, as a caller's do.
            reading = asyncio.ensure_future(reader.read())
            await asyncio.sleep(0)
            await writer.write(("reply", i, "OK", None, None, b"x" * 40), [b"y" * 64])
            message, _ = await asyncio.wait_for(reading, 10)
            assert message[1] == i
        await close()
        assert calls["add_reader"] + calls["remove_reader"] < n // 10, calls

    asyncio.run(main())


@pytest.mark.parametrize("link", ["tcp", "unix"])
def test_writes_from_other_threads_and_the_loop_arrive_whole_and_each_writers_in_order(link):
    """``write_now`` from two threads while the loop writes large messages of its own: every
    message arrives whole, each thread's direct writes keep their order, and writes the
    socket could not take at once (the reader paused, the buffers full) go out later."""
    import threading

    async def main():
        close, writer, reader = await _pair(link)
        loop = asyncio.get_running_loop()
        rng = np.random.default_rng(1)
        big = rng.integers(0, 256, 3 * frames._READ_BUFFER, dtype=np.uint8).tobytes()
        chunk = rng.integers(0, 256, frames._SMALL - 64, dtype=np.uint8).tobytes()
        direct: dict[str, list[int]] = {"a": [], "b": []}
        expected = {}

        def thread_writes(name: str) -> None:
            for i in range(150):
                message = ("call", 0, name, i)
                buffers = [chunk[: (i * 997) % len(chunk)]]
                expected[(name, i)] = buffers[0]
                if writer.write_now(message, buffers):
                    direct[name].append(i)
                else:  # the loop was writing: through it, as a call stream does then
                    asyncio.run_coroutine_threadsafe(writer.write(message, buffers), loop).result(10)

        async def loop_writes() -> None:
            for i in range(20):
                expected[("loop", i)] = big
                await writer.write(("call", 0, "loop", i), [big])
                await asyncio.sleep(0)

        got: dict = {}
        order: dict[str, list[int]] = {"a": [], "b": [], "loop": []}

        async def read_all() -> None:
            await asyncio.sleep(0.2)  # the reader starts late: the socket's buffers fill up
            while len(got) < 320:
                message, buffers = await asyncio.wait_for(reader.read(), 10)
                got[(message[2], message[3])] = b"".join(bytes(b) for b in buffers)
                order[message[2]].append(message[3])

        reading = asyncio.ensure_future(read_all())
        threads = [threading.Thread(target=thread_writes, args=(n,)) for n in ("a", "b")]
        for t in threads:
            t.start()
        await loop_writes()
        await asyncio.wait_for(reading, 20)
        for t in threads:
            await loop.run_in_executor(None, t.join, 10)
        assert got == expected
        for name in ("a", "b"):
            assert direct[name], "no write went straight to the socket"
            sent_direct = [i for i in order[name] if i in set(direct[name])]
            assert sent_direct == direct[name]
        assert order["loop"] == list(range(20))
        await close()

    asyncio.run(main())


@pytest.mark.parametrize("link", ["tcp", "unix"])
def test_write_now_declines_where_it_cannot_write_the_socket_itself(link):
    """Too large for one write, or made outside an event loop (no loop to finish a partial
    write on): ``write_now`` writes nothing, takes no lead, and says so; where it writes, the
    lead goes just before the message."""

    async def main():
        close, writer, reader = await _pair(link)
        leads = []

        def lead():
            leads.append(1)
            return ("free", 0, ["k"])

        assert not writer.write_now(("call", 0, "large"), [b"x" * (frames._SMALL + 1)], lead)
        outside = await asyncio.get_running_loop().run_in_executor(None, FrameStream, writer.comm)
        assert not outside.write_now(("call", 0, "outside"), [b"x"], lead)
        assert leads == []
        assert writer.write_now(("call", 1, "small"), [b"y"], lead)
        assert leads == [1]
        assert (await asyncio.wait_for(reader.read(), 10))[0] == ("free", 0, ["k"])
        message, buffers = await asyncio.wait_for(reader.read(), 10)
        assert message == ("call", 1, "small") and bytes(buffers[0]) == b"y"
        await close()

    asyncio.run(main())


def _filed(message, buffers) -> bool:
    """Whether the buffers of a received message lie in a shared-memory file's mapping."""
    import mmap

    def mapped(b) -> bool:
        return isinstance(b.base, memoryview) and isinstance(b.base.obj, mmap.mmap)

    large = [b for b in buffers if b.nbytes >= memfiles.BUFFER_SMALLEST]
    return bool(large) and all(mapped(b) for b in large)


def test_large_messages_to_a_peer_that_maps_files_go_through_them_whole_and_in_order():
    """A writer whose peer maps its files (``FrameStream.files``): buffers of a megabyte or
    more go through shared-memory files, one each (the reader's buffers are over their
    mappings, writable, and the writer's own bytes are untouched by the reader's changes);
    smaller ones over the socket, in the same message; all in order, from the loop and from
    another thread (``write_now``)."""

    async def main():
        close, writer, reader = await _pair()
        writer.files = memfiles.SendFiles()
        rng = np.random.default_rng(2)
        big = rng.integers(0, 256, 3 << 20, dtype=np.uint8)
        sent = [
            (("call", 0, "two large, one small"), [big[: 1 << 20], big[5:9], big[1 << 20 :]]),
            (("call", 1, "under a megabyte"), [big[: (1 << 20) - 1]]),
            (("call", 2, "sixteen of 64 KiB"), [big[i << 16 : (i + 1) << 16] for i in range(16)]),
            (("call", 3, "small"), [big[:10]]),
        ]
        for message, buffers in sent:
            await writer.write(message, buffers)
        # From another thread: a large message now goes at once too (its copy made there).
        done = await asyncio.get_running_loop().run_in_executor(
            None, writer.write_now, ("call", 4, "from a thread"), [big[7 : (2 << 20) + 7]], None
        )
        assert done
        sent.append((("call", 4, "from a thread"), [big[7 : (2 << 20) + 7]]))
        for message, buffers in sent:
            got, got_buffers = await asyncio.wait_for(reader.read(), 10)
            assert got == message
            assert [bytes(g) for g in got_buffers] == [bytes(b) for b in buffers], message
            assert all(g.flags.writeable for g in got_buffers)
            assert _filed(got, got_buffers) == (message[1] in (0, 4)), message
            for g in got_buffers:
                g[:] = 0  # the reader's own: the writer's bytes stay as they were
        assert int(big.sum()) == int(np.random.default_rng(2).integers(0, 256, 3 << 20, dtype=np.uint8).sum())
        await close()
        writer.files.close()

    asyncio.run(main())


def test_a_file_is_reused_once_its_reader_let_go_and_never_while_it_holds_it():
    """The writer reuses a file whose reader dropped every buffer over it (its bytes stay at
    one file's worth, message after message); while the reader holds a message's buffers,
    later messages of the same size go into other files and the held bytes stay as sent."""

    async def main():
        import gc

        close, writer, reader = await _pair()
        files = writer.files = memfiles.SendFiles()
        size = 2 << 20
        for i in range(5):
            await writer.write(("call", i), [np.full(size, i, dtype=np.uint8)])
            _, got = await asyncio.wait_for(reader.read(), 10)
            assert _filed(None, got) and int(got[0][0]) == i == int(got[0][-1])
            del got
            gc.collect()
        one_file = files.nbytes
        assert size < one_file < 2 * size, one_file
        held = []
        for i in range(3):
            await writer.write(("call", i), [np.full(size, 10 + i, dtype=np.uint8)])
            held.append((await asyncio.wait_for(reader.read(), 10))[1][0])
        assert [(int(h.min()), int(h.max())) for h in held] == [(10, 10), (11, 11), (12, 12)]
        assert files.nbytes >= 3 * size
        held.clear()
        gc.collect()
        before = files.nbytes
        await writer.write(("call", 9), [np.full(size, 9, dtype=np.uint8)])
        _, got = await asyncio.wait_for(reader.read(), 10)
        assert int(got[0].min()) == 9 == int(got[0].max())
        assert files.nbytes == before  # one of the three freed files, not a new one
        del got
        await close()
        files.close()

    asyncio.run(main())


def test_a_file_whose_message_was_never_read_is_not_reused_while_its_stream_lives():
    """Between the send and the reader's mapping (its claim), a file is never rewritten:
    a message read late still holds the bytes it was sent with."""

    async def main():
        close, writer, reader = await _pair()
        files = writer.files = memfiles.SendFiles()
        size = 1 << 20
        for i in range(4):  # none read yet: four files
            await writer.write(("call", i), [np.full(size, i, dtype=np.uint8)])
        assert files.nbytes >= 4 * size
        for i in range(4):
            message, got = await asyncio.wait_for(reader.read(), 10)
            assert message == ("call", i) and int(got[0].min()) == i == int(got[0].max())
        await close()
        files.close()

    asyncio.run(main())


def test_past_the_limit_of_held_mappings_a_reader_copies_and_lets_go_at_once(monkeypatch):
    """Each mapping a reader keeps holds a file descriptor: past ``_mapped_limit`` (a quarter
    of the descriptor limit) a reader copies the bytes out and lets the file go, so a
    caller that keeps every result runs out of neither descriptors nor reusable files."""

    async def main():
        close, writer, reader = await _pair()
        files = writer.files = memfiles.SendFiles()
        monkeypatch.setattr(memfiles, "_mapped_limit", lambda: 0)
        held, base = [], memfiles.mapped()
        for i in range(4):
            await writer.write(("call", i), [np.full(1 << 20, i, dtype=np.uint8)])
            message, got = await asyncio.wait_for(reader.read(), 10)
            assert not _filed(message, got) and int(got[0].min()) == i == int(got[0].max())
            assert got[0].flags.writeable
            held.append(got)
        assert memfiles.mapped() == base
        assert files.nbytes < 2 << 20  # one file, reused: every reader let go of it at once
        await close()
        files.close()

    asyncio.run(main())


def test_a_write_cancelled_while_its_file_is_written_takes_no_lead_and_gives_the_file_back():
    """A write whose buffers are being copied into a file (in the loop's executor) when it
    is cancelled: its lead (the driver's pending frees) is not taken, and the file it wrote
    goes back to the pool (the next message of its size reuses it; nothing was sent)."""

    async def main():
        close, writer, reader = await _pair()
        files = writer.files = memfiles.SendFiles()
        leads = []

        def lead():
            leads.append(1)
            return ("free", 0, ["k"])

        big = np.ones(64 << 20, dtype=np.uint8)
        writing = asyncio.ensure_future(writer.write(("call", 0), [big], lead))
        await asyncio.sleep(0)  # the copy has started in the executor
        writing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await writing
        for _ in range(100):  # the copy finishes in its thread, then gives the file back
            if files.nbytes:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)
        assert leads == []
        one = files.nbytes
        assert one > 64 << 20
        await writer.write(("call", 1), [big], lead)
        assert leads == [1]
        assert (await asyncio.wait_for(reader.read(), 10))[0] == ("free", 0, ["k"])
        message, got = await asyncio.wait_for(reader.read(), 10)
        assert message == ("call", 1) and _filed(message, got) and int(got[0].min()) == 1
        assert files.nbytes == one  # the cancelled write's file, reused
        del got
        await close()
        files.close()

    asyncio.run(main())


def test_a_buffer_the_reader_keeps_holds_its_own_file_only():
    """Each large buffer of a message has a file of its own: a reader keeping the small
    one (1 MiB) of a message lets the large one's (4 MiB) file go, which the next message
    reuses; kept buffers stay as sent."""

    async def main():
        import gc

        close, writer, reader = await _pair()
        files = writer.files = memfiles.SendFiles()
        kept = []
        for i in range(4):
            await writer.write(
                ("call", i), [np.full(4 << 20, i, dtype=np.uint8), np.full(1 << 20, 10 + i, dtype=np.uint8)]
            )
            _, got = await asyncio.wait_for(reader.read(), 10)
            assert _filed(None, got)
            kept.append(got[1])
            del got
            gc.collect()
        assert [(int(k.min()), int(k.max())) for k in kept] == [(10 + i, 10 + i) for i in range(4)]
        assert files.nbytes < 4 * (1 << 20) + 2 * (4 << 20), files.nbytes  # one 4 MiB file, reused
        await close()
        files.close()

    asyncio.run(main())


@pytest.mark.parametrize("link", ["tcp", "unix"])
def test_a_buffer_larger_than_tornados_default_read_limit_arrives_whole(link):
    # tornado's IOStream refuses more than 100 MiB in one read unless told otherwise: the
    # stream closed, and the call failed as lost (with daskwg.shared-memory off).
    async def main():
        close, writer, reader = await _pair(link)
        big = np.arange((101 << 20) // 8, dtype=np.int64)
        writing = asyncio.ensure_future(writer.write(("call", 0, "big"), [big]))
        message, buffers = await asyncio.wait_for(reader.read(), 60)
        await writing
        assert message == ("call", 0, "big")
        assert np.array_equal(buffers[0].view(np.int64), big)
        await close()

    asyncio.run(main())
