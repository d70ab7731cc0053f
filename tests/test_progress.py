"""Progress bars of the long calls (tqdm on stderr): drawn when asked or on a terminal, silent in
logs and tests by default, and the argument checked before anything changes."""
import copy
import io
import sys
import types

import pytest
import torch
from torch import nn

import sparse24
from sparse24._progress import progress_bar, progress_enabled
from sparse24.masks import prune_layerwise_


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))


BATCHES = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)]


def _calls():
    dense = _mlp()
    return {
        "calibrate": lambda m, **kw: sparse24.calibrate(m, BATCHES, **kw),
        "prune_layerwise_": lambda m, **kw: prune_layerwise_(m, BATCHES, **kw),
        "learn_masks": lambda m, **kw: sparse24.learn_masks(m, BATCHES, steps=4, check_batches=0, min_features=0,
                                                            **kw),
        "distill_": lambda m, **kw: (sparse24.sparsify_(m, min_features=0),
                                     sparse24.distill_(m, BATCHES, steps=4, teacher=dense, **kw)),
    }


def test_default_follows_the_terminal_and_notebooks(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True
    assert progress_enabled(None, Terminal()) and not progress_enabled(None, io.StringIO())
    assert progress_enabled(True, io.StringIO()) and not progress_enabled(False, Terminal())
    out = Terminal()
    bar = progress_bar(range(5), desc="sweep", file=out)  # a terminal: drawn, redrawn in place
    assert list(bar) == list(range(5))
    assert "sweep: 100%" in out.getvalue() and "\r" in out.getvalue()
    with pytest.raises(TypeError, match="progress must be True, False or None"):
        progress_enabled("yes")
    # a Jupyter kernel: its stderr is no terminal, yet it draws (IPython's shell class there)
    ZMQInteractiveShell = type("ZMQInteractiveShell", (), {})
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=ZMQInteractiveShell))
    assert progress_enabled(None, io.StringIO()) and not progress_enabled(False, io.StringIO())
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: None))  # plain IPython
    assert not progress_enabled(None, io.StringIO())


@pytest.mark.parametrize("name, total, unit", [("calibrate", 3, "batch"), ("prune_layerwise_", 2, "layer"),
                                               ("learn_masks", 4, "step"), ("distill_", 4, "step")])
def test_long_calls_draw_a_bar_when_asked(capsys, name, total, unit):
    call = _calls()[name]
    call(_mlp(), progress=True)
    err = capsys.readouterr().err
    assert f"{name}: 100%" in err and f"{total}/{total}" in err and f"{unit}/s" in err, err
    if unit == "step":
        assert "loss " in err  # the last loss beside the bar
    call(_mlp(), progress=False)
    call(_mlp())  # default: only on a terminal or in a notebook; pytest's stderr is neither
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("name", ["calibrate", "prune_layerwise_", "learn_masks", "distill_"])
def test_a_bad_progress_argument_changes_nothing(name):
    model = _mlp()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(TypeError, match="progress must be True, False or None"):
        _calls()[name](model, progress="yes")
    if name != "distill_":  # distill_ is given a sparsified model by the lambda itself
        assert all(isinstance(m, (nn.Linear, nn.GELU)) for m in model)
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
