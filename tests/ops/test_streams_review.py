"""The launch path's shared buffers (split-K workspace and counters, the unpack route's dense
scratch) against CUDA streams, CUDA-graph pools and a second GPU, checked on CPU: torch's rules
are simulated where they are per thread (the graph pool) or stubbed where they are CUDA calls
(streams, devices). Found by review; none of these was visible to the CPU tests before."""
import contextlib
import gc
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import sparse24
from sparse24.decode_format import DecodePacked
from sparse24.ops.linear24 import launch, op

from conftest import load_script


class _Allocations(TorchDispatchMode):
    """Storages created by aten ops of this thread (dispatch modes are per thread, as torch's
    routing of allocations into a CUDA graph's pool during compile's warm-up run is)."""

    def __init__(self):
        super().__init__()
        self.ptrs = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        self.ptrs |= {t.untyped_storage().data_ptr() for t in tree_leaves(out)
                      if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in ins}
        return out


def _kept_after(call) -> int:
    """How many storages ``call()`` allocated in this thread that outlive it and are not its output:
    torch.compile(mode="reduce-overhead") fails its warm-up run on any (check_memory_pool)."""
    mode = _Allocations()
    with mode:
        y = call()
    gc.collect()
    with warnings.catch_warnings():   # (isinstance on a deprecated torch.distributed alias warns)
        warnings.simplefilter("ignore")
        # plain tensors and parameters only: fake tensors other tests' compiles left have no data pointer
        alive = {o.untyped_storage().data_ptr() for o in gc.get_objects()
                 if type(o) in (torch.Tensor, torch.nn.Parameter) and not o.is_meta}
    return len((mode.ptrs & alive) - {y.untyped_storage().data_ptr(), 0})


def test_first_calls_keep_no_allocation_of_the_calling_thread(monkeypatch):
    """The first decode call of a shape makes its plan (split-K workspace and counters), the first
    unpack-route call the dense scratch: both were allocated by the calling thread and kept, which
    inside compile's warm-up lands in the graph's pool and fails the compiled model's first call."""
    launch.release_workspaces()
    layer = sparse24.Sparse24Linear.from_linear(torch.nn.Linear(4096, 1024, bias=False).half(),
                                                mode="compressed").to_layout("decode")
    bench = load_script("bench_host")
    with torch.no_grad():
        with bench.stubbed_launch():
            x = torch.randn(1, 4096).half()
            assert _kept_after(lambda: layer(x)) == 0
            plan = next(p for p in launch._PLANS.values() if p.N == 1024)
            assert plan.split_k > 1 and plan.shares   # (the case that allocates a workspace)
        monkeypatch.setattr(launch, "_launch_unpack", lambda *a, **k: None)
        monkeypatch.setattr(op, "_auto_backend", lambda *a, **k: "unpack")
        x = torch.randn(256, 4096).half()
        assert _kept_after(lambda: layer(x)) == 0
        assert launch._DENSE_SCRATCH[x.device].numel() >= 4096 * 1024 * 2
    launch.release_workspaces()


class _FakeStream:
    def __init__(self, raw, log):
        self.raw, self.log = raw, log

    def wait_stream(self, other):
        self.log.append((self.raw, other.raw))


def test_a_stream_switch_waits_for_the_last_stream(monkeypatch):
    """Launches on the device's shared buffers from another stream than the last one first make
    their stream wait for that one (two models on two streams overwrote each other's unpacked
    weight: a wrong product); the same stream waits for nothing, a capture never waits."""
    log, current, capturing = [], [1], [False]
    streams = {}
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: current[0], raising=False)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda index=None: streams.setdefault(current[0], _FakeStream(current[0], log)))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(launch, "_LAST_STREAM", {})
    dev = torch.device("cuda", 0)
    for stream, expect in ((1, []), (1, []), (2, [(2, 1)]), (2, []), (1, [(1, 2)])):
        current[0] = stream
        log.clear()
        launch.follow_last_stream(dev)
        assert log == expect, (stream, log)
    capturing[0], current[0] = True, 3
    launch.follow_last_stream(dev)
    assert log == [(1, 2)] and launch._LAST_STREAM[0][0] == 1   # (nothing waited, nothing recorded)
    launch.follow_last_stream(torch.device("cpu"))   # off CUDA: nothing


def test_shared_launches_follow_the_stream_under_the_lock(monkeypatch):
    """Every launch on the shared buffers (a split-K plan, the unpack) asks for its stream's turn,
    holding the launch lock (threads on their own streams then queue in one order); plans that
    write only their output do not."""
    seen = []
    monkeypatch.setattr(launch, "follow_last_stream", lambda dev: seen.append((dev, launch.SCRATCH_LOCK.locked())))
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 7, raising=False)
    monkeypatch.setattr(launch, "_LAST_STREAM", {})
    bench = load_script("bench_host")
    with torch.no_grad(), bench.stubbed_launch() as launches:
        for N, K in ((4096, 4096), (72, 200)):
            w = DecodePacked.empty(N, K, torch.float16, False)
            x = torch.empty(1, K, dtype=torch.float16)
            launch.run(x, w.values, w.meta, None, None, N)
            plan = launches[-1][0]
            plan.cuda, plan.device_index = True, 0   # (a CUDA plan's launch path, the kernel stubbed)
            launch._LAST_STREAM.clear()
            seen.clear()
            launch.run(x, w.values, w.meta, None, None, N)
            assert launches[-1][0] is plan
            assert seen == ([(x.device, True)] if plan.split_k > 1 else []), (N, K, plan.split_k)
            if plan.split_k > 1:   # the same stream as the last launch: no call
                launch._LAST_STREAM[0] = (7, None)
                seen.clear()
                launch.run(x, w.values, w.meta, None, None, N)
                assert seen == []
            plan.cuda, plan.device_index = False, None
    monkeypatch.setattr(launch, "_launch_unpack", lambda *a, **k: None)
    w = DecodePacked.empty(64, 64, torch.float16, False)
    seen.clear()
    op.unpack_linear(torch.empty(256, 64, dtype=torch.float16), w.values, w.meta, None, None, 0, None, 64)
    assert seen == [(w.values.device, True)]


def test_live_tuning_runs_on_the_layers_gpu(monkeypatch):
    """tune_key for a tensor on another GPU than the current one: its side stream, graph capture and
    timer used the current device while the launches went to the layer's (an empty graph was
    timed): it now runs with the layer's device current."""
    from sparse24.tools import tuning

    current = [0]

    @contextlib.contextmanager
    def device(d):
        old, current[0] = current[0], torch.device(d).index
        try:
            yield
        finally:
            current[0] = old

    class Reached(Exception):
        pass

    def tuning_inputs(*args, **kwargs):   # (the first step that uses the device)
        raise Reached(current[0])

    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(tuning, "kernel_refusal", lambda *a: None)
    monkeypatch.setattr(tuning, "_tuning_inputs", tuning_inputs)
    for index in (1, 0):
        try:
            tuning.tune_key(1, 64, 64, "float16", torch.device("cuda", index))
        except Reached as e:
            assert e.args == (index,)
        else:
            raise AssertionError("tune_key did not reach its inputs")
    assert current[0] == 0


def test_kept_buffers_are_idle_and_zero_before_any_stream_uses_them(monkeypatch):
    """persistent()'s thread allocates on its own (default) stream, whose pool may hand out a block a
    kernel queued there still writes: it waits for that stream before returning (simulated: a wrong
    unpacked product otherwise), and the counters are zeroed there, not by a zero_() queued on the
    caller's stream (another thread's stream launched first and found them non-zero). No host wait
    while a graph is captured."""
    import threading

    events, capturing = [], [False]

    class Stream:
        def synchronize(self):
            events.append(("wait", threading.get_ident()))

    def allocator(name, real):
        def allocate(n, dtype=None, device=None):
            events.append((name, threading.get_ident()))
            return real(n, dtype=dtype)
        return allocate

    monkeypatch.setattr(torch, "empty", allocator("empty", torch.empty))
    monkeypatch.setattr(torch, "zeros", allocator("zeros", torch.zeros))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    cuda = torch.device("cuda", 0)
    t = launch.persistent(torch.int32, 8, cuda, zero=True)
    (kind, who), (wait, waiter) = events
    assert (kind, wait) == ("zeros", "wait") and who == waiter != threading.get_ident() and not t.any()
    events.clear()
    launch.persistent(torch.uint8, 8, cuda)
    assert [e[0] for e in events] == ["empty", "wait"]
    events.clear()
    capturing[0] = True
    launch.persistent(torch.uint8, 8, cuda)
    assert [e[0] for e in events] == ["empty"]
    monkeypatch.undo()
    asked = []
    monkeypatch.setattr(launch, "persistent", lambda dtype, n, device, zero=False: asked.append((dtype, zero))
                        or torch.empty(n, dtype=dtype))
    monkeypatch.setattr(launch, "_WORKSPACES", {})
    from sparse24.ops.config_space import KernelConfig
    launch.decode_workspace("cpu", 256, KernelConfig(16, 64, 128, split_k=4, kernel="decode"), 4)
    assert asked == [(torch.float32, False), (torch.int32, True)]
