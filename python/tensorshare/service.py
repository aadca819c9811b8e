"""Services: serve a named service from Python (Client.serve) and call it (Client.call).

Threading: the library hands each call to a C callback on the client's I/O thread, which only
queues it (without the GIL) and returns. ``workers`` Python threads (daemon threads, started by
``Service``) take calls from that queue, run ``handler(request)`` with the GIL like any Python
code, and answer. A handler may therefore block, and may call other tensorshare methods (even
``Client.call`` on the same client). An exception in the handler answers the call with an error:
a ``tensorshare.Error`` with its ``code`` and ``message`` (a code with no wire status, such as
ECANCELED, arrives as TS_ESERVER), another ``ValueError`` as ``InvalidArgumentError`` (TS_EINVAL),
anything else as ``ServerError`` (TS_ESERVER) with ``str(exception)`` as the message.
"""
import operator
import threading

from . import _tensorshare

__all__ = ["Service"]

# The TS_E* codes (include/tensorshare/tensorshare.h) a failing handler answers with.
_EINVAL = _tensorshare._TS_EINVAL
_ESERVER = _tensorshare._TS_ESERVER


# seconds; how long a worker waits for a call before it checks whether the service was closed
_POLL_S = 0.1


def _int_arg(value, what):
    """value as an int: an int or another object with __index__ (a NumPy integer), never a bool
    or a float (TypeError), as the extension takes its int arguments."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError("%s must be an int, not %s" % (what, type(value).__name__))
    return operator.index(value)


class Service:
    """This client serving ``name``: ``handler(request) -> answer`` runs on ``workers`` threads.

    Use as a context manager or call ``close()``: the registration ends first (tensord confirms;
    it hands no more calls to this server), then the workers answer every call already handed to
    it. The Client stays open (its close() takes effect) until the Service is closed.
    """

    def __init__(self, client, name, handler, concurrency=64, workers=None):
        if not callable(handler):
            raise TypeError("handler must be callable")
        concurrency = _int_arg(concurrency, "concurrency")
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        workers = min(concurrency, 8) if workers is None else _int_arg(workers, "workers")
        if workers < 1:
            raise ValueError("workers must be at least 1")
        self.name = name
        self._handler = handler
        self._stop = threading.Event()
        self._close_lock = threading.Lock()
        self._handle = client._serve(name, concurrency)
        self._threads = [threading.Thread(target=self._run, daemon=True,
                                          name="tensorshare-service-%s-%d" % (name, i))
                         for i in range(workers)]
        for t in self._threads:
            t.start()

    def _run(self):
        h = self._handle
        while True:
            # Read before next(): close() closes the queue before it sets _stop, so a None from a
            # next() called once stopping means that every call handed was taken.
            stopping = self._stop.is_set()
            try:
                got = h.next(_POLL_S)
            except Exception:  # a request that could not be converted: already answered
                continue
            if got is None:
                if stopping:
                    return
                continue
            call, request = got
            try:
                answer = self._handler(request)
            except _tensorshare.Error as e:
                # Before ValueError: RecordError and InvalidArgumentError keep their own code.
                # message, not str(e): a KeyError's str (BinNotFoundError) quotes it.
                h.fail(call, getattr(e, "code", 0) or _ESERVER,
                       getattr(e, "message", None) or str(e) or type(e).__name__)
                continue
            except ValueError as e:
                h.fail(call, _EINVAL, str(e) or type(e).__name__)
                continue
            except BaseException as e:  # noqa: B902 - any failure answers the caller
                h.fail(call, _ESERVER, str(e) or type(e).__name__)
                continue
            try:
                h.reply(call, answer)
            except Exception as e:  # an answer that cannot be sent (unsupported value)
                try:
                    h.fail(call, _EINVAL, "the handler's answer: %s" % e)
                except Exception:
                    pass

    def close(self):
        """Stop serving; return once the workers have answered the calls handed to this server."""
        with self._close_lock:
            if self._stop.is_set():
                return
            # The registration goes first, so that tensord hands new calls to the service's
            # other servers (or keeps them waiting) rather than to this one; then the workers
            # answer the calls already handed, and the Client may be closed.
            self._handle.unregister()
            self._stop.set()
            for t in self._threads:
                if t is not threading.current_thread():
                    t.join()
            self._handle.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def serve(client, service=None, handler=None, concurrency=64, workers=None, *, name=None):
    """Client.serve(service, handler, concurrency=64, workers=None): see Service.

    ``name=`` is accepted as another spelling of ``service=``.
    """
    if name is not None:
        if service is not None:
            raise TypeError("serve() got both service and name")
        service = name
    if service is None or handler is None:
        raise TypeError("serve() needs service and handler")
    return Service(client, service, handler, concurrency, workers)
