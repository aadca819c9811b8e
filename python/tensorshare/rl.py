"""Distributed RL helpers: a trainer that publishes parameters and collects experience, and
workers that act on the newest parameters and send experience back (include/tensorshare/rl.h,
docs/RL.md, docs/PYTHON.md).

    trainer = tensorshare.RLTrainer(client, staleness_tolerance=0)
    v = trainer.publish(net.state_dict())          # returns once tensord holds it
    batch = trainer.collect(64, timeout=5.0)       # Batch of (data, version) items

    worker = tensorshare.RLWorker(client)
    p = worker.params() or worker.await_params()   # Params(value, version)
    net.load_state_dict(p.value)
    worker.add(rollout)                            # tagged with p.version; does not wait

Timeouts are in seconds. For the waits (collect, await_params) None means no limit; for flush
and the constructor's timeout (the wait for room in add, and for the adds in flight in close)
None means 30 s. 0 means "do not wait" and math.inf "no limit". A wait that ends without a
result raises tensorshare.TimeoutError: a timeout is never mistaken for an update.
"""
from collections import namedtuple

from ._tensorshare import RL_NO_FILTER, _RLTrainer, _RLWorker

__all__ = ["RLTrainer", "RLWorker", "Batch", "Params", "NO_FILTER"]

#: staleness_tolerance that keeps every experience item, however old its parameters.
NO_FILTER = RL_NO_FILTER

#: Published parameters as a worker holds them: the record and its version. The tensors are
#: read-only views of the received snapshot, which stays in memory while any of them is used.
Params = namedtuple("Params", ["value", "version"])


class Batch(list):
    """The experience one collect() took: a list of (data, version) pairs, oldest first.

    .data and .versions are its two columns; .dropped counts the items this call dropped on its
    way (made with parameters older than the staleness tolerance allows, or not
    {data, version}).
    """

    def __init__(self, data, versions, dropped):
        super().__init__(zip(data, versions))
        self.data = data
        self.versions = versions
        self.dropped = dropped

    def __repr__(self):
        return "Batch(%d items, versions=%r, dropped=%d)" % (len(self), self.versions,
                                                             self.dropped)


class RLTrainer(_RLTrainer):
    """Publishes parameters and collects experience (rl.h's ts_rl_trainer_t).

    RLTrainer(client, *, prefix=None, params_bin="parameters", data_bin="data",
              staleness_tolerance=0, timeout=None, tensor_type=None)

    client is a tensorshare.Client, used for the trainer's whole life (closing the Client takes
    effect once the trainer is closed). The constructor reads the parameters bin once and
    resumes after the version stored there. staleness_tolerance k keeps an experience item when
    its version is at least the newest published version minus k (0: only the newest, like the
    original's filter_version=True; NO_FILTER keeps everything; before the first publish every
    item is kept). tensor_type ("torch" or "numpy") is how collected tensors are handed out
    (default: the client's).

    publish(params) -> int: publish params (typically a state dict) as the next version; returns
    the version once tensord holds it. The tensors are sent from their memory, not copied.
    collect(max_items=0, timeout=None) -> Batch: take up to max_items items (0: all there are),
    oldest first, waiting up to timeout seconds for one to be kept (TimeoutError otherwise).
    When the items it took out of the bin cannot all be turned into Python objects (no memory,
    a torch function mode that raises), the converter's exception is raised with .items: every
    item taken, oldest first, as a (data, version) pair, or None for one that could not be made.
    A tensor_type whose module cannot be imported fails before anything is taken.
    version: the newest version published or resumed from (-1: none). stats() -> dict.
    close() (also on leaving a with block) frees the trainer; it is idempotent.
    """

    def collect(self, max_items=0, timeout=None):
        data, versions, dropped = super().collect(max_items, timeout)
        return Batch(data, versions, dropped)


class RLWorker(_RLWorker):
    """Acts on the newest parameters and sends experience back (rl.h's ts_rl_worker_t).

    RLWorker(client, *, prefix=None, params_bin="parameters", data_bin="data",
             max_in_flight=16, max_in_flight_bytes=64 MiB, timeout=None, on_event=None,
             tensor_type=None)

    The constructor subscribes to the parameters bin and reads it once. From then on the
    newest parameters are kept locally: params() answers without a round trip. A Client listens
    to a bin once: a second worker on the same Client and parameters bin raises
    InvalidArgumentError (give it its own Client, prefix or params_bin).

    params() -> Params or None: the newest parameters (None before any publish); marks their
    version as retrieved: later adds are tagged with it.
    await_params(timeout=None) -> Params: wait for parameters newer than the last retrieved ones
    (TimeoutError when none came in time).
    add(data, *, copy=True, block=True): append {data, version} to the data bin without waiting
    for tensord. copy=True copies the tensors during the call; copy=False sends them from their
    memory, which the worker keeps referenced until a flush() finds every add answered (do not
    change them meanwhile; adds still in flight when close() starts leave them to the Client,
    which keeps them until it is closed). When max_in_flight adds are already on their way, add waits for
    room (up to the constructor's timeout), or raises tensorshare.Error (EAGAIN) at once with
    block=False.
    flush(timeout=None): wait until every add was answered; raises the first add failure since
    the previous flush.
    on_event(event, version, error) is called on the client's I/O thread with the GIL held for
    "params" (newer parameters arrived), "disconnected", "resubscribed", "add_failed",
    "params_failed" and "params_bad"; error is a tensorshare.Error or None. Keep it short; it
    cannot call the worker's own methods (DeadlockError).
    stats() -> dict. close() waits for the adds in flight up to the constructor's timeout (not
    the Client's request timeout) and frees the worker; adds still in flight then are answered
    later without calling on_event. It is idempotent.
    """

    def params(self):
        p = super().params()
        return None if p is None else Params(*p)

    def await_params(self, timeout=None):
        return Params(*super().await_params(timeout))
