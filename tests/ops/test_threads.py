"""Layers shared by several host threads (a serving app): the unpack route's shared dense scratch
and the interpreter's patching of Triton's module state (found by review)."""
import sys
import threading

import torch

import sparse24
from sparse24.ops.linear24 import launch, op


def test_unpack_route_calls_from_two_threads_each_read_their_own_weight(monkeypatch):
    """Two layers' unpack-route calls from two threads: with B's unpack queued between A's unpack and
    A's matmul (one stream runs launches in queue order; on CPU, program order), A multiplied by B's
    weight (max error 29 here). The unpack and the matmul are queued together now. The order is
    forced: A waits after its unpack until B has unpacked, or 2 s (B cannot, while A holds the lock)."""
    torch.manual_seed(0)
    layers = []
    for N in (64, 32):
        p = sparse24.compress(torch.randn(N, 64).half())
        layers.append((sparse24.pack_decode(p), p.to_dense().double()))
    x = torch.randn(8, 64).half()
    a_unpacked, b_unpacked = threading.Event(), threading.Event()
    real = launch.unpack_dense

    def ordered(*a, **k):
        out = real(*a, **k)
        if threading.current_thread().name == "A":
            a_unpacked.set()
            b_unpacked.wait(timeout=2)
        else:
            b_unpacked.set()
        return out
    monkeypatch.setattr(launch, "unpack_dense", ordered)
    out = {}

    def call(i):
        if i == 1:
            a_unpacked.wait(timeout=5)
        d, _ = layers[i]
        out[i] = op.unpack_linear(x, d.values, d.meta, d.scale, d.zero, 0, None, d.shape[0])
    threads = [threading.Thread(target=call, args=(i,), name=name) for i, name in enumerate("AB")]
    [t.start() for t in threads]
    [t.join() for t in threads]
    for i, (_, w) in enumerate(layers):
        ref = x.double() @ w.t()
        assert (out[i].double() - ref).abs().max() < 0.05, i   # (fp16 rounding of a 64-long sum)


def test_interpreted_launches_from_threads_leave_triton_as_it_was():
    """Each interpreted launch patches Triton's module state and restores a snapshot: a thread's
    snapshot taken during another's launch restored those patches for good (1754 attributes of
    triton.language left changed; "Did you forget to add @triton.jit?" mid-call)."""
    from triton.runtime.jit import JITFunction

    import sparse24.kernels.interpreter as ki
    torch.manual_seed(0)
    p = sparse24.compress(torch.randn(32, 64))
    x = torch.randn(4, 64)
    ref = x.double() @ p.to_dense().double().t()
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)   # threads switch often: launches overlap
    try:
        sparse24.linear(x, p, backend="triton")
        before, call_before = ki._snapshot(), JITFunction.__call__
        errors = []

        def work():
            for _ in range(4):
                try:
                    assert (sparse24.linear(x, p, backend="triton").double() - ref).abs().max() < 1e-3
                except Exception as e:   # noqa: BLE001 (collected and asserted below)
                    errors.append(repr(e)[:200])
        threads = [threading.Thread(target=work) for _ in range(3)]
        [t.start() for t in threads]
        [t.join() for t in threads]
    finally:
        sys.setswitchinterval(old_interval)
    assert not errors, errors
    after = ki._snapshot()
    changed = [n for (_, s0), (_, s1) in zip(before, after) for n in set(s0) | set(s1) if s0.get(n) is not s1.get(n)]
    assert JITFunction.__call__ is call_before and not changed, changed[:5]
