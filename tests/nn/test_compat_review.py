"""Files and states written by earlier versions of sparse24, read by this one."""
import copy

import pytest
import torch
from torch import nn

import sparse24


def _model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8))
    sparse24.sparsify_(m, min_features=0, skip_output_head=False)
    return m


@pytest.mark.parametrize("make", [lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
                                  lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9)], ids=["adamw", "sgd"])
def test_an_optimizer_state_of_the_old_parameter_order_is_refused_before_any_change(make):
    """Before 2026-12-05 a Sparse24Linear listed (bias, weight); torch pairs a loaded state by position, so
    each weight got its bias's moments and the step failed in torch after changing other tensors."""
    x = torch.randn(4, 16)
    old = _model()
    old_opt = make([p for layer in (old[0], old[2]) for p in (layer.bias, layer.weight)])   # the old order
    old(x).pow(2).mean().backward()
    old_opt.step()
    model = _model()
    opt = make(model.parameters())
    opt.load_state_dict(old_opt.state_dict())
    model(x).pow(2).mean().backward()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(RuntimeError, match=r"state '(exp_avg|momentum_buffer)' of .* has shape \(16,\), the bias's"
                                           r".*before 2026-12-05.*nothing was changed"):
        opt.step()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    # the same state in today's order steps
    opt = make(model.parameters())
    opt.load_state_dict(make([p for layer in (old[0], old[2]) for p in (layer.weight, layer.bias)]).state_dict())
    opt.step()
