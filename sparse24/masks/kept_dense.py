"""Which layers stay dense whoever prunes a whole model (``sparsify_``, ``prune_layerwise_``, the
recipes): layers whose weight is shared with another module (tied), the output head, MoE routers and
the parts of PEFT adapter layers. Here, below the mask methods, so that every pruning entry point
applies the same rules."""
from __future__ import annotations

import re
import sys

import torch
from torch import nn
from torch.nn.parameter import is_lazy
from torch.nn.utils import parametrize

from .._linears import is_conv1d, linear_shape

__all__ = ["_shared_weights", "_kept_dense", "_tied_or_head", "_is_linear", "_output_heads", "_input_embedding",
           "_SWAPPABLE", "_swappable", "_unswappable"]

# The Linear types sparsify_ swaps (nn.MultiheadAttention's out_proj is a NonDynamicallyQuantizableLinear)
_SWAPPABLE = (nn.Linear, nn.modules.linear.NonDynamicallyQuantizableLinear)


def _shared_weights(model: nn.Module) -> dict[int, list[str]]:
    """id(parameter or buffer) -> the qualified names of every parameter or buffer sharing memory
    with it: the same Parameter registered twice or more, Parameters sharing elements of one storage
    (a tie that ``load_state_dict(assign=True)`` made into two Parameter objects on one storage), or
    a buffer over a Parameter's memory (a frozen ``weight.detach()`` used as a lookup table, named
    ``buffer <name>``: pruning the weight would write it too); only those. Element-disjoint views of
    one buffer (a flat buffer, q/k/v as strided views of a fused weight) are not shared."""
    names: dict[int, list[str]] = {}
    spans = []  # (device, first byte, end byte, tensor) of each parameter and buffer holding memory
    for fqn, mod in model.named_modules():
        tensors = [(n, p, "") for n, p in mod._parameters.items()] + \
                  [(n, b, "buffer ") for n, b in mod._buffers.items()]
        for pname, p, kind in tensors:
            if p is None:
                continue
            if id(p) not in names:
                names[id(p)] = []
                span = _byte_span(p)
                if span is not None:
                    spans.append((*span, p))
            names[id(p)].append(kind + (f"{fqn}.{pname}" if fqn else pname))
    group = {k: k for k in names}  # id -> a parent id in its group (union-find)

    def root(k: int) -> int:
        while group[k] != k:
            group[k] = k = group[group[k]]
        return k

    spans.sort(key=lambda s: (str(s[0]), s[1], s[2]))
    active = []  # earlier spans on this device that may still reach the current one
    for device, lo, hi, p in spans:
        active = [a for a in active if a[0] == device and a[2] > lo]
        for a in active:
            if _elements_overlap(a[3], p):
                group[root(id(p))] = root(id(a[3]))
        active.append((device, lo, hi, p))
    members: dict[int, list[str]] = {}
    for k in names:
        members.setdefault(root(k), []).extend(names[k])
    return {k: members[root(k)] for k in names if len(members[root(k)]) > 1}


def _byte_span(p: torch.Tensor) -> tuple | None:
    """(device, first byte, end byte) of the memory ``p`` spans; None where it holds none (meta,
    lazy, empty) or none of its own to compare (a tensor subclass such as a DTensor)."""
    if is_lazy(p) or p.is_meta or type(p.data) is not torch.Tensor or p.numel() == 0:
        return None
    try:
        lo = p.data_ptr()
    except RuntimeError:
        return None
    elements = 1 + sum((n - 1) * st for n, st in zip(p.shape, p.stride()))
    return (p.device, lo, lo + elements * p.element_size()) if lo else None


def _elements_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b``, whose byte spans overlap, share an element. Contiguous tensors fill
    their spans, so a span overlap is a shared element; strided views (q/k/v as interleaved views of
    one fused weight) may only interleave: their elements are marked and compared in a bool buffer
    over the storage. Different dtypes or storages over the same bytes count as shared (conservative:
    their elements do not line up, and a false tie only leaves a layer dense)."""
    if a.is_contiguous() and b.is_contiguous():
        return True
    same_storage = a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    if a.dtype != b.dtype or not same_storage:
        return True
    lo = min(a.storage_offset(), b.storage_offset())
    size = max(t.storage_offset() + 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
               for t in (a, b)) - lo
    marks = torch.zeros(size, dtype=torch.bool, device="cpu")  # on the host: no device memory or sync needed
    marks.as_strided(a.shape, a.stride(), a.storage_offset() - lo).fill_(True)
    return bool(marks.as_strided(b.shape, b.stride(), b.storage_offset() - lo).any())


def _is_linear(mod: nn.Module) -> bool:
    return isinstance(mod, nn.Linear) or is_conv1d(mod)


def _swappable(mod: nn.Module) -> bool:
    """Whether sparsify_ swaps a layer of ``mod``'s type: ``nn.Linear`` itself or transformers'
    ``Conv1D`` itself (a subclass may change its forward, or be parametrized)."""
    return type(mod) in _SWAPPABLE or (is_conv1d(mod) and type(mod).__name__ == "Conv1D")


def _unswappable(mod: nn.Module) -> str:
    """Why ``mod`` (an nn.Linear or Conv1D) stays dense for its type (:func:`_swappable`), else "": a
    parametrized layer (torch.nn.utils.parametrize makes its class a subclass), or a subclass. One text
    for sparsify_ and prune_layerwise_, whose default choice is sparsify_'s."""
    if _swappable(mod):
        return ""
    if parametrize.is_parametrized(mod):
        names = " and ".join(mod.parametrizations.keys())
        return (f"{names} {'is' if len(mod.parametrizations) == 1 else 'are'} parametrized (e.g. SR-STE, "
                "weight_norm); remove the parametrization first")
    return f"{type(mod).__name__} subclasses nn.Linear and may change its forward; not swapped"


def _input_embedding(model: nn.Module) -> tuple[str, nn.Embedding] | None:
    """The token embedding: the model's ``get_input_embeddings()`` (transformers), else its
    largest ``nn.Embedding`` (position and type embeddings are smaller than a vocabulary)."""
    get = getattr(model, "get_input_embeddings", None)
    emb = None
    if callable(get):
        try:
            emb = get()
        except (NotImplementedError, AttributeError):
            emb = None
    tables = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, nn.Embedding)]
    if isinstance(emb, nn.Embedding):
        return next(((fqn, m) for fqn, m in tables if m is emb), None)
    return max(tables, key=lambda t: t[1].num_embeddings, default=None)


def _kept_dense(model: nn.Module, skip_output_head) -> dict[int, str]:
    """id(layer) -> why it is kept dense: the output head, an MoE router, or a part of a PEFT adapter layer."""
    return {**_output_heads(model, skip_output_head), **_moe_routers(model), **_inside_peft_layers(model)}


# Where transformers' configs give the number of experts of an MoE layer.
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
# How transformers names a router: the layer or its parent module, as a whole name (router.proj,
# router.classifier, gate.wg, a Gemma-style `gate`), or a parent class ending so (`...Router`, `...TopKGate`).
# Whole names only: `gate_proj` (Qwen3-Next's shared expert: 512 outputs beside 512 experts) is an MLP layer.
_ROUTER_PART = re.compile(r"(router|routing|gate|gating)", re.IGNORECASE)
_ROUTER_CLASS = re.compile(r"(Router|Gate|Gating)$")


def _moe_routers(model: nn.Module) -> dict[int, str]:
    """id(layer) -> why: an ``nn.Linear`` (or Conv1D) with as many outputs as the model's config has experts
    (``num_experts``, ``num_local_experts``, ``n_routed_experts``, ``moe_num_experts``, in the config or its
    ``text_config``) and named as a router (it or its parent named ``router`` / ``gate``, or a parent
    class ending in ``Router`` / ``Gate``; never a ``*_proj`` layer):
    an MoE router stored as a Linear (Gemma 4, SwitchTransformers, NLLB-MoE, HunYuan-MoE, DBRX, JetMoE,
    ...). It is a tiny matrix, and pruning it changes which experts each token is sent to; routers that
    are custom modules (Mixtral, Qwen-MoE) are no Linears and stay dense anyway. The name keeps a layer
    that is as wide by chance (a k_proj of 32 outputs beside 32 experts) in the plan. Models without
    such a config (any plain ``nn.Module``) have none: to prune a router all the same, ``sparsify_`` its
    parent module."""
    config = getattr(model, "config", None)
    configs = [config, getattr(config, "text_config", None)]
    counts = {n for c in configs if c is not None for a in _EXPERT_COUNTS
              if isinstance(n := getattr(c, a, None), int) and not isinstance(n, bool) and n > 1}
    if not counts:
        return {}
    out = {}
    for fqn, mod in model.named_modules():
        if fqn and _is_linear(mod) and linear_shape(mod)[0] in counts:
            parent_fqn, _, leaf = fqn.rpartition(".")
            parent = model.get_submodule(parent_fqn)
            if not leaf.endswith("_proj") and (_ROUTER_PART.fullmatch(leaf)
                                               or _ROUTER_PART.fullmatch(parent_fqn.rpartition(".")[2])
                                               or _ROUTER_CLASS.search(type(parent).__name__)):
                out[id(mod)] = (f"MoE router ({linear_shape(mod)[0]} outputs = the config's number of experts): "
                                "pruning it changes which experts each token takes; sparsify_ its parent module "
                                "to prune it")
    return out


def _inside_peft_layers(model: nn.Module) -> dict[int, str]:
    """id(module) -> why: it sits inside a PEFT tuner layer (its base layer, its adapters), whose
    merge writes the base weight densely (peft is imported by the caller, never here)."""
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    if tuners is None:
        return {}
    return {id(sub): f"inside the PEFT adapter layer {fqn!r}: PEFT's merge would write the base weight densely; "
                     "sparsify_ the base model before get_peft_model"
            for fqn, m in model.named_modules() if isinstance(m, tuners.BaseTunerLayer)
            for sub in m.modules() if sub is not m}


def _output_heads(model: nn.Module, skip_output_head) -> dict[int, str]:
    """id(layer) -> why it is kept dense as the output head."""
    if skip_output_head is False or skip_output_head is None:
        return {}
    if not isinstance(skip_output_head, (bool, str, list, tuple, set, frozenset)):
        raise TypeError(f"skip_output_head must be True, False, a layer name or a list of names, got "
                        f"{skip_output_head!r}")
    if skip_output_head is not True:
        names = [skip_output_head] if isinstance(skip_output_head, str) else list(skip_output_head)
        modules = dict(model.named_modules())
        out = {}
        for name in names:
            if not isinstance(name, str) or not _is_linear(modules.get(name)):
                raise ValueError(f"skip_output_head names {name!r}, which is no nn.Linear (or Conv1D) of the model")
            out[id(modules[name])] = "named by skip_output_head"
        return out
    keep = "kept dense, as LLM pruning does (SparseGPT, Wanda); skip_output_head=False prunes it"
    get = getattr(model, "get_output_embeddings", None)
    if callable(get):  # a transformers model names its head (None: it has none)
        head = get()
        return {id(head): f"output head (the model's get_output_embeddings()): {keep}"} if _is_linear(head) else {}
    found = _input_embedding(model)
    if found is None:
        return {}
    name, emb = found
    # One head: where the vocabulary is the model width (a byte-level LM), every D -> D layer is as
    # wide as it. The one tied to the embedding, else the last (a head comes after the blocks).
    wide = [mod for mod in model.modules() if _is_linear(mod) and linear_shape(mod)[0] == emb.num_embeddings]
    if not wide:
        return {}
    head = ([mod for mod in wide if mod.weight is emb.weight] or wide)[-1]
    return {id(head): f"output head ({emb.num_embeddings} outputs = the vocabulary of the input embedding {name!r}): "
                      f"{keep}"}


def _tied_or_head(fqn: str, mod: nn.Module, shared: dict, heads: dict) -> str:
    """Why ``mod`` stays dense whoever prunes (sparsify_, the recipes): its weight is shared with another
    module (:func:`_shared_weights`), or it is the output head (:func:`_output_heads`); else ""."""
    if id(mod.weight) in shared:
        others = [n for n in shared[id(mod.weight)] if n != f"{fqn}.weight"]
        return f"weight is shared with {', '.join(others)} (tied): pruning it would also prune those"
    return heads.get(id(mod), "")
