"""Type stubs of tensorshare.service (Client.serve's Service)."""
from typing import Any, Callable, Optional

from . import Client

class Service:
    name: str
    def __init__(self, client: Client, name: str, handler: Callable[[Any], Any],
                 concurrency: int = ..., workers: Optional[int] = ...) -> None: ...
    def close(self) -> None: ...
    def __enter__(self) -> "Service": ...
    def __exit__(self, *exc: object) -> bool: ...

# service (or name=, its other spelling) and handler are required: TypeError without them, and
# with both service and name.
def serve(
    client: Client,
    service: Optional[str] = None,
    handler: Optional[Callable[[Any], Any]] = None,
    concurrency: int = 64,
    workers: Optional[int] = None,
    *,
    name: Optional[str] = None,
) -> Service: ...
