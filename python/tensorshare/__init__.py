"""tensorshare: share tensors between programs through the tensord daemon.

    import tensorshare
    with tensorshare.Client("127.0.0.1:8000") as c:
        c.put("weights", {"w": torch.ones(4, 4), "version": 7})
        [item] = c.get("weights")

See README.md ("From Python") and docs/PYTHON.md.
"""
import os as _os

from ._tensorshare import (  # noqa: F401
    MAX_DEPTH,
    MAX_NAME_LEN,
    MAX_NDIM,
    STREAM_READ_MAX,
    AuthenticationError,
    BackpressureError,
    BinInfo,
    BinNotFoundError,
    CancelledError,
    Client,
    ConnectionError,
    ConnectionRefusedError,
    ConnectionResetError,
    DeadlockError,
    Error,
    InvalidArgumentError,
    Notification,
    RecordError,
    ServerError,
    ServiceGoneError,
    SharedBuffer,
    StaleGradientError,
    TimeoutError,
    VersionMismatchError,
    __version__,
)
from . import _tensorshare  # noqa: E402


def _fail_the_parents_futures():
    # In a child process after os.fork(): the futures of requests that were in flight belong to
    # the parent, whose I/O thread (the only one that completes them) does not exist here, so
    # their result() would wait forever. They fail with ConnectionError instead. The parent's
    # threads are gone too: one of them may have held a future's lock at the fork, and the
    # waiters and done-callbacks registered before the fork are the parent's, not to be run
    # here: each future gets a fresh lock and drops them before it completes.
    import threading

    for future, exc in _tensorshare._take_pending_futures():
        future._condition = threading.Condition()
        future._waiters = []
        future._done_callbacks = []
        try:
            future.set_exception(exc)
        except Exception:  # noqa: BLE001 - a future of another shape: leave it as it is
            pass


_os.register_at_fork(after_in_child=_fail_the_parents_futures)

from .predictor import Predictor  # noqa: E402,F401
from .rl import NO_FILTER, Batch, Params, RLTrainer, RLWorker  # noqa: E402,F401
from .service import Service  # noqa: E402,F401
from .stream import StreamConsumer, StreamEntries, StreamEntry, StreamProducer  # noqa: E402,F401

__all__ = [
    "Client", "BinInfo", "Notification", "Error", "TimeoutError", "ConnectionError",
    "ConnectionResetError", "ConnectionRefusedError", "BinNotFoundError", "RecordError",
    "InvalidArgumentError", "AuthenticationError", "CancelledError", "DeadlockError",
    "ServerError", "SharedBuffer", "numpy_bfloat16", "MAX_NDIM", "MAX_DEPTH", "MAX_NAME_LEN",
    "__version__",
    "RLTrainer", "RLWorker", "Params", "Batch", "NO_FILTER", "Predictor",
    "BackpressureError", "StreamProducer", "StreamConsumer", "StreamEntry", "StreamEntries",
    "STREAM_READ_MAX", "VersionMismatchError", "StaleGradientError",
    "ServiceGoneError", "Service",
]


def __getattr__(name):
    # numpy has no bfloat16: received bfloat16 tensors become arrays of this structured dtype
    # (the raw 16 bits in a field named "bfloat16"), which put() sends back as bfloat16. Made on
    # first use so that importing tensorshare does not import numpy.
    if name == "numpy_bfloat16":
        import numpy

        dt = numpy.dtype([("bfloat16", "<u2")])
        globals()["numpy_bfloat16"] = dt
        return dt
    raise AttributeError("module 'tensorshare' has no attribute %r" % name)
