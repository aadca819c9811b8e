"""tensorshare: share tensors between programs through the tensord daemon.

    import tensorshare
    with tensorshare.Client("127.0.0.1:8000") as c:
        c.put("weights", {"w": torch.ones(4, 4), "version": 7})
        [item] = c.get("weights")

See README.md ("From Python") and docs/PYTHON.md.
"""
from ._tensorshare import (  # noqa: F401
    MAX_DEPTH,
    MAX_NAME_LEN,
    MAX_NDIM,
    AuthenticationError,
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
    TimeoutError,
    __version__,
)
