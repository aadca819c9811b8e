"""Remote predictions through tensord: tensorshare.Predictor (include/tensorshare/batcher.h's
predictor API, docs/BATCHER.md "Remote use through tensord", docs/PYTHON.md).

A model served on tensord under a name (tsinfer --name NAME, or a program calling
ts_batcher_serve) batches the requests of every predictor with the others':

    with tensorshare.Predictor(client, "policy") as p:
        y = p.predict(torch.randn(1, 8))                   # blocks; GIL released
        y, version = p.predict(x, return_version=True)     # the weight version that answered
        fut = p.predict_async(x)                           # concurrent.futures.Future
"""
from ._tensorshare import PREDICTOR_DEFAULT_TIMEOUT_MS, _Predictor

__all__ = ["Predictor", "DEFAULT_TIMEOUT_S"]

#: seconds; what timeout=None means for a prediction.
DEFAULT_TIMEOUT_S = PREDICTOR_DEFAULT_TIMEOUT_MS / 1000.0


class Predictor(_Predictor):
    """Predictions from a model served on tensord under name.

    Predictor(client, name, *, tensor_type=None)

    client is a tensorshare.Client, used for the predictor's whole life (closing the Client takes
    effect once the predictor is closed). The predictor owns a reply bin on tensord
    (NAME/reply/<unique>, deleted by close()) and a receiver thread.

    predict(input, timeout=None, *, return_version=False): send input (a record matching the
    served model's input schema: typically a tensor of rows) and wait for the answer; returns
    the output record, or (output, version) with return_version=True. The output's tensors are
    views of the answer (no copy). timeout in seconds: None is DEFAULT_TIMEOUT_S (30 s), inf is
    no limit, 0 is refused (a prediction cannot be answered without waiting). Raises
    tensorshare.TimeoutError when no answer came in time, RecordError (ESCHEMA) when the input
    does not match the schema, tensorshare.Error (EMODEL) when the model failed.
    predict_async(input, timeout=None, *, return_version=False) -> concurrent.futures.Future:
    the same without waiting; the Future completes on the predictor's receiver thread (its
    done-callbacks run there, with the GIL).
    close() (also on leaving a with block): outstanding predictions fail with CancelledError and
    the reply bin is deleted; idempotent.
    """
