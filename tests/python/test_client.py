"""tensorshare.Client against a real tensord: operations, errors, threads, futures, listen,
reconnect, fork and interpreter shutdown."""
import builtins
import concurrent.futures
import os
import queue
import re
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import tensorshare

# seconds; the most any single wait in these tests may take before the test fails
PATIENCE_S = 10.0


def test_operations(client):
    v1 = client.put("a", torch.ones(2))
    v2 = client.append("a", {"x": 1})
    assert v2 > v1 > 0
    assert [type(x) for x in client.peek("a")] == [torch.Tensor, dict]
    info = client.list()["a"]
    assert isinstance(info, tensorshare.BinInfo)
    assert info.n_items == 2 and info.version == v2 and info.bytes > 0
    assert client.get("a", 1)[0].tolist() == [1.0, 1.0]
    assert client.get("a", max_items=5) == [{"x": 1}]
    assert "a" not in client.list()
    assert client.delete("missing") == 0
    client.append("b", 1)
    client.append("b", 2)
    assert client.delete("b") == 2
    assert client.ping() is None
    assert client.stats()["connections"] >= 1
    assert client.connected and not client.closed
    v = client.put("c", 1)
    assert client.wait("c", 0, timeout=0) == (v, 1)


def test_missing_bin_is_key_error(client):
    with pytest.raises(KeyError) as info:
        client.get("nothing")
    e = info.value
    assert isinstance(e, tensorshare.BinNotFoundError) and isinstance(e, tensorshare.Error)
    assert e.code == -2 and e.name == "ENOENT" and "nothing" in e.message
    with pytest.raises(tensorshare.BinNotFoundError):
        client.peek("nothing")


def test_wait_times_out_with_timeout_error(client):
    t0 = time.monotonic()
    with pytest.raises(builtins.TimeoutError) as info:
        client.wait("quiet", 0, timeout=0.2)
    assert isinstance(info.value, tensorshare.TimeoutError)
    assert info.value.code == -110
    assert 0.15 < time.monotonic() - t0 < PATIENCE_S


def test_wait_on_a_stopped_tensord_ends_within_timeout_plus_request_timeout(tensord):
    """tensorshare.h: a wait's reply is awaited for its timeout plus the request timeout. wait()
    asks once without waiting first; when tensord does not answer that, the call ends there (it
    took two request timeouts on top before), saying that no reply came."""
    import signal

    c = tensorshare.Client(tensord.address, timeout=1.0)
    v = c.put("w", 1)
    os.kill(tensord.proc.pid, signal.SIGSTOP)
    try:
        for call in (lambda: c.wait("w", v, timeout=0.5), lambda: c.wait("w", v, timeout=0)):
            t0 = time.monotonic()
            with pytest.raises(tensorshare.TimeoutError,
                               match="^no reply within the request timeout$"):
                call()
            took = time.monotonic() - t0
            assert 0.9 < took < 0.5 + 1.0 + 0.4
    finally:
        os.kill(tensord.proc.pid, signal.SIGCONT)
    # Running again: the wait is tensord's, as before.
    with pytest.raises(tensorshare.TimeoutError, match="^timed out$"):
        c.wait("w", v, timeout=0.1)
    c.close()


def test_calls_while_tensord_is_down_say_why(tensord):
    c = tensorshare.Client(tensord.address, timeout=0.5)
    tensord.stop()
    deadline = time.monotonic() + PATIENCE_S
    while c.connected and time.monotonic() < deadline:
        time.sleep(0.01)
    want = ("^no connection to tensord \\(%s: connection refused\\) within the request timeout$"
            % re.escape(tensord.address))
    with pytest.raises(tensorshare.TimeoutError, match=want):
        c.ping()
    with pytest.raises(tensorshare.TimeoutError, match=want):
        c.put("b", 1)
    with pytest.raises(tensorshare.TimeoutError, match=want):
        c.wait("b", 0, timeout=0.2)
    c.close()


def test_wait_returns_on_change(client, tensord):
    v = client.put("w", 1)
    box = []
    th = threading.Thread(target=lambda: box.append(client.wait("w", v, timeout=PATIENCE_S)))
    th.start()
    time.sleep(0.05)
    with tensorshare.Client(tensord.address) as other:
        v2 = other.append("w", 2)
    th.join(PATIENCE_S)
    assert box == [(v2, 2)]


def test_wait_takes_inf_as_no_limit_like_none(client, tensord):
    import math

    v = client.put("w", 1)
    assert client.wait("w", 0, math.inf) == (v, 1)  # moved on already: at once
    assert client.wait_async("w", 0, math.inf).result(PATIENCE_S) == (v, 1)
    box = []
    th = threading.Thread(target=lambda: box.append(client.wait("w", v, timeout=math.inf)))
    th.start()
    time.sleep(0.05)
    with tensorshare.Client(tensord.address) as other:
        v2 = other.append("w", 2)
    th.join(PATIENCE_S)
    assert box == [(v2, 2)]
    for bad in (-1, float("nan"), -math.inf, 3e6):
        with pytest.raises(ValueError, match="inf or None"):
            client.wait("w", 0, bad)
    # Where None is not "no limit" (the constructor's library defaults), inf is refused.
    with pytest.raises(ValueError, match="or None, not inf"):
        tensorshare.Client(tensord.address, timeout=math.inf)


def test_connection_refused():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    with pytest.raises(builtins.ConnectionRefusedError) as info:
        tensorshare.Client("127.0.0.1:%d" % port, connect_timeout=2)
    assert isinstance(info.value, tensorshare.ConnectionError)


def test_bad_arguments(client):
    with pytest.raises(TypeError):
        client.put(1, 2)
    with pytest.raises(TypeError):
        client.put("a")
    with pytest.raises(TypeError):
        client.get("a", nonsense=1)
    with pytest.raises(ValueError):
        client.get("a", -1)
    with pytest.raises(tensorshare.InvalidArgumentError) as info:
        client.put("x" * 300, 1)
    assert isinstance(info.value, ValueError)
    with pytest.raises(ValueError):
        client.wait("a", 0, timeout=-1)
    assert client.put(bin="kw", value=3) > 0
    assert client.get(bin="kw", max_items=1, tensor_type="numpy") == [3]


COUNT = "max_items must be an int from 0 to 9223372036854775807"
VERSION = "after_version must be an int from 0 to 2**64-1"


@pytest.mark.parametrize("call, error, message", [
    pytest.param(lambda c: c.get("a", -1), ValueError, COUNT + ", not -1", id="get"),
    pytest.param(lambda c: c.peek("a", 2**63), ValueError, COUNT, id="peek"),
    pytest.param(lambda c: c.get("a", True), TypeError, "max_items must be an int, not bool",
                 id="get_bool"),
    pytest.param(lambda c: c.peek("a", 1.0), TypeError, "max_items must be an int, not float",
                 id="peek_float"),
    pytest.param(lambda c: c.get_async("a", False), TypeError,
                 "max_items must be an int, not bool", id="get_async_bool"),
    pytest.param(lambda c: c.wait("a", -1, timeout=0), ValueError, VERSION + ", not -1",
                 id="wait"),
    pytest.param(lambda c: c.wait("a", 2**64, timeout=0), ValueError, VERSION, id="wait_big"),
    pytest.param(lambda c: c.wait("a", True, timeout=0), TypeError,
                 "after_version must be an int, not bool", id="wait_bool"),
    pytest.param(lambda c: c.wait_async("a", -1, timeout=0), ValueError, VERSION,
                 id="wait_async"),
])
def test_int_arguments_name_themselves_and_refuse_bools(client, call, error, message):
    client.append("a", 1)
    with pytest.raises(error, match=re.escape(message)):
        call(client)
    assert client.peek("a") == [1]


def test_strerror_refuses_a_code_past_an_int():
    strerror = tensorshare._tensorshare.strerror
    assert strerror(-2) == tensorshare.BinNotFoundError().message
    with pytest.raises(ValueError, match="code must be an int from -2147483648 to 2147483647"):
        strerror(2**32 - 2)  # not -2
    with pytest.raises(TypeError, match="code must be an int, not float"):
        strerror(-2.0)


def test_unix_socket_address(tensord):
    for address in (tensord.unix_path, tensord.unix_address):
        with tensorshare.Client(address) as c:
            c.put("u", 1)
            assert c.get("u") == [1]


def test_token(start_tensord, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    d = start_tensord("--auth-token-file", str(token_file))
    with tensorshare.Client(d.address, token="s3cret") as c:
        c.ping()
    with tensorshare.Client(d.address, token_file=str(token_file)) as c:
        c.ping()
    with pytest.raises(PermissionError) as info:
        tensorshare.Client(d.address, token="wrong")
    assert isinstance(info.value, tensorshare.AuthenticationError)


def test_close_and_context_manager(tensord):
    with tensorshare.Client(tensord.address) as c:
        c.ping()
    assert c.closed and not c.connected
    with pytest.raises(tensorshare.CancelledError):
        c.ping()
    with pytest.raises(tensorshare.CancelledError):
        c.put_async("a", 1)
    c.close()  # idempotent
    assert "closed" in repr(c)


def test_other_threads_run_while_one_waits(client, tensord):
    """wait() releases the GIL: a pure-Python loop in another thread keeps counting."""
    done = threading.Event()
    result = []

    def waiter():
        try:
            result.append(client.wait("idle", 0, timeout=1.0))
        except tensorshare.TimeoutError:
            result.append("timeout")
        done.set()

    th = threading.Thread(target=waiter)
    th.start()
    count = 0
    t0 = time.monotonic()
    while not done.is_set() and time.monotonic() - t0 < PATIENCE_S:
        count += 1
    th.join(PATIENCE_S)
    assert result == ["timeout"]
    assert count > 10000  # the loop ran during the wait, not only before or after it


def test_blocking_calls_from_many_threads(client):
    errors = []

    def worker(i):
        try:
            for j in range(50):
                client.append("mt", {"i": i, "j": j, "t": torch.full((16,), i)})
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(PATIENCE_S)
    assert not errors
    items = client.get("mt")
    assert len(items) == 200
    for i in range(4):
        assert [x["j"] for x in items if x["i"] == i] == list(range(50))


def test_close_interrupts_a_waiting_thread(tensord):
    c = tensorshare.Client(tensord.address)
    box = []

    def waiter():
        try:
            c.wait("never", 0)  # no timeout: as long as the server allows
        except Exception as e:
            box.append(e)

    th = threading.Thread(target=waiter)
    th.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    c.close()
    th.join(PATIENCE_S)
    assert not th.is_alive()
    assert len(box) == 1 and isinstance(box[0], tensorshare.CancelledError)
    assert time.monotonic() - t0 < 5


def test_futures(client):
    import concurrent.futures as cf

    f = client.put_async("f", torch.arange(5))
    assert isinstance(f, cf.Future)
    v = f.result(PATIENCE_S)
    assert isinstance(v, int) and v > 0
    futs = [client.append_async("f", i) for i in range(20)]
    assert [x.result(PATIENCE_S) for x in futs] == sorted(x.result() for x in futs)
    assert len(client.peek_async("f").result(PATIENCE_S)) == 21
    assert "f" in client.list_async().result(PATIENCE_S)
    assert client.stats_async().result(PATIENCE_S)["bins"] >= 1
    assert client.ping_async().result(PATIENCE_S) is None
    w = client.wait_async("f", 0, timeout=1).result(PATIENCE_S)
    assert w[1] == 21
    items = client.get_async("f", 1, tensor_type="numpy").result(PATIENCE_S)
    assert items[0].tolist() == [0, 1, 2, 3, 4]
    assert client.delete_async("f").result(PATIENCE_S) == 20
    bad = client.get_async("f")
    with pytest.raises(tensorshare.BinNotFoundError):
        bad.result(PATIENCE_S)
    with pytest.raises(tensorshare.RecordError):
        client.put_async("f", {"x": None})  # refused at once, nothing queued
    done = threading.Event()
    client.ping_async().add_done_callback(lambda _f: done.set())
    assert done.wait(PATIENCE_S)


def test_async_put_keeps_its_tensor(client):
    """The tensor's memory is read by the I/O thread: the put must hold it even if the caller
    drops every reference at once."""
    futs = [client.append_async("keep", torch.full((1 << 16,), i, dtype=torch.int32))
            for i in range(8)]
    for f in futs:
        f.result(PATIENCE_S)
    items = client.get("keep")
    assert [int(t[0]) for t in items] == list(range(8))
    assert all(bool((t == i).all()) for i, t in enumerate(items))


def collect(q, n, timeout=PATIENCE_S):
    out = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        try:
            out.append(q.get(timeout=0.05))
        except queue.Empty:
            pass
    return out


def test_listen_callbacks_in_order(client, tensord):
    q = queue.Queue()
    client.listen("l", q.put)
    with tensorshare.Client(tensord.address) as other:
        for i in range(20):
            other.append("l", i)
        other.get("l", 5)
        other.delete("l")
    notes = collect(q, 22)
    assert [n.event for n in notes] == ["append"] * 20 + ["get", "delete"]
    assert [n.n_items for n in notes] == list(range(1, 21)) + [15, 0]
    versions = [n.version for n in notes]
    assert versions == sorted(versions)
    assert all(isinstance(n, tensorshare.Notification) and n.bin == "l" for n in notes)
    client.unlisten("l")
    with pytest.raises(tensorshare.BinNotFoundError):
        client.unlisten("l")


def test_callback_exception_is_reported_and_later_callbacks_run(client, monkeypatch):
    reported = []
    monkeypatch.setattr(sys, "unraisablehook", reported.append)
    q = queue.Queue()

    def cb(n):
        q.put(n.n_items)
        if n.n_items == 1:
            raise RuntimeError("boom in callback")

    client.listen("e", cb)
    for i in range(3):
        client.append("e", i)
    assert collect(q, 3) == [1, 2, 3]
    deadline = time.monotonic() + PATIENCE_S
    while not reported and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(reported) == 1
    assert isinstance(reported[0].exc_value, RuntimeError)
    assert "boom" in str(reported[0].exc_value)


def test_future_done_callback_exception_goes_to_the_futures_logger(client, monkeypatch):
    """The futures are concurrent.futures.Future: an exception in a done-callback is logged by
    the concurrent.futures logger (what that module does), not sent to sys.unraisablehook, and
    the future's other done-callbacks still run."""
    import logging

    reported = []
    monkeypatch.setattr(sys, "unraisablehook", reported.append)
    logged = []

    class Keep(logging.Handler):
        def emit(self, record):
            logged.append(record)

    handler = Keep()
    logger = logging.getLogger("concurrent.futures")
    logger.addHandler(handler)
    try:
        ran = threading.Event()

        def boom(f):
            raise RuntimeError("boom in done-callback")

        f = client.ping_async()
        f.add_done_callback(boom)
        f.add_done_callback(lambda f: ran.set())
        f.result(PATIENCE_S)
        assert ran.wait(PATIENCE_S)
    finally:
        logger.removeHandler(handler)
    assert isinstance(f, concurrent.futures.Future)
    assert len(logged) == 1 and "exception calling callback" in logged[0].getMessage()
    assert isinstance(logged[0].exc_info[1], RuntimeError)
    assert reported == []


def test_blocking_call_in_callback_is_deadlock_error(client):
    q = queue.Queue()

    def cb(n):
        try:
            client.ping()
            q.put("no error")
        except tensorshare.DeadlockError as e:
            q.put(e)
        client.ping_async()  # the asynchronous forms are fine there

    client.listen("d", cb)
    client.put("d", 1)
    [e] = collect(q, 1)
    assert isinstance(e, tensorshare.DeadlockError) and isinstance(e, RuntimeError)


def test_reconnect_after_restart(tensord):
    c = tensorshare.Client(tensord.address, timeout=5)
    q = queue.Queue()
    c.listen("r", q.put)
    c.put("r", 1)
    assert collect(q, 1)[0].event == "put"
    tensord.restart()
    deadline = time.monotonic() + PATIENCE_S
    while True:
        try:
            c.put("r", 2)
            break
        except tensorshare.ConnectionError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    events = [n.event for n in collect(q, 3)]
    assert events[:2] == ["disconnected", "resubscribed"]
    assert c.get("r") == [2]
    c.close()


def test_fork_child_gets_a_clear_error(client, tensord):
    client.put("fk", 1)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report through the pipe, never return into pytest
        code = 1
        try:
            os.close(r)
            try:
                client.ping()
                msg = b"no error"
            except tensorshare.ConnectionError as e:
                msg = b"ok " + str(e).encode()
            with tensorshare.Client(tensord.address) as own:
                own.append("fk", 2)
            os.write(w, msg)
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    deadline = time.monotonic() + PATIENCE_S
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the child hung")
        time.sleep(0.01)
    msg = os.read(r, 4096)
    os.close(r)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert msg.startswith(b"ok ") and b"fork" in msg
    assert client.get("fk") == [1, 2]  # the parent's connection is intact


SHUTDOWN_SCRIPT = textwrap.dedent("""
    import sys, threading, time
    sys.path.insert(0, sys.argv[2]) if sys.argv[2] else None
    import tensorshare, torch
    addr = sys.argv[1]
    c = tensorshare.Client(addr)
    seen = []
    c.listen("s", lambda n: seen.append(n))
    w = tensorshare.Client(addr)
    # Made once: a daemon thread that creates or frees torch tensors while the interpreter
    # exits can abort the process in torch 1.13 itself (its deallocation releases and retakes
    # the GIL inside C++ code, where Python 3.11 ends the thread), tensorshare or not.
    t = torch.ones(4)
    def writer():
        while True:  # keeps notifications coming while the interpreter exits
            try:
                w.append("s", t)
                c.append("s2", t)  # a client that is in use while atexit closes it
            except tensorshare.Error:
                return
    threading.Thread(target=writer, daemon=True).start()
    waiter = tensorshare.Client(addr)
    def wait_forever():
        try:
            waiter.wait("never", 0)
        except tensorshare.CancelledError:
            pass  # atexit closed the client
    threading.Thread(target=wait_forever, daemon=True).start()
    fut = c.wait_async("never2", 0)
    deadline = time.monotonic() + 10
    while len(seen) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    print("seen", len(seen), flush=True)
""")


def test_shutdown_with_live_listener_exits_promptly(tensord):
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", SHUTDOWN_SCRIPT, tensord.address,
                        os.environ.get("TS_PYTHONPATH", "")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("seen ")
    assert int(p.stdout.split()[1]) >= 5
    assert "Traceback" not in p.stderr
    assert time.monotonic() - t0 < 30


def test_close_from_a_callback(tensord):
    c = tensorshare.Client(tensord.address)
    q = queue.Queue()

    def cb(n):
        c.close()  # frees the client once this callback returns
        q.put(n.event)

    c.listen("cc", cb)
    with tensorshare.Client(tensord.address) as other:
        other.put("cc", 1)
        assert collect(q, 1) == ["put"]
        deadline = time.monotonic() + PATIENCE_S
        while not c.closed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert c.closed
        with pytest.raises(tensorshare.CancelledError):
            c.ping()
        other.put("cc", 2)  # nobody listens any more; nothing may crash
        other.ping()


def test_dropped_client_with_listener_and_futures(tensord):
    import gc
    import weakref

    c = tensorshare.Client(tensord.address)
    q = queue.Queue()
    c.listen("gc", q.put)
    fut = c.wait_async("gc-never", 0)
    ref = weakref.ref(c)
    del c
    gc.collect()
    assert ref() is None
    with pytest.raises(tensorshare.CancelledError):
        fut.result(PATIENCE_S)


def test_big_put_and_get_release_the_gil(client):
    big = torch.ones(32 << 20, dtype=torch.uint8)  # 32 MiB
    done = threading.Event()
    out = []

    def mover():
        for _ in range(3):
            client.put("big", big)
            out.append(client.get("big")[0])
        done.set()

    th = threading.Thread(target=mover)
    th.start()
    count = 0
    t0 = time.monotonic()
    while not done.is_set() and time.monotonic() - t0 < 60:
        count += 1
    th.join(PATIENCE_S)
    assert len(out) == 3 and all(t.shape == big.shape and int(t[-1]) == 1 for t in out)
    assert count > 1000


def test_save(start_tensord, tmp_path):
    d = start_tensord("--save", str(tmp_path / "snap.tsd"))
    with tensorshare.Client(d.address) as c:
        c.put("p", torch.arange(3))
        c.save()
    d.restart()
    with tensorshare.Client(d.address) as c:
        assert c.get("p")[0].tolist() == [0, 1, 2]


def test_save_without_snapshot_path(client):
    with pytest.raises(tensorshare.InvalidArgumentError) as info:
        client.save()
    assert info.value.message


def test_future_result_in_a_callback_times_out_instead_of_raising(client):
    """A future's result() in a callback on the I/O thread is no DeadlockError: it blocks the
    thread that would complete the future, until result's own timeout."""
    q = queue.Queue()

    def cb(n):
        try:
            client.ping_async().result(0.3)
            q.put("completed")
        except Exception as e:  # noqa: BLE001 - the test looks at it
            q.put(e)

    client.listen("r", cb)
    client.put("r", 1)
    got = q.get(timeout=PATIENCE_S)
    assert isinstance(got, builtins.TimeoutError) and not isinstance(got, tensorshare.Error)
    client.unlisten("r")


def test_wait_in_a_callback_is_deadlock_error(client):
    q = queue.Queue()
    v = client.put("wd", 1)

    def cb(n):
        try:
            client.wait("wd", n.version, timeout=1)
            q.put("no error")
        except tensorshare.DeadlockError as e:
            q.put(e)

    client.listen("wd", cb)
    client.put("wd", 2)
    [e] = collect(q, 1)
    assert isinstance(e, tensorshare.DeadlockError)
    assert client.wait("wd", v, timeout=1)[0] > v  # answered at once: it moved on already


FORK_EXIT_SCRIPT = textwrap.dedent("""
    import os, sys
    import tensorshare
    c = tensorshare.Client(sys.argv[1])
    c.listen("fx", lambda n: None)
    f = c.wait_async("fx-never", 0)
    pid = os.fork()
    if pid == 0:
        try:
            c.put("fx", 1)
            sys.exit(3)
        except tensorshare.ConnectionError:
            pass
        try:
            c.close()  # leaves the parent's connection alone
        except tensorshare.Error:
            sys.exit(4)
        sys.exit(0)  # a normal exit: atexit and finalization with the parent's client around
    _, status = os.waitpid(pid, 0)
    c.put("fx", 2)
    print("child", os.waitstatus_to_exitcode(status), "parent", c.get("fx"), flush=True)
""")


def test_fork_child_exits_normally(tensord):
    p = subprocess.run([sys.executable, "-c", FORK_EXIT_SCRIPT, tensord.address],
                       capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=os.environ.get("TS_PYTHONPATH", "")))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "child 0 parent [2]"


def test_close_while_other_threads_are_inside_calls(tensord):
    c = tensorshare.Client(tensord.address)
    big = torch.ones(8 << 20, dtype=torch.uint8)
    outcomes = []
    started = threading.Barrier(4)

    def worker():
        started.wait(PATIENCE_S)
        for _ in range(200):
            try:
                c.put("cw", big)
                c.peek("cw")
            except tensorshare.CancelledError:
                outcomes.append("cancelled")
                return
        outcomes.append("finished")

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for th in threads:
        th.start()
    started.wait(PATIENCE_S)
    time.sleep(0.05)
    c.close()
    for th in threads:
        th.join(PATIENCE_S)
    assert not any(th.is_alive() for th in threads)
    assert outcomes.count("cancelled") == 3
    assert c.closed
    with tensorshare.Client(tensord.address) as other:
        other.ping()


def test_every_error_carries_code_name_and_message(client, tensord):
    # Found by the library before sending: its code.
    with pytest.raises(tensorshare.InvalidArgumentError) as info:
        client.put("n" * 256, 1)
    assert (info.value.code, info.value.name) == (-36, "ENAMETOOLONG")
    # Found by the package itself: its class's code, and a message.
    for call, cls, name in [
            (lambda: client.create_tensor_bin("x", "float23", (2,)), "InvalidArgumentError",
             "EINVAL"),
            (lambda: client.create_tensor_bin("x", "float32", ()), "InvalidArgumentError",
             "EINVAL"),
            (lambda: client.table_sample("x", 0), "InvalidArgumentError", "EINVAL"),
            (lambda: client.put("x", {"a": None}), "RecordError", "EBADRECORD")]:
        with pytest.raises(getattr(tensorshare, cls)) as info:
            call()
        e = info.value
        assert e.name == name and e.code == getattr(tensorshare, cls).code < 0
        assert e.message and e.message == str(e.args[0])
    # Made by a program: the class's code when it has one; message without KeyError's quotes.
    e = tensorshare.BinNotFoundError("custom")
    assert (e.code, e.name, e.message, str(e)) == (-2, "ENOENT", "custom", "'custom'")
    assert (tensorshare.TimeoutError("t").name, tensorshare.ServiceGoneError("g").name) == (
        "ETIMEDOUT", "ESERVICE")
    assert tensorshare.InvalidArgumentError().message == "invalid argument"
    plain = tensorshare.Error("x")
    assert (plain.code, plain.name, plain.message) == (0, "", "x")


def test_auth_hint_names_the_python_arguments(start_tensord, tmp_path, monkeypatch):
    monkeypatch.delenv("TS_AUTH_TOKEN", raising=False)
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    d = start_tensord("--auth-token-file", str(token_file))
    with pytest.raises(tensorshare.AuthenticationError) as info:
        tensorshare.Client(d.address)
    assert "token=" in info.value.message and "token_file=" in info.value.message
    assert "auth_token option" not in info.value.message


def test_stats_async_takes_no_arguments_like_stats(client):
    assert "bins" in client.stats_async().result(PATIENCE_S)
    with pytest.raises(TypeError):
        client.stats_async(tensor_type="numpy")


def test_documented_async_forms_and_a_second_listen(client):
    # docs/PYTHON.md lists exactly these _async forms.
    forms = {n[:-len("_async")] for n in dir(client) if n.endswith("_async")}
    assert forms == {"put", "append", "get", "peek", "delete", "list", "wait", "stats", "ping"}
    client.listen("twice", lambda n: None)
    with pytest.raises(tensorshare.InvalidArgumentError):
        client.listen("twice", lambda n: None)
    client.unlisten("twice")
