"""The original tensorshare's Python API (TensorShare, RLTrainer, RLWorker) over tensord.

Programs written for the original package (github.com/ColorDiff/tensorshare) run with only their
import line changed::

    from tensorshare.compat import TensorShare      # was: from tensorshare import TensorShare

The names, arguments and callback messages are the original's; underneath, every call is a
request of one tensorshare.Client. docs/PYTHON.md ("Compatibility layer") lists what is covered
and where the behaviour differs. In short:

- Callbacks receive one dict, as before: ``{'status': 'OK', ...}`` or ``{'status': 'ERR',
  'msg': '<prefix>: <repr of the exception>'}``, with the original's prefixes ("Failed to put
  data", "Failed to retrieve data", ...). They run on the thread that called start(), one at a
  time and in completion order, like the original's reactor; results that arrive before start()
  runs wait for it.
- put and append report OK once tensord has stored the item (the original reported OK once the
  bytes were sent, and never saw a failure after that).
- Values are tensorshare records: torch tensors, NumPy arrays, dicts with str keys, lists,
  tuples (received as lists), ints, bools (received as ints), floats, str and bytes, nested.
  Anything else (None, arbitrary picklable objects) is refused: the callback gets ERR with the
  RecordError. Nothing is pickled, and tensord never unpickles anything.
- A bin holds items. get/peek give the item itself when the bin holds one, and the list of its
  items otherwise; the original's quirk that an append to a bin holding a list extends that
  list is not reproduced (put(b, [1, 2]); append(b, 3) gives [[1, 2], 3]).
- listen() returns once tensord confirmed the subscription (no change can be missed after it),
  and the connection is re-established after a loss instead of hanging.
"""
import queue
import threading
import time

from . import Client, numpy_bfloat16

__all__ = ["TensorShare", "RLTrainer", "RLWorker", "run_server"]

# Seconds that stop() lets the requests made before it finish, so that their callbacks run
# (the original's QUIT came after them on its serial connection). A request never takes longer
# than the client's request timeout, so this only bounds a server that stopped answering.
_STOP_DRAIN_S = 35.0


def _to_torch(obj):
    """Tensors as torch tensors (the original's torch.load gave torch objects), recursively."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is optional for the compat layer
        return obj
    import numpy as np

    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, np.ndarray):
        if obj.dtype == numpy_bfloat16:
            # The raw 16 bits of each bfloat16, reinterpreted (no copy).
            return torch.from_numpy(obj.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {k: _to_torch(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_torch(v) for v in obj]
    return obj


class TensorShare:
    """A connection to a tensord with the original TensorShare's interface.

    Args:
        host (str): the host of the tensord server ("localhost", "127.0.0.1", ...).
        port (int): its TCP port.

    The connection is made here (the original connected in start()): a server that cannot be
    reached raises tensorshare.ConnectionError at once instead of hanging in start().
    """

    STATUS_OK = "OK"
    STATUS_ERR = "ERR"

    def __init__(self, host, port, **client_kwargs):
        self._host = host
        self._port = port
        self._client = Client("%s:%d" % (host, int(port)), **client_kwargs)
        self._events = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._outstanding = 0
        self._listener_cbs = {}
        self._subscribed = set()
        self._running = False
        self._started = False
        self._stopping = False
        self._closed = False

    # -- requests -----------------------------------------------------------------------------

    def _submit(self, start, prefix, callback, convert=None):
        """Run start() (which returns a Future) and deliver its outcome to callback."""
        if callback is None:
            callback = self._cb_pass
        with self._lock:
            if self._closed:
                raise RuntimeError("TensorShare: stopped")
            self._outstanding += 1
        try:
            fut = start()
        except Exception as e:  # conversion errors and a closed client surface here
            self._events.put((self._deliver_error, (callback, prefix, e)))
            return
        fut.add_done_callback(lambda f: self._events.put((self._deliver, (f, callback, prefix,
                                                                           convert))))

    def _deliver(self, fut, callback, prefix, convert):
        exc = fut.exception()
        if exc is not None:
            self._deliver_error(callback, prefix, exc)
            return
        msg = {"status": self.STATUS_OK}
        if convert is not None:
            try:
                msg["data"] = convert(fut.result())
            except Exception as e:
                self._deliver_error(callback, "Failed to decode response", e)
                return
        self._finish(callback, msg)

    def _deliver_error(self, callback, prefix, exc):
        self._finish(callback, {"status": self.STATUS_ERR, "msg": "%s: %r" % (prefix, exc)})

    def _finish(self, callback, msg):
        try:
            callback(msg)
        finally:
            with self._lock:
                self._outstanding -= 1

    @staticmethod
    def _bin_content(items):
        items = list(items)
        if len(items) == 1:
            return _to_torch(items[0])
        return [_to_torch(v) for v in items]

    def put(self, bin, obj, callback=None):
        """Replace the bin's content with obj; callback({'status': 'OK'}) once tensord holds it."""
        self._submit(lambda: self._client.put_async(bin, obj), "Failed to put data", callback)

    def append(self, bin, obj, callback=None):
        """Add obj to the bin (creating it); callback({'status': 'OK'}) once tensord holds it."""
        self._submit(lambda: self._client.append_async(bin, obj), "Failed to append data",
                     callback)

    def get(self, bin, callback):
        """Take and remove everything in the bin: {'status': 'OK', 'data': obj or [items]}."""
        self._submit(lambda: self._client.get_async(bin), "Failed to retrieve data", callback,
                     self._bin_content)

    def peek(self, bin, callback):
        """Like get, but the bin keeps its content."""
        self._submit(lambda: self._client.peek_async(bin), "Failed to retrieve data", callback,
                     self._bin_content)

    def list(self, callback):
        """Every bin with its item count: {'status': 'OK', 'data': {bin: n_items}}."""
        self._submit(self._client.list_async, "Failed to list data", callback, _bin_counts)

    def delete(self, bin, callback=None):
        """Remove the bin; a missing bin is not an error."""
        self._submit(lambda: self._client.delete_async(bin), "Failed to delete data", callback)

    def listen(self, bin, callback):
        """Call callback({'status': 'OK', 'bin': bin, 'n_items': n}) after every change of bin.

        One callback per bin: listening again replaces it. Success is not reported (as in the
        original); a failure calls callback once with ERR. Unlike the original, this returns
        once tensord has confirmed the subscription, so no later change is missed.
        """
        with self._lock:
            self._listener_cbs[bin] = callback
            fresh = bin not in self._subscribed
            self._subscribed.add(bin)
            if fresh:
                self._outstanding += 1
        if not fresh:
            return
        try:
            self._client.listen(bin, lambda *note: self._events.put((self._notified, note)))
        except Exception as e:
            with self._lock:
                self._subscribed.discard(bin)
                if self._listener_cbs.get(bin) is callback:
                    del self._listener_cbs[bin]
            self._events.put((self._deliver_error,
                              (callback, "Failed to register as listener", e)))
            return
        with self._lock:
            self._outstanding -= 1

    def ignore(self, bin, callback=None):
        """Stop the notifications of bin; ERR when it was not listened to."""
        if callback is None:
            callback = self._cb_pass
        with self._lock:
            self._listener_cbs.pop(bin, None)
            listening = bin in self._subscribed
            self._subscribed.discard(bin)
            self._outstanding += 1
        try:
            if not listening:
                raise KeyError(bin)
            self._client.unlisten(bin)
        except Exception as e:
            self._events.put((self._deliver_error,
                              (callback, "Failed to unregister as listener", e)))
            return
        self._events.put((self._finish, (callback, {"status": self.STATUS_OK})))

    def _notified(self, *note):
        info = _notification(note)
        if info is None:
            return
        bin, n_items = info
        cb = self._listener_cbs.get(bin)
        if cb is not None:
            cb({"status": self.STATUS_OK, "bin": bin, "n_items": n_items})

    # -- running ------------------------------------------------------------------------------

    def start(self):
        """Run the callbacks on this thread until stop(), then close the connection.

        Blocks like the original's start(). After stop(), it keeps running the callbacks of the
        requests made before stop() until they have all completed (at most about the client's
        request timeout), then returns.
        """
        with self._lock:
            if self._started:
                raise RuntimeError("TensorShare.start() may be called once")
            self._started = True
            self._running = True
        try:
            deadline = None
            while True:
                with self._lock:
                    if self._stopping and self._outstanding == 0:
                        break
                if self._stopping and deadline is None:
                    deadline = time.monotonic() + _STOP_DRAIN_S
                if deadline is not None and time.monotonic() > deadline:
                    break
                try:
                    fn, args = self._events.get(timeout=0.1 if self._stopping else 1.0)
                except queue.Empty:
                    continue
                if fn is None:
                    continue
                fn(*args)
        finally:
            self._running = False
            self._close()

    def stop(self):
        """End start(): the requests made so far complete (their callbacks run), then it returns.

        Safe to call from any thread and from callbacks, and more than once. When start() is not
        running, the connection is closed here.
        """
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            running = self._running
        self._events.put((None, ()))
        if not running and not self._started:
            self._close()

    def _close(self):
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._client.close()

    @staticmethod
    def _cb_pass(_msg):
        pass


def _bin_counts(listing):
    """{name: n_items} from Client.list()'s answer."""
    if isinstance(listing, dict):
        return {name: _n_items(info) for name, info in listing.items()}
    return {_field(info, "name"): _n_items(info) for info in listing}


def _field(obj, name):
    if isinstance(obj, dict):
        return obj[name]
    return getattr(obj, name)


def _n_items(info):
    if isinstance(info, int):
        return info
    return _field(info, "n_items")


def _notification(note):
    """(bin, n_items) of a change from Client.listen's callback, or None for other events."""
    n = note[-1] if note else None
    if n is None:
        return None
    event = _field(n, "event") if not isinstance(n, tuple) else None
    if isinstance(event, str) and event not in ("put", "append", "get", "delete"):
        return None
    if isinstance(event, int) and event >= 100:
        return None
    return _field(n, "bin"), _field(n, "n_items")


def run_server(port, start_reactor=True, tensord=None):
    """Start tensord on port (the original's run_server ran its FTP server in this process).

    tensord is the path of the daemon (default: $TS_TENSORD, else "tensord" on PATH). With
    start_reactor=True this blocks until the daemon ends; otherwise it returns the
    subprocess.Popen, which the caller stops (terminate(), then wait()).
    """
    import os
    import shutil
    import subprocess

    path = tensord or os.environ.get("TS_TENSORD") or shutil.which("tensord") or "tensord"
    proc = subprocess.Popen([path, "--port", str(int(port))])
    if not start_reactor:
        return proc
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        return proc.wait()


class _Runner:
    """start()/stop() of the original RL classes: start() blocks until stop()."""

    def __init__(self, host, port, host_server):
        self._server = None
        if host_server:
            self._server = _host_server(port)
        self._client = Client("%s:%d" % (host, int(port)))
        self._stopped = threading.Event()
        self._closed = False
        self._lock = threading.Lock()

    def start(self):
        """Block until stop() (the original ran its reactor here)."""
        self._stopped.wait()

    def _close_helper(self):
        pass

    def stop(self):
        """Release start() and close the connection (and the hosted server). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stopped.set()
        try:
            self._close_helper()
        finally:
            self._client.close()
            if self._server is not None:
                self._server.terminate()
                self._server.wait()


def _host_server(port):
    """tensord on port, started for host_server=True, once it accepts connections."""
    import socket

    proc = run_server(port, start_reactor=False)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", int(port)), timeout=1).close()
            return proc
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.02)
    proc.terminate()
    proc.wait()
    raise RuntimeError("host_server: tensord did not start on port %d" % int(port))


class RLTrainer(_Runner):
    """The original RLTrainer over tensorshare.RLTrainer.

    publish_parameters waits until tensord holds the parameters and returns their version
    (the original returned before sending). get_data never blocks: it takes what the workers
    added so far. With filter_version=True, experience made with older parameters than the
    newest published is dropped when read (staleness tolerance 0); with False everything is
    kept. Versions continue after the one found in the parameters bin when the trainer starts.
    """

    def __init__(self, host, port, host_server, filter_version=True):
        super().__init__(host, port, host_server)
        from .rl import NO_FILTER, RLTrainer as _Trainer

        self._trainer = _Trainer(self._client,
                                 staleness_tolerance=0 if filter_version else NO_FILTER)

    def publish_parameters(self, p):
        """Publish p (typically a state dict) as the next version; returns the version."""
        return self._trainer.publish(p)

    def get_data(self, return_versions=False):
        """Everything added since the last call (after the version filter); never blocks."""
        from . import TimeoutError as _Timeout

        try:
            batch = self._trainer.collect(0, timeout=0)
        except _Timeout:
            return ([], []) if return_versions else []
        data = [_to_torch(d) for d in batch.data]
        return (data, list(batch.versions)) if return_versions else data

    def _close_helper(self):
        self._trainer.close()


class RLWorker(_Runner):
    """The original RLWorker over tensorshare.RLWorker.

    get_parameters() answers locally (None before the first publish).
    await_new_parameters(timeout) waits for parameters newer than the ones last retrieved and
    returns the newest parameters either way, as the original did (use tensorshare.RLWorker's
    await_params to tell a timeout from an update). add_data sends {data, version} without
    waiting for tensord.
    """

    def __init__(self, host, port, host_server=False):
        super().__init__(host, port, host_server)
        from .rl import RLWorker as _Worker

        self._worker = _Worker(self._client)

    def get_parameters(self):
        """The newest parameters received, or None; marks them as retrieved."""
        p = self._worker.params()
        return None if p is None else _to_torch(p.value)

    def await_new_parameters(self, timeout=None):
        """Wait up to timeout seconds (None: no limit) for newer parameters; the newest."""
        from . import TimeoutError as _Timeout

        try:
            return _to_torch(self._worker.await_params(timeout=timeout).value)
        except _Timeout:
            return self.get_parameters()

    def add_data(self, data):
        """Append {data, version} to the data bin without waiting for tensord."""
        self._worker.add(data)

    def _close_helper(self):
        self._worker.close()
