"""The parameter server from Python (tensorshare.ps, Client.ps_* and emb_*) against a real
tensord: sums, pull-if-newer, a stale sync push, embedding rows in the caller's order, the
ParameterClient helper on a tiny torch model, and refused inputs."""
import re

import numpy as np
import pytest
import torch

import tensorshare
from tensorshare import ps


def test_sum_and_pull_if_newer(client):
    v0 = ps.create(client, "p", torch.zeros(4), optimizer=ps.SUM)
    assert v0 >= 1
    v1 = ps.push(client, "p", torch.ones(4))
    v2 = ps.push(client, "p", np.full(4, 2.0, dtype=np.float32), scale=0.5)
    assert v2 > v1 > v0
    version, value = ps.pull(client, "p", tensor_type="torch")
    assert version == v2
    assert torch.equal(value, torch.full((4,), 2.0))
    # Not newer than what we hold: None, one round trip.
    assert ps.pull(client, "p", if_newer_than=v2) is None
    assert ps.pull(client, "p", if_newer_than=v1)[0] == v2


def test_sgd_step(client):
    ps.create(client, "w", torch.ones(2, 3), optimizer=ps.SGD, lr=0.5)
    ps.push(client, "w", torch.ones(2, 3))
    _, value = ps.pull(client, "w", tensor_type="torch")
    assert torch.allclose(value, torch.full((2, 3), 0.5))


def test_stale_sync_push(client):
    v0 = ps.create(client, "s", torch.zeros(3), optimizer=ps.SUM, mode=ps.SYNC, sync_k=1,
                   tolerance=0)
    v1 = ps.push(client, "s", torch.ones(3), base_version=v0)
    assert v1 > v0
    with pytest.raises(tensorshare.StaleGradientError) as ei:
        ps.push(client, "s", torch.ones(3), base_version=v0)
    assert ei.value.current_version == v1
    assert isinstance(ei.value, tensorshare.Error)
    # Nothing changed.
    assert torch.equal(ps.pull(client, "s", tensor_type="torch")[1], torch.ones(3))


def test_embedding_order_and_duplicates(client):
    ps.emb_create(client, "emb", 3, optimizer=ps.SUM, init=ps.INIT_ZEROS)
    ids = torch.tensor([5, 1, 5, 9], dtype=torch.int64)
    grads = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    ps.emb_push(client, "emb", ids, grads)
    version, rows = ps.emb_pull(client, "emb", torch.tensor([9, 5, 1, 7], dtype=torch.int64), 3)
    assert isinstance(rows, torch.Tensor) and rows.shape == (4, 3)
    assert version >= 1
    assert torch.equal(rows[0], grads[3])
    assert torch.equal(rows[1], grads[0] + grads[2])  # a duplicate id's gradients summed
    assert torch.equal(rows[2], grads[1])
    assert torch.equal(rows[3], torch.zeros(3))  # created by the initializer
    # numpy in, numpy out; duplicates copied to every place.
    _, r2 = ps.emb_pull(client, "emb", np.array([1, 1], dtype=np.int64), 3)
    assert isinstance(r2, np.ndarray) and (r2[0] == r2[1]).all()
    # One daemon: a vector of one version, the table's.
    assert ps.emb_versions(client, "emb") == [version]


def test_embedding_seeded_rows_same_on_two_daemons(start_tensord):
    a, b = start_tensord(), start_tensord()
    rows = []
    for d in (a, b):
        with tensorshare.Client(d.address) as c:
            ps.emb_create(c, "t", 4, seed=42)
            rows.append(ps.emb_pull(c, "t", np.array([3, 100], dtype=np.int64), 4)[1])
    assert np.array_equal(rows[0], rows[1])
    assert np.all(np.abs(rows[0]) <= 0.05) and np.any(rows[0] != 0)


def test_parameter_client_on_a_model(client):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    pc = ps.ParameterClient(client, model, "net/")
    pc.create(model, optimizer=ps.SGD, lr=0.1)
    # A second worker's copy with other weights loads the server's, in place.
    other = torch.nn.Linear(3, 2)
    weight = other.weight
    pc2 = ps.ParameterClient(client, other, "net/")
    assert pc2.pull(other) == 2
    assert other.weight is weight
    assert torch.equal(other.weight, start["weight"])
    assert pc2.pull(other) == 0  # nothing newer
    loss = other(torch.ones(1, 3)).sum()
    loss.backward()
    pushed = pc2.push(other)
    assert set(pushed) == {"weight", "bias"}
    assert pc.pull(model) == 2
    assert torch.allclose(model.weight, start["weight"] - 0.1 * other.weight.grad)
    assert torch.allclose(model.bias, start["bias"] - 0.1 * other.bias.grad)


def test_create_keep(client):
    model = torch.nn.Linear(2, 1)
    pc = ps.ParameterClient(client, model, "k/")
    pc.create(model, optimizer=ps.ADAM, lr=0.1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    pc.push(model)
    # A worker starting again with a fresh model keeps the server's values and Adam state.
    fresh = torch.nn.Linear(2, 1)
    pc2 = ps.ParameterClient(client, fresh, "k/")
    before = {n: ps.pull(client, "k/" + n, tensor_type="torch") for n in pc2.names}
    pc2.create(fresh, keep=True, optimizer=ps.ADAM, lr=0.1)
    for n in pc2.names:
        version, value = ps.pull(client, "k/" + n, tensor_type="torch")
        assert version == before[n][0]
        assert torch.equal(value, before[n][1])
    assert pc2.pull(fresh) == 2
    for n, p in fresh.named_parameters():
        assert torch.equal(p.detach(), before[n][1])
    # Other settings are refused; a new name is made.
    with pytest.raises(tensorshare.InvalidArgumentError):
        pc2.create(fresh, keep=True, optimizer=ps.SGD, lr=0.1)
    assert ps.create(client, "k/new", torch.zeros(2), keep=True) >= 1
    with pytest.raises(KeyError):
        ps.create(client, "k/none", keep=True)


def test_bad_inputs(client):
    ps.create(client, "b", torch.zeros(4), optimizer=ps.SUM)
    with pytest.raises(TypeError):
        ps.push(client, "b", torch.zeros(4, dtype=torch.float64))
    with pytest.raises(TypeError):
        ps.push(client, "b", torch.zeros(8)[::2])  # not contiguous
    with pytest.raises(TypeError):
        ps.push(client, "b", [0.0, 0.0, 0.0, 0.0])
    with pytest.raises(tensorshare.InvalidArgumentError):
        ps.push(client, "b", torch.zeros(5))  # another shape
    with pytest.raises(tensorshare.InvalidArgumentError):
        ps.push(client, "b", torch.tensor([0.0, float("nan"), 0.0, 0.0]))
    with pytest.raises(tensorshare.BinNotFoundError):
        ps.push(client, "nope", torch.zeros(4))
    with pytest.raises(tensorshare.BinNotFoundError):
        ps.create(client, "nope2")
    with pytest.raises(tensorshare.InvalidArgumentError):
        client.ps_create("b", optimizer=7)
    ps.emb_create(client, "e", 2, num_ids=10)
    with pytest.raises(tensorshare.InvalidArgumentError):
        ps.emb_pull(client, "e", np.array([10], dtype=np.int64), 2)  # id out of range
    with pytest.raises(TypeError):
        ps.emb_pull(client, "e", np.array([1], dtype=np.int32), 2)
    with pytest.raises(tensorshare.InvalidArgumentError):
        ps.emb_push(client, "e", np.array([1, 2], dtype=np.int64), np.zeros((3, 2), np.float32))
    with pytest.raises(tensorshare.InvalidArgumentError):
        ps.emb_create(client, "e", 2, num_ids=11)  # other settings
    assert tensorshare.ps.emb_pull(client, "e", np.zeros(0, dtype=np.int64), 2)[1].shape == (0, 2)


def test_example_ps_train(tmp_path):
    """examples/ps_train.py in a small configuration: four workers on two daemons (one worker
    killed and restarted, one daemon restarted from its snapshot), the final loss within the
    tolerance of one process's."""
    import os
    import subprocess
    import sys

    from conftest import tensord_path

    here = os.path.dirname(os.path.abspath(__file__))
    script = os.path.join(here, "..", "..", "examples", "ps_train.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    # 128 batches; each worker sleeps 5 ms a batch so that the kill at batch 64 always finds
    # workers running.
    cmd = [sys.executable, script, "--tensord", tensord_path(), "--samples", "2048", "--batch",
           "32", "--epochs", "2", "--tolerance", "0.05", "--slow-ms", "5", "--out",
           str(tmp_path / "curves.csv")]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "killed worker 1" in r.stdout
    assert "restarted daemon 1 from its snapshot" in r.stdout
    assert "final held-out loss" in r.stdout
    assert (tmp_path / "curves.csv").exists()


def test_client_calls_take_torch_tensors(client):
    client.put("tp", torch.zeros(4))
    client.ps_create("tp", optimizer=ps.SUM)
    v = client.ps_push("tp", torch.ones(4))
    assert client.ps_pull("tp", tensor_type="torch")[0] == v
    client.emb_create("te", 3)
    out = torch.full((2, 3), 9.0)
    client.emb_pull("te", torch.tensor([1, 2]), out)
    assert not torch.equal(out, torch.full((2, 3), 9.0))  # written in place
    client.emb_push("te", torch.tensor([1, 2]), torch.ones(2, 3))
    with pytest.raises(TypeError, match="C-contiguous"):
        client.ps_push("tp", torch.ones(4, 2).t())
    with pytest.raises(TypeError):
        client.ps_push("tp", torch.ones(4, dtype=torch.float64))


IAE = tensorshare.InvalidArgumentError
U32 = "from 0 to 4294967295"
U64 = "from 0 to 2**64-1"


@pytest.mark.parametrize("call, error, message", [
    pytest.param(lambda c: c.ps_create("b", optimizer=2**32), IAE,
                 "optimizer must be an int from 0 to 3, not 4294967296", id="optimizer"),
    pytest.param(lambda c: c.ps_create("b", optimizer=-1), IAE,
                 "optimizer must be an int from 0 to 3, not -1", id="optimizer_neg"),
    pytest.param(lambda c: c.ps_create("b", mode=2), IAE, "mode must be an int from 0 to 1",
                 id="mode"),
    pytest.param(lambda c: c.ps_create("b", sync_k=2**32 + 1), ValueError,
                 "sync_k must be an int %s, not 4294967297" % U32, id="sync_k"),
    pytest.param(lambda c: c.ps_create("b", tolerance=-1), ValueError,
                 "tolerance must be an int %s, not -1" % U32, id="tolerance"),
    pytest.param(lambda c: c.ps_create("b", optimizer=1.0), TypeError,
                 "optimizer must be an int, not float", id="optimizer_float"),
    pytest.param(lambda c: c.ps_push("b", np.zeros(4, np.float32), base_version=-1), ValueError,
                 "base_version must be an int %s, not -1" % U64, id="base_version"),
    pytest.param(lambda c: c.ps_push("b", np.zeros(4, np.float32), 2**64), ValueError,
                 "base_version must be an int %s" % U64, id="base_version_big"),
    pytest.param(lambda c: c.ps_pull("b", if_newer_than=2**64 + 5), ValueError,
                 "if_newer_than must be an int %s" % U64, id="if_newer_than"),
    pytest.param(lambda c: c.emb_create("e2", 2**32 + 2), ValueError,
                 "dim must be an int %s, not 4294967298" % U32, id="dim"),
    pytest.param(lambda c: c.emb_create("e2", True), TypeError, "dim must be an int, not bool",
                 id="dim_bool"),
    pytest.param(lambda c: c.emb_create("e2", 2, init=3), IAE,
                 "init must be an int from 0 to 2, not 3", id="init"),
    pytest.param(lambda c: c.emb_create("e2", 2, seed=-1), ValueError,
                 "seed must be an int %s, not -1" % U64, id="seed"),
    pytest.param(lambda c: c.emb_create("e2", 2, num_ids=2**64), ValueError,
                 "num_ids must be an int %s" % U64, id="num_ids"),
])
def test_out_of_range_ints_are_refused(client, call, error, message):
    """An int that does not fit its argument raises, naming it, and changes nothing: it is never
    cut to fit (emb_create's dim 2**32 + 2 taken as 2); an optimizer, mode or init out of range
    is InvalidArgumentError, as before."""
    version = ps.create(client, "b", torch.zeros(4), optimizer=ps.SUM)
    with pytest.raises(error, match=re.escape(message)):
        call(client)
    assert ps.pull(client, "b")[0] == version
    assert "e2" not in client.list()
