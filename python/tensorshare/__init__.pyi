"""Type stubs of the tensorshare package's core (the Client, its results and its errors)."""
import builtins
from concurrent.futures import Future
from typing import Any, Callable, Dict, List, Literal, Optional, Sequence, Tuple, Union, final

import numpy
from _typeshed import structseq

__version__: str
MAX_NDIM: int
MAX_DEPTH: int
MAX_NAME_LEN: int
STREAM_READ_MAX: int
numpy_bfloat16: numpy.dtype

TensorType = Literal["torch", "numpy"]
# What a record may hold: dict (str keys), list, tuple (received as a list), int, float, str,
# bytes, and tensors (torch.Tensor, numpy.ndarray, numpy scalars, __dlpack__ objects).
Record = Any
Event = Literal["put", "append", "get", "delete", "rows", "disconnected", "resubscribed", "error"]

class Error(Exception):
    code: int
    name: str
    message: str

class TimeoutError(Error, builtins.TimeoutError): ...
class ConnectionError(Error, builtins.ConnectionError): ...
class ConnectionResetError(ConnectionError, builtins.ConnectionResetError): ...
class ConnectionRefusedError(ConnectionError, builtins.ConnectionRefusedError): ...
class BinNotFoundError(Error, KeyError): ...
class RecordError(Error, ValueError): ...
class InvalidArgumentError(Error, ValueError): ...
class AuthenticationError(Error, PermissionError): ...
class CancelledError(Error): ...
class DeadlockError(Error, RuntimeError): ...
class ServerError(Error): ...
class BackpressureError(Error, builtins.BlockingIOError): ...
class ServiceGoneError(Error): ...

class VersionMismatchError(Error):
    # The bin's version when raised by put_if; None on an instance made by the program.
    current_version: Optional[int]

class StaleGradientError(Error):
    # The parameter's version when raised by ps_push; None on an instance made by the program.
    current_version: Optional[int]

# BinInfo and Notification are struct sequences (like os.stat_result): tuples whose items also
# have names; they have no _fields, _asdict or _replace (they are not named tuples).
@final
class BinInfo(structseq[int], Tuple[int, int, int]):
    @property
    def n_items(self) -> int: ...
    @property
    def bytes(self) -> int: ...
    @property
    def version(self) -> int: ...

@final
class Notification(
    structseq[Any], Tuple[str, Event, int, int, bool, Optional[Error]]
):
    @property
    def bin(self) -> str: ...
    @property
    def event(self) -> Event: ...
    @property
    def version(self) -> int: ...
    @property
    def n_items(self) -> int: ...
    @property
    def coalesced(self) -> bool: ...
    @property
    def error(self) -> Optional[Error]: ...

class SharedBuffer:
    """A record in shared memory (Client.shared): fill its tensors in place, then commit it with
    Client.put_shared or Client.append_shared. Keys index the root (str for a map, int for a
    list; a tuple is a path)."""

    @property
    def value(self) -> Record: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def committed(self) -> bool: ...
    def keys(self) -> List[str]: ...
    def __getitem__(self, key: Union[str, int, Tuple[Union[str, int], ...]]) -> Record: ...
    def __len__(self) -> int: ...
    def close(self) -> None: ...
    def __enter__(self) -> "SharedBuffer": ...
    def __exit__(self, *exc: object) -> None: ...

class Client:
    def __init__(
        self,
        address: str = "127.0.0.1:8000",
        *,
        token: Optional[str] = None,
        token_file: Optional[str] = None,
        timeout: Optional[float] = None,
        connect_timeout: Optional[float] = None,
        tensor_type: Optional[TensorType] = None,
    ) -> None: ...
    @property
    def closed(self) -> bool: ...
    @property
    def connected(self) -> bool: ...
    @property
    def address(self) -> str: ...
    @property
    def tensor_type(self) -> TensorType: ...
    def put(self, bin: str, value: Record) -> int: ...
    def append(self, bin: str, value: Record) -> int: ...
    def get(
        self,
        bin: str,
        max_items: int = 0,
        *,
        tensor_type: Optional[TensorType] = None,
        ref: bool = False,
    ) -> List[Record]: ...
    def peek(
        self,
        bin: str,
        max_items: int = 0,
        *,
        tensor_type: Optional[TensorType] = None,
        ref: bool = False,
    ) -> List[Record]: ...
    def shared(self, layout: Any, *, tensor_type: Optional[TensorType] = None) -> "SharedBuffer": ...
    def put_shared(self, bin: str, buffer: "SharedBuffer", /) -> int: ...
    def append_shared(self, bin: str, buffer: "SharedBuffer", /) -> int: ...
    def create_tensor_bin(self, bin: str, dtype: Any, shape: Sequence[int]) -> int: ...
    def read_rows(
        self,
        bin: str,
        start: int,
        end: int,
        *,
        item: int = 0,
        key: Optional[str] = None,
        tensor_type: Optional[TensorType] = None,
    ) -> Any: ...
    def gather_rows(
        self,
        bin: str,
        index: Any,
        *,
        item: int = 0,
        key: Optional[str] = None,
        tensor_type: Optional[TensorType] = None,
    ) -> Any: ...
    def write_rows(self, bin: str, start: int, rows: Any) -> int: ...
    def delete(self, bin: str) -> int: ...
    def call(self, service: str, request: Record, timeout: Optional[float] = ...,
             wait_for_server: bool = ..., *, tensor_type: Optional[TensorType] = ...) -> Any: ...
    def serve(self, service: str, handler: Callable[[Any], Record], concurrency: int = ...,
              workers: Optional[int] = ...) -> "Service": ...
    def list(self) -> Dict[str, BinInfo]: ...
    def wait(
        self, bin: str, after_version: int = 0, timeout: Optional[float] = None
    ) -> Tuple[int, int]: ...
    def stats(self) -> Dict[str, int]: ...
    def ping(self) -> None: ...
    def save(self) -> None: ...
    def listen(self, bin: str, callback: Callable[[Notification], Any]) -> None: ...
    def unlisten(self, bin: str) -> None: ...
    def put_async(self, bin: str, value: Record) -> "Future[int]": ...
    def append_async(self, bin: str, value: Record) -> "Future[int]": ...
    def get_async(
        self, bin: str, max_items: int = 0, *, tensor_type: Optional[TensorType] = None
    ) -> "Future[List[Record]]": ...
    def peek_async(
        self, bin: str, max_items: int = 0, *, tensor_type: Optional[TensorType] = None
    ) -> "Future[List[Record]]": ...
    def delete_async(self, bin: str) -> "Future[int]": ...
    def list_async(self) -> "Future[Dict[str, BinInfo]]": ...
    def wait_async(
        self, bin: str, after_version: int = 0, timeout: Optional[float] = None
    ) -> "Future[Tuple[int, int]]": ...
    def stats_async(self) -> "Future[Dict[str, int]]": ...
    def ping_async(self) -> "Future[None]": ...
    def stream_create(
        self,
        name: str,
        max_entries: int = 1024,
        max_bytes: int = 0,
        max_age_ms: int = 0,
        window: int = 0,
        lease_ms: int = 0,
    ) -> Dict[str, Optional[int]]: ...
    def stream_append(self, name: str, value: Record) -> int: ...
    def stream_mark(self, name: str, tag: int) -> int: ...
    def stream_credit(
        self, name: str, timeout_ms: Optional[int] = None
    ) -> Dict[str, Optional[int]]: ...
    def stream_join(
        self,
        name: str,
        group: str,
        member: str,
        start: Literal["oldest", "newest"] = "oldest",
        lease_ms: int = 0,
    ) -> Dict[str, int]: ...
    def stream_read(
        self,
        name: str,
        group: str,
        member: str,
        ack_through: int = 0,
        max_entries: int = 64,
        timeout_ms: Optional[int] = 0,
        *,
        tensor_type: Optional[TensorType] = None,
    ) -> "StreamEntries": ...
    def stream_ack(
        self,
        name: str,
        group: str,
        member: str,
        first: int,
        last: Optional[int] = None,
        rows: int = 0,
    ) -> Dict[str, Optional[int]]: ...
    def stream_leave(
        self, name: str, group: str, member: Optional[str] = None
    ) -> Dict[str, Optional[int]]: ...
    def stream_info(self, name: str) -> Dict[str, Any]: ...
    def stream_range(
        self,
        name: str,
        after_id: int = 0,
        max_entries: int = 64,
        timeout_ms: Optional[int] = 0,
        *,
        tensor_type: Optional[TensorType] = None,
    ) -> "StreamEntries": ...
    # Replay tables (docs/PYTHON.md "Replay tables").
    def table_create(
        self,
        name: str,
        capacity: int = 100000,
        sampler: Literal["uniform", "prioritized", "fifo", "lifo"] = "uniform",
        remover: Literal["fifo", "lifo", "lowest_priority"] = "fifo",
        priority_exponent: float = 1.0,
        max_times_sampled: int = 0,
        min_size_to_sample: int = 1,
        samples_per_insert: float = 1.0,
        error_buffer: float = 0.0,
    ) -> Dict[str, int]: ...
    def table_insert(
        self, name: str, value: Any, priority: float = 1.0, timeout_ms: Optional[int] = None
    ) -> int: ...
    def table_sample(
        self,
        name: str,
        n: int = 1,
        timeout_ms: Optional[int] = None,
        *,
        tensor_type: Optional[TensorType] = None,
    ) -> List[Dict[str, Any]]: ...
    def table_update(
        self, name: str, keys: Sequence[int], priorities: Sequence[float]
    ) -> Dict[str, int]: ...
    def table_remove(self, name: str, keys: Sequence[int]) -> Dict[str, int]: ...
    def table_info(self, name: str) -> Dict[str, Any]: ...
    # Parameter server (docs/PYTHON.md "Parameter server"; tensorshare.ps wraps these).
    def ps_create(
        self,
        name: str,
        optimizer: int = 1,
        mode: int = 0,
        lr: float = 0.01,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-8,
        sync_k: int = 1,
        tolerance: int = 0,
        lr_staleness: bool = False,
        keep: bool = False,
    ) -> int: ...
    def ps_push(self, name: str, grad: Any, base_version: int = 0, scale: float = 1.0) -> int: ...
    def ps_pull(
        self, name: str, if_newer_than: int = 0, *, tensor_type: Optional[TensorType] = None
    ) -> Optional[Tuple[int, Any]]: ...
    def emb_create(
        self,
        name: str,
        dim: int,
        optimizer: int = 1,
        init: int = 1,
        seed: int = 0,
        num_ids: int = 0,
        lr: float = 0.01,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-8,
        init_scale: float = 0.05,
    ) -> int: ...
    def emb_pull(self, name: str, ids: Any, out: Any) -> int: ...
    def emb_push(self, name: str, ids: Any, grads: Any, scale: float = 1.0) -> int: ...
    def emb_versions(self, name: str) -> List[int]: ...
    # Coordination (docs/PYTHON.md "Coordination").
    def add(self, name: str, delta: int = 1) -> int: ...
    def put_if(self, name: str, expected_version: int, value: Any) -> int: ...
    def take(
        self,
        name: str,
        max_items: int = 0,
        timeout_ms: Optional[int] = None,
        *,
        tensor_type: Optional[TensorType] = None,
    ) -> List[Any]: ...
    def mget(
        self, names: Sequence[str], max_items: int = 0, *, tensor_type: Optional[TensorType] = None
    ) -> Dict[str, Optional[List[Any]]]: ...
    def barrier(self, name: str, parties: int, timeout_ms: Optional[int] = None) -> int: ...
    def close(self) -> None: ...
    def __enter__(self) -> "Client": ...
    def __exit__(self, *exc: object) -> Literal[False]: ...

from .predictor import Predictor as Predictor
from .service import Service as Service
from .rl import NO_FILTER as NO_FILTER
from .rl import Batch as Batch
from .rl import Params as Params
from .rl import RLTrainer as RLTrainer
from .rl import RLWorker as RLWorker
from .stream import StreamConsumer as StreamConsumer
from .stream import StreamEntries as StreamEntries
from .stream import StreamEntry as StreamEntry
from .stream import StreamProducer as StreamProducer
