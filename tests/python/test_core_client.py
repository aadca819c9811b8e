"""tensorshare.Client at the edges: arguments with NUL characters, and what a get that took
items out of a bin does when their conversion fails."""
import os
import socket
import threading

import pytest
import torch

import tensorshare


def test_nul_in_token_or_address_is_refused(tensord):
    with pytest.raises(ValueError):
        tensorshare.Client(tensord.address, token="s3cret\0ignored")
    with pytest.raises(ValueError):
        tensorshare.Client(tensord.address + "\0junk")


class RefuseViews:
    """A torch function mode under which Tensor.view raises: received bool tensors (uint8 bytes
    viewed as bool) then cannot be made, after a get has taken them out of the bin."""

    def __init__(self):
        from torch.overrides import TorchFunctionMode

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if func is torch.Tensor.view:
                    raise RuntimeError("no views today")
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def __enter__(self):
        return self.mode.__enter__()

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def on_io_thread(client, fn):
    """Runs fn on the client's I/O thread (torch function modes are per thread), from the
    completion of a future that completes there half a second later."""
    done = threading.Event()

    def run(_future):
        fn()
        done.set()

    client.wait_async("io-thread-never", 0, timeout=0.5).add_done_callback(run)
    assert done.wait(10)


def fill(client, name):
    client.append(name, {"n": 1})
    client.append(name, {"n": 2, "flags": torch.tensor([True, False])})
    client.append(name, {"n": 3, "t": torch.arange(3)})


@pytest.mark.parametrize("form", ["blocking", "future"])
def test_get_whose_conversion_fails_hands_over_what_it_took(client, form):
    """A get takes the items out of the bin before they are converted: when a conversion fails,
    the exception carries every item it took (None where one could not be made), in order."""
    fill(client, "g")
    refuse = RefuseViews()
    if form == "blocking":
        with refuse:
            with pytest.raises(RuntimeError, match="no views today") as info:
                client.get("g")
    else:  # converted on the I/O thread: the mode must be active there
        on_io_thread(client, refuse.__enter__)
        try:
            with pytest.raises(RuntimeError, match="no views today") as info:
                client.get_async("g").result(10)
        finally:
            on_io_thread(client, lambda: refuse.__exit__(None, None, None))
    items = info.value.items
    assert len(items) == 3 and items[1] is None
    assert items[0] == {"n": 1}
    assert items[2]["n"] == 3 and items[2]["t"].tolist() == [0, 1, 2]
    assert any("took 3 items" in note for note in info.value.__notes__)
    assert "g" not in client.list()  # they are out of the bin, as the exception says


def test_peek_whose_conversion_fails_leaves_the_bin_alone(client):
    fill(client, "p")
    with RefuseViews():
        with pytest.raises(RuntimeError, match="no views today"):
            client.peek("p")
    assert client.list()["p"].n_items == 3
    assert [x["n"] for x in client.get("p")] == [1, 2, 3]


def test_out_of_range_counts_and_versions_are_value_errors(client):
    """Bad values are ValueError (not OverflowError), for the blocking and the future forms."""
    client.put("r", 1)
    for call in (lambda: client.wait("r", -1, timeout=0), lambda: client.wait_async("r", -1),
                 lambda: client.wait("r", 2**64, timeout=0),
                 lambda: client.get("r", 2**64), lambda: client.peek_async("r", -5)):
        with pytest.raises(ValueError):
            call()
    with pytest.raises(TypeError):
        client.wait("r", 1.5, timeout=0)
    assert client.peek("r") == [1]


FORK_FUTURE_SCRIPT = """
import os, sys, time
import tensorshare
c = tensorshare.Client(sys.argv[1])
pending = c.wait_async("never", 0)  # still pending when the process forks
done = c.ping_async()
done.result(10)
pid = os.fork()
if pid == 0:
    code = 0
    t0 = time.monotonic()
    try:
        pending.result(5)
        code = 3
    except tensorshare.ConnectionError as e:
        code = 0 if "fork" in str(e) and time.monotonic() - t0 < 4 else 4
    except BaseException:
        code = 5  # concurrent.futures.TimeoutError: it would have waited forever
    os._exit(code if done.result(0) is None else 6)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status), "parent pending", pending.done(), flush=True)
c.close()
print("after close", type(pending.exception(10)).__name__, flush=True)
"""


def test_a_parents_pending_future_fails_in_the_child(tensord):
    """A future still pending when the process forks is completed in the child with
    ConnectionError (the parent's I/O thread, which would complete it, does not exist there);
    the parent's future is untouched."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.environ.get("TS_PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", FORK_FUTURE_SCRIPT, tensord.address],
                       capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["child", "0", "parent", "pending", "False", "after", "close",
                                "CancelledError"]


def test_token_file_too_long_is_refused(tensord, tmp_path):
    """A token file longer than the client reads is refused, not cut short silently."""
    path = tmp_path / "token"
    path.write_text("t" * 5000 + "\n")
    with pytest.raises(ValueError, match="token"):
        tensorshare.Client(tensord.address, token_file=str(path))


def test_calls_leak_no_python_objects(client):
    """Every path through the extension (results, errors, futures, refused records, listeners)
    gives back the Python objects it made: the traced blocks do not grow with the calls."""
    import gc
    import tracemalloc

    import numpy as np

    from tensorshare import _tensorshare

    rec = {"a": np.arange(64, dtype=np.float32), "b": np.zeros((2, 3), np.int8)[:, ::2],
           "s": "text", "y": b"bytes", "l": [1, 2.5, (3,)],
           "bf": np.zeros(2, tensorshare.numpy_bfloat16)}

    def round_trip(i):
        client.put("leak", rec)
        client.append("leak", rec)
        client.peek("leak", tensor_type="numpy")
        client.get("leak", 1, tensor_type="numpy")
        client.put_async("leak", rec).result(10)
        client.get_async("leak", tensor_type="numpy").result(10)
        for bad in (lambda: client.get("leak-missing"), lambda: client.put("x", {"n": None}),
                    lambda: client.put("x", {1: 2}), lambda: client.wait("x", -1),
                    lambda: client.peek_async("leak-missing").result(10)):
            try:
                bad()
            except (tensorshare.Error, ValueError):
                pass
        client.put("leak-w", i)
        client.wait("leak-w", 0, timeout=0)
        client.list()
        client.stats()
        client.listen("leak-l", lambda n: None)
        client.unlisten("leak-l")

    for i in range(50):  # warm up caches (imports, interned names, numpy's dtype caches)
        round_trip(i)
    gc.collect()
    views = _tensorshare._live_views()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        rounds = 300
        for i in range(rounds):
            round_trip(i)
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    # A reference leaked on any path leaks at least one block per round; caches settle below.
    grown = sum(s.count_diff for s in after.compare_to(before, "filename") if s.count_diff > 0)
    assert grown < rounds, [str(s) for s in after.compare_to(before, "traceback")[:3]]
    assert _tensorshare._live_views() == views


def test_a_unix_socket_this_user_may_not_open_is_a_permission_error(tmp_path):
    """EACCES from connect() (the socket file's mode) is AuthenticationError, a PermissionError,
    whose message says the permission is missing. As root it is tried by a child made nobody."""
    path = str(tmp_path / "s.sock")
    os.chmod(tmp_path, 0o755)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        srv.bind(path)
        srv.listen(4)
        os.chmod(path, 0)

        def attempt():
            try:
                tensorshare.Client("unix:" + path, timeout=5)
            except tensorshare.AuthenticationError as e:
                ok = isinstance(e, PermissionError) and e.name == "EACCES"
                return "ok" if ok and "permission denied connecting to" in e.message else repr(e)
            return "opened"

        if os.geteuid() != 0:
            assert attempt() == "ok"
            return
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.setgid(65534)
                os.setuid(65534)
                os.write(w, attempt().encode())
            finally:
                os._exit(0)
        os.close(w)
        with os.fdopen(r) as f:
            got = f.read()
        os.waitpid(pid, 0)
        assert got == "ok"
    finally:
        srv.close()
