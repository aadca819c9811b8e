"""Streams from Python: the Client's low-level stream_* calls (entries, groups, acknowledgements,
redelivery, info, range), StreamProducer and StreamConsumer (fan-out to two consumers in order,
re-slicing into batches of batch_rows rows with torch tensors, epochs ending `for batch in
consumer`, resuming after close without leave, rows included), back-pressure at the window
(BackpressureError, TimeoutError), and bad inputs. Every wait is bounded by a timeout_ms."""
import gc
import os
import signal
import threading
import time

import pytest

import tensorshare

np = pytest.importorskip("numpy")

# ms; how long a test waits for entries that are already appended (a loaded CI machine)
WAIT_MS = 5000


def rows(first, k, cols=3):
    """k rows whose every value is its global row number (first, first+1, ...)."""
    return (np.arange(first, first + k, dtype=np.float32)[:, None]
            * np.ones((1, cols), np.float32))


def drain(consumer, limit=1000):
    """The batches of one epoch (bounded: a missing marker fails instead of hanging)."""
    out = []
    for batch in consumer:
        out.append(batch)
        assert len(out) < limit, "no end-of-epoch marker"
    return out


def test_low_level_entries_ack_redelivery(client):
    st = client.stream_create("s", max_entries=16)
    assert st["first_id"] == 1 and st["last_id"] == 0 and st["n_entries"] == 0
    assert st["credit"] is None  # no window: no limit
    j = client.stream_join("s", "g", "m")
    assert j["pending"] == 0 and j["members"] == 1
    assert client.stream_append("s", {"x": rows(0, 2), "i": 1}) == 1
    assert client.stream_append("s", b"two") == 2
    assert client.stream_mark("s", 7) == 3

    got = client.stream_read("s", "g", "m", max_entries=2, timeout_ms=WAIT_MS,
                             tensor_type="numpy")
    assert isinstance(got, tensorshare.StreamEntries) and isinstance(got, list)
    assert [e.id for e in got] == [1, 2]
    assert got.first_id == 1 and got.last_id == 3 and got.lost == 0
    e1, e2 = got
    np.testing.assert_array_equal(e1.value["x"], rows(0, 2))
    assert e1.value["i"] == 1 and e2.value == b"two"
    assert not e1.is_marker and e1.deliveries == 1 and not e1.redelivered

    # A member that joins again gets first what it had and did not acknowledge.
    assert client.stream_join("s", "g", "m")["pending"] == 2
    again = client.stream_read("s", "g", "m", max_entries=8, timeout_ms=WAIT_MS)
    assert [e.id for e in again] == [1, 2, 3]
    assert again[0].redelivered and again[0].deliveries == 2
    marker = again[2]
    assert marker.is_marker and marker.tag == 7 and marker.value is None

    a = client.stream_ack("s", "g", "m", 1, 2)
    assert a["acked"] == 2 and a["pending"] == 1 and a["floor"] == 3
    # ack_through acknowledges before reading; nothing new to read: an empty list at once.
    empty = client.stream_read("s", "g", "m", ack_through=3)
    assert list(empty) == [] and empty.last_id == 3

    info = client.stream_info("s")
    assert info["last_id"] == 3 and info["entries"] == 3 and info["credit"] is None
    # The keys of docs/PROTOCOL.md 8.31; a state dict says n_entries where info says entries.
    assert set(info) == {"first_id", "last_id", "entries", "bytes", "max_entries", "max_bytes",
                         "max_age_ms", "window", "lease_ms", "credit", "groups"}
    state = client.stream_create("s")
    assert state["n_entries"] == 3 and "entries" not in state
    (g,) = info["groups"]
    assert g["name"] == "g" and g["floor"] == 4 and g["pending"] == 0
    assert [m["name"] for m in g["members"]] == ["m"]

    r = client.stream_range("s", after_id=1, max_entries=10)
    assert [e.id for e in r] == [2, 3] and r[0].deliveries == 0 and r.lost == 0

    assert client.stream_leave("s", "g", "m")["n_groups"] == 1  # the group stays
    assert client.stream_leave("s", "g")["n_groups"] == 0  # None: the group goes
    assert client.stream_info("s")["groups"] == []


def test_read_waits_for_an_append(client):
    client.stream_create("s")
    client.stream_join("s", "g", "m")
    t = threading.Timer(0.2, lambda: client.stream_append("s", 5))
    t.start()
    try:
        got = client.stream_read("s", "g", "m", timeout_ms=WAIT_MS)
    finally:
        t.join()
    assert [(e.id, e.value) for e in got] == [(1, 5)]
    # A wait that passes returns an empty list, not an error.
    start = time.monotonic()
    assert list(client.stream_read("s", "g", "m", ack_through=1, timeout_ms=300)) == []
    assert time.monotonic() - start < WAIT_MS / 1000.0


def test_fanout_two_consumers(client):
    n = 25
    with tensorshare.StreamProducer(client, "fan", max_entries=64) as p:
        a = tensorshare.StreamConsumer(client, "fan", "a", timeout_ms=WAIT_MS,
                                       tensor_type="numpy")
        b = tensorshare.StreamConsumer(client, "fan", "b", prefetch=3, timeout_ms=WAIT_MS,
                                       tensor_type="numpy")
        ids = [p.push({"x": rows(i, 1), "i": i}) for i in range(n)]
        assert ids == list(range(1, n + 1)) and p.last_id == n
        p.end_epoch(0)
    with a, b:
        for c in (a, b):
            got = drain(c)
            assert [v["i"] for v in got] == list(range(n))
            for i, v in enumerate(got):
                np.testing.assert_array_equal(v["x"], rows(i, 1))
            assert c.epoch == 0 and c.lost == 0 and c.last_id == n + 1
    groups = {g["name"]: g for g in client.stream_info("fan")["groups"]}
    assert set(groups) == {"a", "b"}
    assert all(g["floor"] == n + 2 for g in groups.values())  # both committed on close


def test_batch_rows_reslicing_torch(client):
    torch = pytest.importorskip("torch")
    sizes = [3, 5, 2, 7]  # 17 rows: batches of 4, 4, 4, 4, then the epoch's last row
    client.stream_create("r", max_entries=64)
    c = tensorshare.StreamConsumer(client, "r", "g", batch_rows=4, timeout_ms=WAIT_MS,
                                   tensor_type="torch")
    with tensorshare.StreamProducer(client, "r") as p:
        first = 0
        for k in sizes:
            p.push({"x": torch.from_numpy(rows(first, k)),
                    "y": torch.arange(first, first + k, dtype=torch.int64)})
            first += k
        p.end_epoch(1)
    with c:
        got = drain(c)
        assert [len(b["y"]) for b in got] == [4, 4, 4, 4, 1]
        assert all(isinstance(b["x"], torch.Tensor) for b in got)
        x = torch.cat([b["x"] for b in got])
        y = torch.cat([b["y"] for b in got])
        assert y.tolist() == list(range(17))
        assert torch.equal(x, torch.from_numpy(rows(0, 17)))
        assert c.epoch == 1


def test_epochs_end_iterations(client):
    epochs, per_epoch = 3, 4
    client.stream_create("e", max_entries=64)
    c = tensorshare.StreamConsumer(client, "e", "g", timeout_ms=WAIT_MS)
    with tensorshare.StreamProducer(client, "e") as p:
        for epoch in range(epochs):
            for i in range(per_epoch):
                p.push(epoch * 100 + i)
            p.end_epoch(epoch)
    with c:
        for epoch in range(epochs):
            assert [v for v in c] == [epoch * 100 + i for i in range(per_epoch)]
            assert c.epoch == epoch
        # read(): None at a marker, and the batch otherwise; nothing left: TimeoutError.
    client.stream_append("e", 1)
    client.stream_mark("e", 9)
    with tensorshare.StreamConsumer(client, "e", "g", timeout_ms=WAIT_MS) as c2:
        assert c2.read() == 1
        assert c2.read() is None and c2.epoch == 9
    with tensorshare.StreamConsumer(client, "e", "g", timeout_ms=200) as c3:
        start = time.monotonic()
        with pytest.raises(tensorshare.TimeoutError):
            c3.read()
        with pytest.raises(TimeoutError):  # the builtin too
            next(iter(c3))
        assert time.monotonic() - start < WAIT_MS / 1000.0


def test_resume_after_close_without_leave(client):
    client.stream_create("q", max_entries=64)
    for i in range(6):
        client.stream_append("q", i)
    c = tensorshare.StreamConsumer(client, "q", "g", timeout_ms=WAIT_MS)
    assert [c.read() for _ in range(3)] == [0, 1, 2]
    c.close()  # commits what was handed out; the member stays
    assert c.closed
    with pytest.raises(tensorshare.CancelledError):
        c.read()
    with tensorshare.StreamConsumer(client, "q", "g", timeout_ms=WAIT_MS) as c:
        assert [c.read() for _ in range(3)] == [3, 4, 5]
        c.commit()
    (g,) = client.stream_info("q")["groups"]
    assert g["floor"] == 7 and [m["name"] for m in g["members"]] == ["g"]
    tensorshare.StreamConsumer(client, "q", "g").close(leave=True)
    assert client.stream_info("q")["groups"][0]["members"] == []


def test_resume_mid_entry_rows(client):
    client.stream_create("m", max_entries=64)
    client.stream_append("m", {"x": rows(0, 3)})
    client.stream_append("m", {"x": rows(3, 3)})
    c = tensorshare.StreamConsumer(client, "m", "g", batch_rows=2, timeout_ms=WAIT_MS,
                                   tensor_type="numpy")
    np.testing.assert_array_equal(c.read()["x"], rows(0, 2))
    c.close()  # row 2 of entry 1 was not handed out: a new consumer starts there
    with tensorshare.StreamConsumer(client, "m", "g", batch_rows=2, timeout_ms=WAIT_MS,
                                    tensor_type="numpy") as c:
        np.testing.assert_array_equal(c.read()["x"], rows(2, 2))
        np.testing.assert_array_equal(c.read()["x"], rows(4, 2))


def test_backpressure_at_the_window(client):
    st = client.stream_create("w", max_entries=8, window=2)
    assert st["window"] == 2 and st["credit"] is None  # no live group yet
    client.stream_join("w", "g", "m")
    client.stream_append("w", 1)
    client.stream_append("w", 2)
    with pytest.raises(tensorshare.BackpressureError) as ei:
        client.stream_append("w", 3)
    e = ei.value
    assert isinstance(e, tensorshare.Error) and isinstance(e, BlockingIOError)
    assert e.name == "EAGAIN" and "'g'" in e.message
    assert client.stream_info("w")["last_id"] == 2  # nothing stored
    with pytest.raises(tensorshare.TimeoutError):
        client.stream_credit("w", timeout_ms=0)
    p0 = tensorshare.StreamProducer(client, "w", block_ms=0)
    with pytest.raises(tensorshare.BackpressureError):
        p0.push(3)
    p0.close()
    with tensorshare.StreamProducer(client, "w", block_ms=300) as p:
        start = time.monotonic()
        with pytest.raises(tensorshare.TimeoutError):
            p.push(3)
        assert time.monotonic() - start < WAIT_MS / 1000.0
        assert p.end_epoch(0) == 3  # markers never wait for credit

    # Acknowledgements make room (the marker counts in the lag too): a blocked push goes
    # through.
    got = client.stream_read("w", "g", "m", max_entries=2, timeout_ms=WAIT_MS)
    assert [e.id for e in got] == [1, 2]
    with tensorshare.StreamProducer(client, "w", block_ms=WAIT_MS) as p:
        t = threading.Timer(0.2, lambda: client.stream_ack("w", "g", "m", 1, 2))
        t.start()
        try:
            assert p.push(4) == 4
        finally:
            t.join()
        assert p.waits >= 1
    with pytest.raises(tensorshare.TimeoutError):  # ids 3 (the marker) and 4: full again
        client.stream_credit("w", timeout_ms=0)
    client.stream_read("w", "g", "m", ack_through=2, max_entries=2, timeout_ms=WAIT_MS)
    client.stream_ack("w", "g", "m", 3, 4)
    assert client.stream_credit("w", timeout_ms=0)["credit"] == 2


def test_waits_on_a_stopped_tensord_say_it_did_not_answer(tensord):
    """The credit wait, the producer's push and the consumer's next against a tensord that does
    not answer (SIGSTOP) fail with the client's "no reply" message, not one that blames the
    stream's window or its entries (kept for the TIMEOUT tensord answers)."""
    c = tensorshare.Client(tensord.address, timeout=0.5)
    c.stream_create("w", max_entries=8, window=1)
    c.stream_join("w", "g", "m")
    c.stream_append("w", 1)  # the window is full
    c.stream_create("e")
    p = tensorshare.StreamProducer(c, "w", block_ms=800)
    s = tensorshare.StreamConsumer(c, "e", "g2", "m2", timeout_ms=800)
    no_reply = "^no reply within the request timeout$"
    os.kill(tensord.proc.pid, signal.SIGSTOP)
    try:
        for call in (lambda: c.stream_credit("w", timeout_ms=800), lambda: p.push(2),
                     lambda: next(iter(s))):
            start = time.monotonic()
            with pytest.raises(tensorshare.TimeoutError, match=no_reply):
                call()
            assert time.monotonic() - start < 0.8 + 0.5 + 0.5
    finally:
        os.kill(tensord.proc.pid, signal.SIGCONT)
    with pytest.raises(tensorshare.TimeoutError, match="window stayed full for timeout_ms"):
        c.stream_credit("w", timeout_ms=100)
    p.close()
    s.close()
    c.close()


def test_close_from_another_thread_ends_a_wait(client):
    client.stream_create("c")
    c = tensorshare.StreamConsumer(client, "c", "g")  # timeout_ms=None: no limit
    errors = []

    def reader():
        try:
            c.read()
        except Exception as e:  # noqa: BLE001 - the test looks at it
            errors.append(e)

    t = threading.Thread(target=reader)
    t.start()
    time.sleep(0.3)
    c.close()
    t.join(WAIT_MS / 1000.0)
    assert not t.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], tensorshare.CancelledError)


@pytest.mark.parametrize("call", [
    lambda c: c.stream_read("s", "g", "m", timeout_ms=None),
    lambda c: c.stream_read("s", "g", "m", timeout_ms=600000),
    lambda c: c.stream_range("s", 0, 64, None),
    lambda c: c.stream_credit("w", None),
], ids=["read_none", "read_long", "range_none", "credit_none"])
def test_client_close_from_another_thread_ends_a_client_wait(client, tensord, call):
    client.stream_create("s")
    client.stream_join("s", "g", "m")
    client.stream_create("w", 10, window=1, lease_ms=600000)
    client.stream_join("w", "g", "m")
    client.stream_append("w", {"a": 1})  # the window is full: credit waits
    other = tensorshare.Client(tensord.address, timeout=10)
    other.stream_range("s", 0, 1, 0)  # imports the tensor type's module (slow) before the wait
    errors = []

    def waiter():
        try:
            call(other)
        except Exception as e:  # noqa: BLE001 - the test looks at it
            errors.append(e)

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.3)
    start = time.monotonic()
    other.close()
    t.join(WAIT_MS / 1000.0)
    assert not t.is_alive()
    assert time.monotonic() - start < 2.0  # within a 250 ms slice (a loaded machine: more)
    assert len(errors) == 1 and isinstance(errors[0], tensorshare.CancelledError), errors
    assert other.closed


def test_bad_inputs(client):
    with pytest.raises(tensorshare.BinNotFoundError):
        client.stream_info("nope")
    with pytest.raises(tensorshare.BinNotFoundError):
        client.stream_append("nope", 1)
    with pytest.raises(tensorshare.BinNotFoundError):
        tensorshare.StreamProducer(client, "nope")  # no settings: it must exist
    with pytest.raises(tensorshare.BinNotFoundError):
        tensorshare.StreamConsumer(client, "nope", "g")

    client.stream_create("s")
    client.stream_append("s", 1)
    with pytest.raises(tensorshare.BinNotFoundError):
        client.stream_read("s", "g", "not-joined")
    client.stream_join("s", "g", "m")
    # Ids from the future: refused, nothing changes.
    with pytest.raises(tensorshare.InvalidArgumentError):
        client.stream_read("s", "g", "m", ack_through=100)
    with pytest.raises(tensorshare.InvalidArgumentError):
        client.stream_range("s", after_id=100)
    with pytest.raises(tensorshare.InvalidArgumentError):
        client.stream_ack("s", "g", "m", 100)
    assert client.stream_join("s", "g", "m")["next_id"] == 1

    # A stream is not a plain bin, and the other way round.
    with pytest.raises(tensorshare.InvalidArgumentError):
        client.put("s", 1)
    client.put("plain", 1)
    with pytest.raises(tensorshare.InvalidArgumentError):
        client.stream_create("plain")
    with pytest.raises(tensorshare.InvalidArgumentError):
        client.stream_create("s", max_entries=4, window=5)  # window over max_entries

    # Refused before anything is sent.
    with pytest.raises(ValueError):
        client.stream_join("s", "g", "m", start="middle")
    with pytest.raises(ValueError):
        client.stream_join("s", "g", "m", start="oldest\0x")
    with pytest.raises(ValueError):
        client.stream_read("s", "g", "m", max_entries=tensorshare.STREAM_READ_MAX + 1)
    with pytest.raises(ValueError):
        client.stream_create("t", max_age_ms=-1)
    with pytest.raises(TypeError):
        tensorshare.StreamProducer(client, "s", {"windw": 2})
    with pytest.raises(ValueError):
        tensorshare.StreamConsumer(client, "s", "g", prefetch=0)
    with pytest.raises(tensorshare.InvalidArgumentError):
        tensorshare.StreamConsumer(client, "s", "g\0x")


def test_consumer_gets_what_a_crashed_member_was_given_first(client):
    client.stream_create("x", max_entries=16)
    for i in range(4):
        client.stream_append("x", i)
    client.stream_join("x", "g", "m")
    # Handed to member m and never acknowledged (as if its process had died).
    assert [e.id for e in client.stream_read("x", "g", "m", max_entries=2)] == [1, 2]
    with tensorshare.StreamConsumer(client, "x", "g", "m", timeout_ms=WAIT_MS) as c:
        assert [c.read() for _ in range(4)] == [0, 1, 2, 3]


def alarm_in(seconds, handler):
    """Run handler from SIGALRM after seconds (the tests run in the main thread)."""
    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    return old


def cancel_alarm(old):
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)


def test_ctrl_c_interrupts_a_wait_and_the_consumer_goes_on(client):
    client.stream_create("k")
    c = tensorshare.StreamConsumer(client, "k", "g")  # timeout_ms=None: no limit

    def interrupt(*_):
        raise KeyboardInterrupt

    old = alarm_in(0.3, interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            c.read()
    finally:
        cancel_alarm(old)
    client.stream_append("k", 42)
    assert c.read() == 42
    c.close()


def test_signal_handler_closes_its_own_threads_consumer(client):
    client.stream_create("h")
    c = tensorshare.StreamConsumer(client, "h", "g")
    old = alarm_in(0.3, lambda *_: c.close())
    try:
        with pytest.raises(tensorshare.CancelledError):
            c.read()
    finally:
        cancel_alarm(old)
    assert c.closed and c.client is None
    (g,) = client.stream_info("h")["groups"]
    assert [m["name"] for m in g["members"]] == ["g"]  # closed without leaving


def test_views_release_their_memory(client):
    live = tensorshare._tensorshare._live_views
    gc.collect()
    base = live()
    client.stream_create("v")
    for i in range(3):
        client.stream_append("v", {"x": rows(i, 2)})
    client.stream_mark("v", 0)
    client.stream_join("v", "g", "m")
    got = client.stream_read("v", "g", "m", timeout_ms=WAIT_MS, tensor_type="numpy")
    c = tensorshare.StreamConsumer(client, "v", "g2", batch_rows=4, timeout_ms=WAIT_MS,
                                   tensor_type="numpy")
    batches = drain(c)
    assert [len(b["x"]) for b in batches] == [4, 2]
    keep = got[1].value["x"]
    del got
    gc.collect()
    assert live() > base  # one tensor still holds the read's memory
    np.testing.assert_array_equal(keep, rows(1, 2))
    del keep, batches
    c.close()
    gc.collect()
    assert live() == base


def test_work_queue_and_shared_consumer(client):
    n = 40
    client.stream_create("wq", max_entries=64)
    for i in range(n):
        client.stream_append("wq", i)
    client.stream_mark("wq", 0)
    # Two members of one group: each entry goes to one of them.
    a = tensorshare.StreamConsumer(client, "wq", "work", "a", prefetch=2, timeout_ms=200)
    b = tensorshare.StreamConsumer(client, "wq", "work", "b", prefetch=2, timeout_ms=200)
    got_a, got_b = [], []
    deadline = time.monotonic() + WAIT_MS / 1000.0
    while len(got_a) + len(got_b) < n and time.monotonic() < deadline:
        for c, got in ((a, got_a), (b, got_b)):
            try:
                v = c.read()
            except tensorshare.TimeoutError:  # the other member holds what is left
                continue
            if v is not None:
                got.append(v)
    assert got_a and got_b and sorted(got_a + got_b) == list(range(n))
    a.close()
    b.close()
    # One consumer shared by four threads: their calls take turns, each entry comes once.
    client.stream_create("sh", max_entries=256)
    for i in range(n):
        client.stream_append("sh", i)
    c = tensorshare.StreamConsumer(client, "sh", "g", timeout_ms=300)
    seen, lock = [], threading.Lock()

    def reader():
        while True:
            try:
                v = c.read()
            except tensorshare.TimeoutError:
                return
            with lock:
                seen.append(v)

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_MS / 1000.0 * 4)
    assert not any(t.is_alive() for t in threads)
    assert sorted(seen) == list(range(n))
    c.close()


def test_after_fork(client):
    client.stream_create("f")
    c = tensorshare.StreamConsumer(client, "f", "g", timeout_ms=WAIT_MS)
    p = tensorshare.StreamProducer(client, "f")
    pid = os.fork()
    if pid == 0:  # the child: the parent's objects refuse, and close() does not hang
        code = 1
        try:
            try:
                c.read()
            except tensorshare.ConnectionError:
                try:
                    p.push(1)
                except tensorshare.ConnectionError:
                    c.close()
                    p.close()
                    code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + WAIT_MS / 1000.0
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the child hung")
        time.sleep(0.01)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert p.push(7) == 1 and c.read() == 7  # the parent's keep working
    c.close()
    p.close()


def test_lost_entries_are_counted(client):
    client.stream_create("l", max_entries=4)
    client.stream_join("l", "slow", "slow")
    for i in range(10):
        client.stream_append("l", i)
    with tensorshare.StreamConsumer(client, "l", "slow", timeout_ms=WAIT_MS) as c:
        assert [c.read() for _ in range(4)] == [6, 7, 8, 9]  # the window kept the last 4
        assert c.lost == 6 and c.first_id == c.last_id == 10
    r = client.stream_range("l")
    assert [e.id for e in r] == [7, 8, 9, 10] and r.first_id == 7


def test_argument_messages_name_the_argument(client):
    client.stream_create("msgs")
    for bad in (0, tensorshare.STREAM_READ_MAX + 1):
        with pytest.raises(ValueError, match="max_entries must be an int from 1 to 1024"):
            client.stream_read("msgs", "g", "m", max_entries=bad)
        with pytest.raises(ValueError, match="from 1 to 1024"):
            client.stream_range("msgs", max_entries=bad)
    with pytest.raises(ValueError, match="block_ms"):
        tensorshare.StreamProducer(client, "msgs", block_ms=-1)


@pytest.mark.parametrize("call, message", [
    (lambda c: c.stream_create("ints", window=True), "window must be an int, not bool"),
    (lambda c: c.stream_create("ints", max_entries=8.0), "max_entries must be an int, not float"),
    (lambda c: c.stream_range("ints", after_id=False), "after_id must be an int, not bool"),
    (lambda c: c.stream_credit("ints", timeout_ms=True), "timeout_ms must be an int, not bool"),
    (lambda c: tensorshare.StreamConsumer(c, "ints", "g", batch_rows=True),
     "batch_rows must be an int, not bool"),
])
def test_int_arguments_refuse_bools_and_floats(client, call, message):
    client.stream_create("ints", max_entries=8)
    with pytest.raises(TypeError, match=message):
        call(client)
    assert client.stream_info("ints")["max_entries"] == 8


def test_int_arguments_take_numpy_ints(client):
    st = client.stream_create("np", max_entries=np.uint32(8), window=np.int64(4))
    assert st["window"] == 4 and client.stream_info("np")["max_entries"] == 8
    client.stream_append("np", 1)
    assert [e.id for e in client.stream_range("np", after_id=np.int64(0))] == [1]
    with pytest.raises(ValueError, match="window must be an int from 0 to 4294967295"):
        client.stream_create("np", window=np.int64(-1))
