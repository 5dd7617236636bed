"""ZB-H1's deferred Linear weight gradients (``runtime/weight_grads.py``), in one process: ``I`` leaves exactly the
weight gradients of the routed layers for ``W``, which gives autograd's values; outside a split backward the
layers compute them at once; a routed model still copies and pickles. (On the pipe axis against torch's generic
split: ``test_pipeline_training.py``.)"""

import copy
import pickle

import torch
from torch import nn

from shardlib.runtime.weight_grads import WeightGradStore, defer_linears, untied_linears


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(6, 5)
        self.norm = nn.LayerNorm(5)
        self.b = nn.Linear(5, 4, bias=False)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.frozen(self.b(torch.relu(self.norm(self.a(x)))))


def _grads(net):
    return {n: None if p.grad is None else p.grad.clone() for n, p in net.named_parameters()}


def test_input_half_leaves_the_routed_weights_to_the_weight_half_with_autograds_values():
    ref, net = _Net(), _Net()
    store = WeightGradStore()
    assert defer_linears([net], store) == 2                 # a and b; not the frozen layer, not the norm
    x, g = torch.randn(3, 7, 6), torch.randn(3, 7, 4)
    xr, xd = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ref(xr).backward(g)
    for mb in range(2):                                      # two micro-batches accumulate, as on a stage
        store.key = ("s", mb)
        net(xd).backward(g)
        store.key = None
        got = _grads(net)
        assert got["a.weight"] is None and got["b.weight"] is None      # deferred: nothing yet
        assert got["a.bias"] is not None and got["norm.weight"] is not None
        if mb == 0:
            assert torch.equal(xd.grad, xr.grad)                           # the input's gradient: in I
    store.flush(("s", 0))
    assert torch.equal(net.a.weight.grad, ref.a.weight.grad) and torch.equal(net.b.weight.grad, ref.b.weight.grad)
    store.flush(("s", 1))
    assert torch.equal(net.a.weight.grad, 2 * ref.a.weight.grad)
    assert torch.equal(net.b.weight.grad, 2 * ref.b.weight.grad) and store.pending == {}


def test_without_a_split_running_the_layers_are_plain_and_the_model_copies():
    ref, net = _Net(), _Net()
    defer_linears([net], WeightGradStore())
    x = torch.randn(4, 6)
    ref(x).sum().backward()
    net(x).sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(_grads(net).values(), _grads(ref).values()) if a is not None)
    assert _grads(net).keys() == _grads(ref).keys()
    for other in (copy.deepcopy(net), pickle.loads(pickle.dumps(net))):
        assert other.a.forward.args[0] is other.a                        # routed through its own layer
        assert torch.equal(other(x), net(x))
    with torch.no_grad():
        assert torch.equal(net(x), ref(x))


def test_untied_linears_are_the_named_plain_linears_whose_weight_nothing_else_uses():
    """The last stage's LM head is deferred too, unless its weight is tied (its other use adds into the same
    ``.grad`` inside the backward): named by parameter, plain ``nn.Linear`` only, the root never."""
    class LM(nn.Module):
        def __init__(self, tied: bool):
            super().__init__()
            self.wte = nn.Embedding(10, 4)
            self.norm = nn.LayerNorm(4)
            self.head = nn.Linear(4, 10, bias=False)
            self.scale = nn.Parameter(torch.ones(()))
            if tied:
                self.head.weight = self.wte.weight

    names = ["norm.weight", "norm.bias", "head.weight", "scale"]
    untied = LM(False)
    assert untied_linears(untied, names) == [untied.head]
    assert untied_linears(LM(True), names) == []
    assert untied_linears(untied, ["norm.weight"]) == []
