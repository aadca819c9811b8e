"""Coordination primitives from Python: Client.add (counters, threads adding at once end at the
exact sum), put_if (one winner per version, VersionMismatchError with current_version), take
(first come first served, each item once, TimeoutError), mget (present and missing bins) and
barrier (threads released together with a generation, reusable), and bad inputs mapped to the
module's exceptions. Every wait is bounded by a timeout_ms."""
import re
import threading

import pytest

import tensorshare

WAIT_MS = 10000


def test_add_counts_and_refuses_non_counters(client):
    assert client.add("ctr") == 1
    assert client.add("ctr", 41) == 42
    assert client.add("ctr", -2) == 40
    assert client.peek("ctr") == [40]
    client.append("two", 1)
    client.append("two", 2)
    with pytest.raises(tensorshare.InvalidArgumentError):
        client.add("two", 1)
    assert client.peek("two") == [1, 2]
    client.add("big", 2**63 - 1)
    with pytest.raises(tensorshare.InvalidArgumentError):
        client.add("big", 1)
    assert client.peek("big") == [2**63 - 1]


def test_add_from_threads_is_exact(tensord):
    n_threads, each = 8, 500

    def work():
        c = tensorshare.Client(tensord.address, timeout=10)
        try:
            for _ in range(each):
                c.add("sum")
        finally:
            c.close()

    threads = [threading.Thread(target=work) for _ in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    c = tensorshare.Client(tensord.address, timeout=10)
    assert c.peek("sum") == [n_threads * each]
    c.close()


def test_put_if(client):
    v1 = client.put_if("cas", 0, {"a": 1})
    assert v1 > 0
    with pytest.raises(tensorshare.VersionMismatchError) as e:
        client.put_if("cas", 0, {"a": 2})
    assert e.value.current_version == v1
    assert isinstance(e.value, tensorshare.Error)
    v2 = client.put_if("cas", v1, {"a": 3})
    assert v2 > v1
    assert client.peek("cas") == [{"a": 3}]
    with pytest.raises(tensorshare.VersionMismatchError) as e:
        client.put_if("missing", 5, 1)
    assert e.value.current_version == 0


def test_take_fifo_once_and_timeout(client, tensord):
    got = []
    lock = threading.Lock()

    def taker():
        c = tensorshare.Client(tensord.address, timeout=10)
        try:
            for _ in range(5):
                items = c.take("q", 1, timeout_ms=WAIT_MS)
                with lock:
                    got.extend(items)
        finally:
            c.close()

    threads = [threading.Thread(target=taker) for _ in range(4)]
    for t in threads:
        t.start()
    for i in range(20):
        client.append("q", i)
    for t in threads:
        t.join(60)
    assert sorted(got) == list(range(20))
    with pytest.raises(tensorshare.TimeoutError):
        client.take("q", timeout_ms=0)
    with pytest.raises(tensorshare.TimeoutError):
        client.take("q", timeout_ms=200)


def test_mget(client):
    client.put("a", 1)
    client.append("b", 2)
    client.append("b", 3)
    out = client.mget(["a", "nope", "b"])
    assert out == {"a": [1], "nope": None, "b": [2, 3]}
    assert client.mget(["b"], max_items=1) == {"b": [2]}
    with pytest.raises(tensorshare.InvalidArgumentError):
        client.mget([])
    with pytest.raises(tensorshare.InvalidArgumentError):
        client.mget(["x"] * 257)
    with pytest.raises(tensorshare.InvalidArgumentError, match="NUL"):
        client.mget(["a\0zzz"])  # not bin "a"


def test_barrier(tensord):
    parties = 6
    gens = []
    lock = threading.Lock()

    def arrive():
        c = tensorshare.Client(tensord.address, timeout=10)
        try:
            g1 = c.barrier("meet", parties, timeout_ms=WAIT_MS)
            g2 = c.barrier("meet", parties, timeout_ms=WAIT_MS)
            with lock:
                gens.append((g1, g2))
        finally:
            c.close()

    threads = [threading.Thread(target=arrive) for _ in range(parties)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert gens == [(1, 2)] * parties


def test_barrier_bad(client):
    with pytest.raises(tensorshare.InvalidArgumentError):
        client.barrier("b", 0, timeout_ms=0)
    with pytest.raises(tensorshare.TimeoutError):
        client.barrier("b", 2, timeout_ms=100)
    assert client.barrier("solo", 1) == 1


U64 = "from 0 to 2**64-1"
COUNT = "max_items must be an int from 0 to 9223372036854775807"
MS = "timeout_ms must be an int from 0 to 2147483647"


@pytest.mark.parametrize("call, error, message", [
    pytest.param(lambda c: c.barrier("b", 2**32 + 1, timeout_ms=100), ValueError,
                 "parties must be an int from 0 to 4294967295, not 4294967297", id="parties"),
    pytest.param(lambda c: c.barrier("b", -1, timeout_ms=100), ValueError,
                 "parties must be an int from 0 to 4294967295, not -1", id="parties_neg"),
    pytest.param(lambda c: c.barrier("b", True, timeout_ms=100), TypeError,
                 "parties must be an int, not bool", id="parties_bool"),
    pytest.param(lambda c: c.barrier("b", 1, timeout_ms=2**31), ValueError, MS,
                 id="barrier_wait"),
    pytest.param(lambda c: c.put_if("p", 2**64, 1), ValueError,
                 "expected_version must be an int %s, not 18446744073709551616" % U64,
                 id="expected"),
    pytest.param(lambda c: c.put_if("p", -1, 1), ValueError,
                 "expected_version must be an int %s, not -1" % U64, id="expected_neg"),
    pytest.param(lambda c: c.put_if("p", 0.0, 1), TypeError,
                 "expected_version must be an int, not float", id="expected_float"),
    pytest.param(lambda c: c.add("n", -2**63 - 1), ValueError,
                 "delta must be an int from -2**63 to 2**63-1, not -9223372036854775809",
                 id="delta"),
    pytest.param(lambda c: c.add("n", 2**64 + 1), ValueError,
                 "delta must be an int from -2**63 to 2**63-1", id="delta_big"),
    pytest.param(lambda c: c.add("n", 1.5), TypeError, "delta must be an int, not float",
                 id="delta_float"),
    pytest.param(lambda c: c.take("q", -1, 0), ValueError, COUNT + ", not -1", id="take"),
    pytest.param(lambda c: c.take("q", 2**63, 0), ValueError, COUNT, id="take_big"),
    pytest.param(lambda c: c.take("q", 1, -1), ValueError, MS + ", not -1", id="take_wait"),
    pytest.param(lambda c: c.take("q", 1, True), TypeError, "timeout_ms must be an int, not bool",
                 id="take_wait_bool"),
    pytest.param(lambda c: c.mget(["p"], -1), ValueError, COUNT + ", not -1", id="mget"),
    pytest.param(lambda c: c.mget(["p"], 2**64), ValueError, COUNT, id="mget_big"),
])
def test_out_of_range_ints_are_refused(client, call, error, message):
    """An int that does not fit its argument raises, naming it, and changes nothing: it is never
    cut to fit (barrier parties 2**32 + 1 taken as 1, put_if's 2**64 as 0)."""
    client.append("q", 7)
    with pytest.raises(error, match=re.escape(message)):
        call(client)
    assert client.list().keys() == {"q"}
    assert client.peek("q") == [7]
