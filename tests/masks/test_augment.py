"""token_noise: noisy copies of calibration batches for small or off-domain text."""
import pytest
import torch

from sparse24 import token_noise

CLS, SEP, PAD = 101, 102, 0


def _batch():
    ids = torch.tensor([[CLS, 7, 8, 9, 10, 11, SEP, PAD], [CLS, 12, 13, 14, SEP, PAD, PAD, PAD]])
    mask = (ids != PAD).long()
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}


def test_copies_replace_only_counting_tokens_at_rate_p():
    b = _batch()
    before = {k: v.clone() for k, v in b.items()}
    out = token_noise([b], copies=3, p=1.0, vocab=(1000, 2000), keep=(CLS, SEP))
    assert len(out) == 4 and out[0] is b
    for k in b:
        assert torch.equal(b[k], before[k])  # nothing changed in place
    counting = (b["attention_mask"] == 1) & (b["input_ids"] != CLS) & (b["input_ids"] != SEP)
    for c in out[1:]:
        ids = c["input_ids"]
        assert ids.dtype == b["input_ids"].dtype and ids.shape == b["input_ids"].shape
        assert torch.equal(ids[~counting], b["input_ids"][~counting])      # [CLS], [SEP], padding kept
        assert ((ids[counting] >= 1000) & (ids[counting] < 2000)).all()   # p = 1: every real token drawn anew
        assert torch.equal(c["attention_mask"], b["attention_mask"])
        assert torch.equal(c["token_type_ids"], b["token_type_ids"])
    assert not torch.equal(out[1]["input_ids"], out[2]["input_ids"])      # the copies differ

    # the rate: over many tokens about p of the counting ones change; p = 0 changes nothing
    big = {"input_ids": torch.full((64, 512), 5), "attention_mask": torch.ones(64, 512, dtype=torch.long)}
    frac = (token_noise([big], 1, 0.3, vocab=[7, 9])[1]["input_ids"] != 5).float().mean().item()
    assert 0.28 < frac < 0.32
    assert torch.equal(token_noise([big], 1, 0.0, vocab=10)[1]["input_ids"], big["input_ids"])


def test_bare_tensors_seeded_and_zero_copies():
    ids = torch.arange(10, 30).view(2, 10)
    a = token_noise([ids], 2, 0.5, vocab=100, seed=3)
    b = token_noise([ids], 2, 0.5, vocab=100, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[1], ids) and a[0] is ids
    assert token_noise([ids], 0, 0.5, vocab=100) == [ids]


@pytest.mark.parametrize("kwargs, err", [
    (dict(copies=-1), ValueError), (dict(copies=1.5), ValueError), (dict(copies=True), ValueError),
    (dict(p=1.5), ValueError), (dict(p=-0.1), ValueError), (dict(p="0.3"), ValueError),
    (dict(vocab=(5, 5)), ValueError), (dict(vocab=[]), ValueError), (dict(vocab=[1.5, 2.0]), ValueError),
    (dict(vocab=[-1, 3]), ValueError), (dict(vocab=True), TypeError),
])
def test_bad_arguments_are_refused(kwargs, err):
    args = dict(copies=1, p=0.3, vocab=100) | kwargs
    with pytest.raises(err):
        token_noise([_batch()], **args)


def test_bad_batches_are_refused_before_any_copy():
    good = _batch()
    with pytest.raises(TypeError, match="batch 1: .*integer token ids"):
        token_noise([good, {"input_ids": torch.randn(2, 8)}], 1, 0.3, vocab=100)
    with pytest.raises(TypeError, match="batch 0"):
        token_noise([{"inputs_embeds": torch.randn(2, 8, 4)}], 1, 0.3, vocab=100)
    bad = dict(good, attention_mask=torch.ones(2, 7, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask of shape"):
        token_noise([bad], 1, 0.3, vocab=100)
