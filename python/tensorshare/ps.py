"""The parameter server from Python (docs/PS.md): dense parameters, embedding tables and
ParameterClient, the helper a PyTorch worker calls in its loop.

Tensors go to the C client without a copy: a float32 C-contiguous CPU torch tensor is handed
over as the numpy array that shares its memory (torch.Tensor.numpy()), and a numpy array as
itself. Anything else (another dtype, non-contiguous, on a GPU) raises TypeError; convert it
first, where the copy is then visible.

    from tensorshare.ps import ParameterClient
    pc = ParameterClient(client, model, "net/")
    pc.create(model, optimizer=SGD, lr=0.1)  # once, from one process
    for batch in data:
        pc.pull(model)                     # newer parameters into model, in place
        loss(model, batch).backward()
        pc.push(model)                     # each p.grad
"""
import numpy as _np

from ._tensorshare import StaleGradientError  # noqa: F401

# The optimizers and modes (include/tensorshare/ps.h's wire codes).
SUM, SGD, MOMENTUM, ADAM = 0, 1, 2, 3
ASYNC, SYNC = 0, 1
INIT_ZEROS, INIT_UNIFORM, INIT_NORMAL = 0, 1, 2

__all__ = ["SUM", "SGD", "MOMENTUM", "ADAM", "ASYNC", "SYNC", "INIT_ZEROS", "INIT_UNIFORM",
           "INIT_NORMAL", "StaleGradientError", "create", "push", "pull", "emb_create",
           "emb_pull", "emb_push", "ParameterClient"]


def _is_torch(x):
    return type(x).__module__.startswith("torch")


def _array(x, what, dtype):
    """x as a numpy array sharing its memory (no copy); TypeError when that is impossible."""
    if _is_torch(x):
        import torch

        want = torch.float32 if dtype == _np.float32 else torch.int64
        if x.dtype != want or x.device.type != "cpu" or not x.is_contiguous():
            raise TypeError("%s must be a contiguous CPU %s tensor" % (what, want))
        return x.detach().numpy()
    if not isinstance(x, _np.ndarray):
        raise TypeError("%s must be a torch tensor or a numpy array" % what)
    if x.dtype != dtype or not x.flags.c_contiguous:
        raise TypeError("%s must be a C-contiguous %s array" % (what, _np.dtype(dtype).name))
    return x


def create(client, name, value=None, keep=False, **options):
    """Make bin name a parameter (put value first when given); returns the bin's version.
    options: optimizer, mode, lr, beta1, beta2, eps, sync_k, tolerance, lr_staleness.
    keep=True (since 0.6.0): a parameter that already exists with the same settings (restored
    from a snapshot, or made by another worker) is left as it is, value and optimizer state,
    and value is not put; other settings raise InvalidArgumentError. Use it when workers may
    start again against a daemon restarted from its snapshot."""
    if keep:
        try:
            return client.ps_create(name, keep=True, **options)
        except KeyError:  # BinNotFoundError: nothing to keep yet
            if value is None:
                raise
    if value is not None:
        client.put(name, value)
    return client.ps_create(name, keep=keep, **options)


def push(client, name, grad, base_version=0, scale=1.0):
    """Push gradient grad (float32, the parameter's shape); returns the version after it.
    StaleGradientError (.current_version) when a sync push lags by more than the tolerance."""
    return client.ps_push(name, _array(grad, "grad", _np.float32), base_version, scale)


def pull(client, name, if_newer_than=0, tensor_type=None):
    """(version, tensor) when the parameter is newer than if_newer_than, else None."""
    if tensor_type is None:
        return client.ps_pull(name, if_newer_than)
    return client.ps_pull(name, if_newer_than, tensor_type=tensor_type)


def emb_create(client, name, dim, **options):
    """Create embedding table name with rows of dim floats (options: optimizer, init, seed,
    num_ids, lr, beta1, beta2, eps, init_scale); the same settings again change nothing."""
    return client.emb_create(name, dim, **options)


def emb_pull(client, name, ids, dim):
    """The rows of ids (int64, one dimension) as an [n, dim] float32 tensor in the order of ids
    (a torch tensor when ids is one, else a numpy array). Returns (version, rows)."""
    as_torch = _is_torch(ids)
    a = _array(ids, "ids", _np.int64)
    if a.ndim != 1:
        raise ValueError("ids must have one dimension")
    out = _np.empty((a.shape[0], dim), dtype=_np.float32)
    version = client.emb_pull(name, a, out)
    if as_torch:
        import torch

        out = torch.from_numpy(out)
    return version, out


def emb_push(client, name, ids, grads, scale=1.0):
    """Push row gradients grads [n, dim] for ids [n]; returns the table's version after it."""
    return client.emb_push(name, _array(ids, "ids", _np.int64),
                           _array(grads, "grads", _np.float32), scale)


def emb_versions(client, name):
    """The table's version on each shard of a cluster client, in the order of its addresses (a
    list of one for a client of one daemon); no row is made."""
    return client.emb_versions(name)


class ParameterClient:
    """One worker's view of a model's parameters on the server: bin prefix + the parameter's
    name for each of model.named_parameters(), and the version of each last loaded (the
    version vector), which pull() sends as if_newer_than and push() as base_version."""

    def __init__(self, client, model, prefix):
        self.client = client
        self.prefix = prefix
        self.names = [n for n, _ in model.named_parameters()]
        self.versions = {n: 0 for n in self.names}

    def _bin(self, n):
        return self.prefix + n

    def create(self, model, keep=False, **options):
        """Put the model's current parameters and make each a parameter with options (one
        process does this, before the others pull). keep=True (since 0.6.0): parameters that
        already exist with the same settings (a daemon restarted from its snapshot) keep their
        values and optimizer state; the next pull() then loads them into model."""
        for n, p in model.named_parameters():
            if keep:
                try:
                    self.client.ps_create(self._bin(n), keep=True, **options)
                    self.versions[n] = 0  # the server's value is not the model's: pull it
                    continue
                except KeyError:  # BinNotFoundError: a new parameter
                    pass
            self.versions[n] = create(self.client, self._bin(n), p.detach().contiguous(),
                                      keep=keep, **options)

    def pull(self, model):
        """Load every parameter newer than the one last loaded into model, in place. Returns
        how many were loaded."""
        import torch

        loaded = 0
        with torch.no_grad():
            for n, p in model.named_parameters():
                r = self.client.ps_pull(self._bin(n), self.versions[n], tensor_type="torch")
                if r is None:
                    continue
                version, value = r
                if tuple(value.shape) != tuple(p.shape):
                    raise ValueError("%s: the server's shape %s is not the model's %s"
                                     % (n, tuple(value.shape), tuple(p.shape)))
                p.copy_(value)
                self.versions[n] = version
                loaded += 1
        return loaded

    def push(self, model, scale=1.0):
        """Push each parameter's p.grad (skipping those without one) computed on the versions
        last pulled; returns {name: version after the push}."""
        out = {}
        for n, p in model.named_parameters():
            if p.grad is None:
                continue
            g = p.grad.detach()
            if not g.is_contiguous():
                g = g.contiguous()
            out[n] = push(self.client, self._bin(n), g, self.versions[n], scale)
        return out
