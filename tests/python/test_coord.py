"""Coordination primitives from Python: Client.add (counters, threads adding at once end at the
exact sum), put_if (one winner per version, VersionMismatchError with current_version), take
(first come first served, each item once, TimeoutError), mget (present and missing bins) and
barrier (threads released together with a generation, reusable), and bad inputs mapped to the
module's exceptions. Every wait is bounded by a timeout_ms."""
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
