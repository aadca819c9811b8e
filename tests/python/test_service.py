"""Services from Python: Client.call and Client.serve against a real tensord."""
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import tensorshare as ts

# seconds; the most any single wait in these tests may take on a loaded 2-core machine
WAIT_S = 10.0

# A serving process: serves "svc" from the address in argv[1]; mode "hang" never answers,
# "echo" answers with the request. Prints "ready" once registered.
SERVER = r"""
import sys, time
sys.path.insert(0, %r)
import tensorshare as ts
c = ts.Client(sys.argv[1], tensor_type="numpy")
mode = sys.argv[2]
def handler(req):
    if mode == "hang":
        time.sleep(3600)
    return req
s = c.serve("svc", handler, workers=2)
print("ready", flush=True)
time.sleep(3600)
"""


def start_server(address, mode):
    path = os.environ.get("TS_PYTHONPATH") or os.path.join(os.path.dirname(ts.__file__), "..")
    p = subprocess.Popen([sys.executable, "-c", SERVER % path, address, mode],
                         stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    assert line.strip() == "ready", line
    return p


def stop_server(p):
    if p.poll() is None:
        p.send_signal(signal.SIGKILL)
    p.wait(timeout=WAIT_S)


def test_echo(client, tensord):
    c2 = ts.Client(tensord.address, tensor_type="numpy")
    try:
        with c2.serve("echo", lambda req: {"x": req["x"] * 2, "tag": req["tag"]}):
            x = np.arange(6, dtype=np.float32).reshape(2, 3)
            ans = client.call("echo", {"x": x, "tag": "hello"}, timeout=WAIT_S, tensor_type="numpy")
            np.testing.assert_array_equal(np.asarray(ans["x"]), x * 2)
            assert ans["tag"] == "hello"
    finally:
        c2.close()


def test_same_client_serves_and_calls(client):
    with client.serve("inc", lambda req: req + 1, workers=1):
        assert [client.call("inc", i, timeout=WAIT_S) for i in range(5)] == [1, 2, 3, 4, 5]


def test_handler_exception_reaches_caller(client):
    def handler(req):
        if req == "bad":
            raise ValueError("bad request")
        raise RuntimeError("it broke")

    with client.serve("fails", handler):
        with pytest.raises(ts.InvalidArgumentError, match="bad request"):
            client.call("fails", "bad", timeout=WAIT_S)
        with pytest.raises(ts.ServerError, match="it broke"):
            client.call("fails", "other", timeout=WAIT_S)


def test_no_server(client):
    with pytest.raises(ts.BinNotFoundError):
        client.call("nobody", 1, timeout=WAIT_S)


def test_timeout(client):
    release = threading.Event()

    def handler(req):
        release.wait(WAIT_S)
        return req

    with client.serve("slow", handler, workers=1):
        t0 = time.monotonic()
        with pytest.raises(ts.TimeoutError):
            client.call("slow", 1, timeout=0.3)
        assert time.monotonic() - t0 < WAIT_S
        release.set()


def test_wait_for_server_times_out(client):
    with pytest.raises(ts.TimeoutError):
        client.call("later", 1, timeout=0.3, wait_for_server=True)


def test_server_killed_mid_call(client, tensord):
    hang = start_server(tensord.address, "hang")
    try:
        result = {}

        def caller():
            try:
                client.call("svc", 1, timeout=WAIT_S * 3)
            except BaseException as e:  # noqa: B902 - handed to the test thread
                result["exc"] = e

        t = threading.Thread(target=caller)
        t.start()
        time.sleep(0.3)  # the call reaches the hanging handler
        t0 = time.monotonic()
        stop_server(hang)
        t.join(WAIT_S)
        assert not t.is_alive()
        assert isinstance(result.get("exc"), ts.ServiceGoneError), result
        assert isinstance(result["exc"], ts.Error)
        assert time.monotonic() - t0 < WAIT_S
        echo = start_server(tensord.address, "echo")
        try:
            assert client.call("svc", 7, timeout=WAIT_S) == 7
        finally:
            stop_server(echo)
    finally:
        stop_server(hang)


def test_close_stops_serving(client):
    s = client.serve("gone", lambda req: req)
    assert client.call("gone", 3, timeout=WAIT_S) == 3
    s.close()
    s.close()
    with pytest.raises(ts.BinNotFoundError):
        client.call("gone", 3, timeout=WAIT_S)


def test_client_closed_before_service(client, tensord):
    c = ts.Client(tensord.address)
    s = c.serve("order", lambda req: req)
    c.close()  # the connection stays until the Service is closed
    with pytest.raises(ts.CancelledError):
        c.call("order", 5, timeout=WAIT_S)
    assert client.call("order", 5, timeout=WAIT_S) == 5
    s.close()
    with pytest.raises(ts.BinNotFoundError):
        client.call("order", 5, timeout=WAIT_S)


def test_handler_raising_a_tensorshare_error_answers_with_its_code(client):
    def handler(req):
        if req == "missing":
            raise ts.BinNotFoundError("no such user")
        if req == "record":
            raise ts.RecordError("bad record")
        raise ts.CancelledError("stopped")  # ECANCELED has no wire status

    with client.serve(service="typed", handler=handler):
        with pytest.raises(ts.BinNotFoundError) as info:
            client.call("typed", "missing", timeout=WAIT_S)
        assert info.value.message == "no such user" and info.value.name == "ENOENT"
        with pytest.raises(ts.RecordError) as info:
            client.call("typed", "record", timeout=WAIT_S)
        assert info.value.name == "EBADRECORD" and info.value.message == "bad record"
        with pytest.raises(ts.ServerError, match="stopped"):
            client.call("typed", "other", timeout=WAIT_S)


def test_close_answers_the_calls_already_handed(client, tensord):
    """close() ends the registration, then the workers answer every call handed to this server,
    the ones no worker had started yet included: none fails."""
    started = threading.Event()
    release = threading.Event()

    def handler(req):
        started.set()
        release.wait(WAIT_S)
        return req

    svc = client.serve("queued", handler, concurrency=4, workers=1)
    caller = ts.Client(tensord.address)
    results = {}

    def call(i):
        try:
            results[i] = caller.call("queued", i, timeout=WAIT_S)
        except ts.Error as e:
            results[i] = e

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    try:
        threads[0].start()
        assert started.wait(WAIT_S)
        for t in threads[1:]:
            t.start()
        time.sleep(0.3)  # the other calls reach this server's queue (concurrency 4)
        closer = threading.Thread(target=svc.close)
        closer.start()
        time.sleep(0.1)
        release.set()
        closer.join(WAIT_S)
        assert not closer.is_alive()
        for t in threads:
            t.join(WAIT_S)
    finally:
        release.set()
        caller.close()
    assert results == {i: i for i in range(4)}, results
    # The registration is gone: a new call finds no server.
    with pytest.raises(ts.BinNotFoundError):
        client.call("queued", 9, timeout=WAIT_S)


def test_close_while_another_server_serves_fails_no_call(client, tensord):
    """Two servers of one name, calls flowing; closing the slow one fails no call: the calls
    handed to it are answered by its workers, and the later ones go to the other server."""
    a, b = ts.Client(tensord.address), ts.Client(tensord.address)
    ran_a = []

    def slow(req):
        ran_a.append(req)
        time.sleep(0.5)
        return "A"

    sa = a.serve("pair", slow, concurrency=16, workers=1)
    sb = b.serve("pair", lambda req: "B", concurrency=16, workers=2)
    results = []
    stop = threading.Event()

    def caller():
        deadline = time.monotonic() + WAIT_S * 2
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                results.append(client.call("pair", 1, timeout=WAIT_S * 2))
            except ts.Error as e:
                results.append(e)
            time.sleep(0.01)

    threads = [threading.Thread(target=caller) for _ in range(4)]
    try:
        for t in threads:
            t.start()
        t0 = time.monotonic()
        while len(ran_a) < 1 and time.monotonic() - t0 < WAIT_S:
            time.sleep(0.01)
        time.sleep(0.2)  # more calls queue at A behind the slow one
        sa.close()
        after = len(results)
        time.sleep(0.5)
        assert len(results) > after  # B answers meanwhile
    finally:
        stop.set()
        for t in threads:
            t.join(WAIT_S * 3)
        sa.close()
        sb.close()
        a.close()
        b.close()
    assert not any(t.is_alive() for t in threads)
    failed = [r for r in results if isinstance(r, Exception)]
    assert not failed, failed
    assert ran_a and "A" in results and "B" in results


@pytest.mark.parametrize("timeout", [float("inf"), 0, -1, float("nan"), 3e6])
def test_call_refuses_timeouts_without_a_limit_or_out_of_range(client, timeout):
    with pytest.raises(ValueError, match="cannot wait without a limit"):
        client.call("nobody", 1, timeout=timeout)


@pytest.mark.parametrize("timeout", [86400.001, 1e9])
def test_call_refuses_timeouts_past_a_day(client, timeout):
    with pytest.raises(ValueError, match=r"at most 86400 \(24 hours\)"):
        client.call("nobody", 1, timeout=timeout)


def test_call_timeouts_up_to_a_day(client, tensord):
    """86400 s is accepted, and None with a request timeout past a day calls with a day (tensord
    refuses longer calls)."""
    with pytest.raises(ts.BinNotFoundError):
        client.call("nobody", 1, timeout=86400)
    long = ts.Client(tensord.address, timeout=100000.0)
    try:
        with client.serve("day", lambda req: req + 1, workers=1):
            assert long.call("day", 1) == 2
    finally:
        long.close()


def test_serve_checks_concurrency_first(client):
    with pytest.raises(ValueError, match="concurrency"):
        client.serve("c0", lambda r: r, concurrency=0)


@pytest.mark.parametrize("kwargs, error, message", [
    pytest.param(dict(concurrency=2**40), ts.InvalidArgumentError,
                 "concurrency must be an int from 1 to 65536, not 1099511627776", id="big"),
    pytest.param(dict(concurrency=True), TypeError, "concurrency must be an int, not bool",
                 id="bool"),
    pytest.param(dict(concurrency=4.0), TypeError, "concurrency must be an int, not float",
                 id="float"),
    pytest.param(dict(workers=2.5), TypeError, "workers must be an int, not float",
                 id="workers_float"),
])
def test_serve_refuses_ints_out_of_range_and_other_types(client, kwargs, error, message):
    """Refused before anything is registered: the name stays free for a good serve."""
    with pytest.raises(error, match=message):
        client.serve("c1", lambda r: r, **kwargs)
    with client.serve("c1", lambda r: r + 1, concurrency=np.int64(2), workers=np.int32(1)):
        assert client.call("c1", 1, timeout=WAIT_S) == 2


def test_handler_error_with_a_code_past_an_int_answers_server_error(client):
    def handler(req):
        e = ts.BinNotFoundError("odd code")
        e.code = 2**40 if req == "big" else "not a code"
        raise e

    with client.serve("odd", handler, workers=1):
        for req in ("big", "str"):
            with pytest.raises(ts.ServerError, match="odd code"):
                client.call("odd", req, timeout=WAIT_S)
