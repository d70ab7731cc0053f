"""Memory a whole-model call holds on to (review of peak memory): after a failure, nothing the call
built stays reachable from the exception (a notebook keeps the last one); the rollback's copy of
pruned entries is taken in row chunks and freed after restoring."""
import gc
import weakref

import pytest
import torch
from torch import nn

import sparse24
from sparse24 import Sparse24Linear
from sparse24._rollback import TensorBackup


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])


@pytest.mark.parametrize("mode", ["masked", "compressed"])
def test_a_failed_sparsify_holds_nothing_it_built(mode, monkeypatch):
    """The last layer refuses (inf): the three layers built before it (masks, compressed weights)
    were kept alive by the exception's frames."""
    model = _model()
    with torch.no_grad():
        model[3].weight[0, 0] = float("inf")
    built = weakref.WeakSet()
    real = Sparse24Linear._adopt

    def adopt(self, *a, **k):
        built.add(self)
        return real(self, *a, **k)
    monkeypatch.setattr(Sparse24Linear, "_adopt", adopt)
    with pytest.raises(ValueError) as info:
        sparse24.sparsify_(model, mode=mode, skip_output_head=False)
    gc.collect()
    assert info.value.__traceback__ is not None and len(built) == 0


def test_a_failed_compress_holds_no_compressed_weight(monkeypatch):
    model = _model()
    sparse24.sparsify_(model, skip_output_head=False)
    with torch.no_grad():
        model[3].weight[0, 0] = float("inf")
    made = []
    real = Sparse24Linear._compressed_form

    def form(self, *a, **k):
        p = real(self, *a, **k)
        made.append(weakref.ref(p.values))
        return p
    monkeypatch.setattr(Sparse24Linear, "_compressed_form", form)
    with pytest.raises(ValueError) as info:
        sparse24.compress_(model, quantize="int8")
    gc.collect()
    assert len(made) == 3 and all(r() is None for r in made) and info.value is not None


def test_keep_pruned_in_row_chunks_restores_exactly_and_forgets(monkeypatch):
    """Chunks of 2**24 entries: a 2**12 x 2**13 weight is taken in 2 chunks; what is restored equals
    the original exactly, and the backup then holds nothing."""
    w = torch.randn(4096, 8192, dtype=torch.bfloat16)
    mask = sparse24.mask_nm(w, 2, 4)
    before = w.clone()
    backup = TensorBackup()
    backup.keep_pruned([w], mask)
    assert backup._saved[0][1].numel() == int((~mask).sum())
    with torch.no_grad():
        w.masked_fill_(~mask, 0)
    backup.restore()
    assert torch.equal(w, before) and backup._saved == [] and not backup._ids
