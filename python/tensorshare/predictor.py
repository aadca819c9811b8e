"""Remote predictions through tensord: tensorshare.Predictor (include/tensorshare/batcher.h's
predictor API, docs/BATCHER.md "Remote use through tensord", docs/PYTHON.md).

A model served on tensord under a name (tsinfer --name NAME, or a program calling
ts_batcher_serve) batches the requests of every predictor with the others':

    with tensorshare.Predictor(client, "policy") as p:
        y = p.predict(torch.randn(1, 8))                   # blocks; GIL released
        y, version = p.predict(x, return_version=True)     # the weight version that answered
        fut = p.predict_async(x)                           # concurrent.futures.Future
"""
import os as _os
import threading as _threading

from ._tensorshare import PREDICTOR_DEFAULT_TIMEOUT_MS, _Predictor, _take_pending_predictions

__all__ = ["Predictor", "DEFAULT_TIMEOUT_S"]

#: seconds; what timeout=None means for a prediction.
DEFAULT_TIMEOUT_S = PREDICTOR_DEFAULT_TIMEOUT_MS / 1000.0


def _fail_the_parents_predictions():
    # In a child process after os.fork(): the futures of predict_async calls still outstanding
    # belong to the parent, whose library threads (the only ones that complete them) do not
    # exist here, so their result() would wait forever. They fail with ConnectionError instead.
    # A parent's thread may have held a future's lock at the fork, and the waiters and
    # done-callbacks registered before it are the parent's, not to be run here: each future gets
    # a fresh lock and drops them before it completes.
    for future, exc in _take_pending_predictions():
        future._condition = _threading.Condition()
        future._waiters = []
        future._done_callbacks = []
        try:
            future.set_exception(exc)
        except Exception:  # noqa: BLE001 - a future of another shape: leave it as it is
            pass


_os.register_at_fork(after_in_child=_fail_the_parents_predictions)


class Predictor(_Predictor):
    """Predictions from a model served on tensord under name.

    Predictor(client, name, *, tensor_type=None)

    client is a tensorshare.Client, used for the predictor's whole life (closing the Client takes
    effect once the predictor is closed). Each prediction is a call of the service name on
    tensord (no bin is made); a blocking predict goes through a same-host shared-memory slot
    instead when the server offers one and the predictor holds it. The predictor owns one thread
    of the library, which fails predictions at their deadline when no answer came.

    predict(input, timeout=None, *, return_version=False): send input (a record matching the
    served model's input schema: typically a tensor of rows) and wait for the answer; returns
    the output record, or (output, version) with return_version=True. The output's tensors are
    views of the answer (no copy). timeout in seconds: None is DEFAULT_TIMEOUT_S (30 s), inf is
    no limit, 0 is refused (a prediction cannot be answered without waiting). Raises
    tensorshare.TimeoutError when no answer came in time, RecordError (ESCHEMA) when the input
    does not match the schema, tensorshare.Error (EMODEL) when the model failed.
    predict_async(input, timeout=None, *, return_version=False) -> concurrent.futures.Future:
    the same without waiting; the Future completes on the client's I/O thread (answers; its
    done-callbacks run there, with the GIL, where blocking client calls raise DeadlockError), on
    the predictor's thread (a deadline reached there first) or in close() (CancelledError).
    close() (also on leaving a with block): outstanding predictions fail with CancelledError, a
    predict() waiting in another thread included (but for one through the shared-memory slot,
    which close() waits for); idempotent. In a child process after os.fork() the predictor
    cannot be used (ConnectionError), and the futures outstanding at the fork fail there with
    ConnectionError (without running the callbacks added before it); the parent's are untouched.
    """
