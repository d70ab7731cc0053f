"""PEFT LoRA on 2:4 layers: dense adapters on a sparse base (layer 6).

Needs ``peft`` (``pip install "sparse24[hf]"``). :func:`register` (run by
:func:`sparse24.hf.register`, so by ``sparsify_`` of a transformers model and by
:func:`sparse24.from_pretrained`) teaches PEFT's LoRA to wrap a
:class:`~sparse24.Sparse24Linear` in :class:`Sparse24LoraLinear`, for
``target_modules=[...]`` and ``target_modules="all-linear"`` alike. PEFT's own
route for custom layers also works:
``config._register_custom_module({Sparse24Linear: Sparse24LoraLinear})``.

Semantics, in masked and compressed (also INT8 and INT4) mode:

* forward: ``base(x) + scaling * B(A(dropout(x)))``, PEFT's LoRA; the base is
  frozen by PEFT and untouched by training (its masked-mode forward then skips
  the per-call ``where``, see :mod:`sparse24.nn`).
* merge: the adapter's update ``BA * scaling`` is added at the base's kept
  positions only, so the merged layer stays 2:4 in its mode (compressed values
  are updated in place, INT8 ones requantized, INT4 ones see below); the part of the update that
  falls on pruned positions is dropped, so merged outputs equal the base with
  ``mask * BA * scaling`` added, not ``base + BA`` (exactly equal when the
  adapter's update is itself zero where pruned). This is the sparsity-keeping
  merge of SPP / SQFT; a dense merge would lose the 2:4 pattern.
* INT4 base (QLoRA-style: the base is frozen, adapters train in the activation
  dtype): merge keeps the layer INT4 in its format, its scales and zero points
  unchanged, and moves each kept weight to the nearest point of that grid: within
  half a step of the exact merge inside the grid's range, at its end outside
  (a warning counts the codes moved and the weights clipped). An update under
  half a step rounds away, so for an adapter's full effect serve it unmerged, or
  merge into float weights (``decompress_``, merge, ``compress_(quantize="int4")``
  requantizes with new scales).
* unmerge: restores the base tensors exactly as they were before the merge.
* inits: the default, ``"gaussian"``, ``"orthogonal"`` (PEFT's numbers, in the base's logical dtype,
  in every mode) and ``"eva"`` work; the inits that rewrite the base weight (PiSSA & co.) are refused.
* DoRA and the other LoRA variants (``use_dora``, ``alora_invocation_tokens``, ...) read the dense base
  weight: refused, as are those inits, when the config targets any 2:4 layer, before any layer
  (dense ones included) is replaced, so the model is left unchanged.
"""
from __future__ import annotations

import copy
import dataclasses
import warnings

import torch
from peft.tuners import tuners_utils
from peft.tuners.lora import LoraModel
from peft.tuners.lora.layer import Linear as LoraLinear
from peft.tuners.tuners_utils import BaseTunerLayer, check_adapters_to_merge
from peft.utils import PeftType
from peft.utils.constants import INCLUDE_LINEAR_LAYERS_SHORTHAND

from ._checks import check_finite
from ._rollback import TensorBackup
from .nn import Sparse24Linear

__all__ = ["Sparse24LoraLinear", "register"]


def _base_tensors(base: Sparse24Linear) -> list[torch.Tensor]:
    """The tensors a merge changes: the dense weight (masked) or values + INT8 scales (compressed), and the bias."""
    names = ("weight",) if base.mode == "masked" else ("values", "scale")
    found = [getattr(base, n) for n in names] + [base.bias]
    return [t for t in found if t is not None]


# PEFT inits that read the base weight densely and write it back (the residual of an SVD or a
# quantization): on a 2:4 base they rewrote the frozen weight at pruned positions (PiSSA changed the
# layer's output by 30%; OLoRA's in-place write went unseen by the masked layer's zero check).
_BASE_REWRITING_INITS = ("pissa", "corda", "olora", "mica", "loftq", "lora_ga")


def _check_init(config, where: str = "") -> None:
    init = getattr(config, "init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_REWRITING_INITS):
        raise ValueError(f"{where}init_lora_weights={init!r} rewrites the base weight densely, and a 2:4 base "
                         "stays as it is (frozen, exactly 0 where pruned): use the default init, 'gaussian', "
                         "'orthogonal' or 'eva' for adapters on sparse24 layers")


def _requested_variants(config) -> list[str]:
    """The LoRA variants a LoraConfig asks for, found as PEFT's ``resolve_lora_variant`` finds them (fields
    tagged ``is_lora_variant``, and the variant values of ``init_lora_weights``), so new ones are seen too."""
    found = []
    for field in dataclasses.fields(config):
        if field.name == "init_lora_weights":
            found += [v for v in field.metadata.get("lora_variants", ()) if config.init_lora_weights == v]
        elif field.metadata.get("is_lora_variant") and getattr(config, field.name):
            found.append(field.name)
    return found


def _inside_adapters(model) -> set[str]:
    """The names of the modules inside PEFT adapter layers (their base layers, their adapters), which PEFT
    does not target again."""
    return {f"{p}.{s}" for p, m in model.named_modules() if isinstance(m, BaseTunerLayer)
            for s, _ in m.named_modules() if s}


def _check_targets(config, model) -> None:
    """Refuse a LoRA config that 2:4 layers cannot take, before PEFT replaces any layer: PEFT's own
    refusal came from inside its injection loop, after the dense targets met first were wrapped (or, for
    PiSSA & co., rewritten)."""
    if getattr(config, "peft_type", None) != PeftType.LORA or getattr(config, "target_modules", None) is None:
        return
    variants, inside = _requested_variants(config), _inside_adapters(model)
    for name, module in model.named_modules():
        if not name or name in inside:
            continue
        if not (_sparse24_base(module) and tuners_utils.check_target_module_exists(config, name)):
            continue
        where = f"target {name!r} is a 2:4 Sparse24Linear (nothing was changed): "
        _check_init(config, where)
        if variants:
            raise ValueError(f"{where}the LoRA variant(s) {', '.join(variants)} read the base's dense weight, an "
                             "unsupported variant combination on a 2:4 base; keep the 2:4 layers out of "
                             "target_modules (or in exclude_modules) to use them on the dense ones")


class Sparse24LoraLinear(LoraLinear):
    """PEFT LoRA layer whose base is a :class:`~sparse24.Sparse24Linear` (see the module docstring).

    Args:
        base_layer: the 2:4 layer ``(R, C)`` (or a LoRA layer already wrapping one).
        adapter_name, config, **kwargs: as for ``peft.tuners.lora.layer.Linear``.
    Shapes:
        input ``(..., C)`` -> output ``(..., R)``.
    """

    def __init__(self, base_layer, adapter_name: str, config, **kwargs):
        kwargs.pop("is_target_conv_1d_layer", None)
        _check_init(config)
        super().__init__(base_layer, adapter_name, config=config, **kwargs)
        # A 2:4 layer stores (out, in) whatever it replaced (GPT-2's Conv1D included), so the
        # adapter's product is never transposed; the shared config is left alone.
        self.fan_in_fan_out = False
        self._before_merge: list[torch.Tensor] | None = None

    @property
    def lora_variants(self):
        """PEFT's variant table of this layer: none. DoRA and the other variants read the base's dense
        weight: a LoraConfig asking for one on a 2:4 target is refused before PEFT changes anything."""
        return {(): None}  # DoRA & co. read the dense base weight

    def update_layer(self, adapter_name, r, lora_alpha, config, **kwargs):
        """Add the adapter ``adapter_name`` (PEFT's ``LoraLayer.update_layer``; a second adapter comes here).

        Args:
            adapter_name: the adapter's name.
            r, lora_alpha: its rank and scaling numerator (``lora_A`` ``(r, in_features)``,
                ``lora_B`` ``(out_features, r)``).
            config: its ``LoraConfig``; an ``init_lora_weights`` that rewrites the base weight (PiSSA,
                CorDA, OLoRA, MiCA, LoftQ, LoRA-GA) is a ValueError, nothing changed. ``"orthogonal"`` draws PEFT's
                numbers without reading the base weight (absent in compressed mode).
            **kwargs: passed on to PEFT.
        """
        _check_init(config)   # (a second adapter comes through here, not through __init__)
        if config.init_lora_weights != "orthogonal":
            return super().update_layer(adapter_name, r, lora_alpha, config, **kwargs)
        # PEFT's orthogonal init reads base.weight (absent in compressed mode) for its dtype only: build the
        # adapter uninitialised (no random numbers drawn), then draw PEFT's numbers into it.
        if r % 2:   # PEFT's check, made before this layer changes
            raise ValueError(f"Orthogonal initialization requires the LoRA rank to be even, got {r} instead.")
        plain = copy.copy(config)
        plain.init_lora_weights = False
        super().update_layer(adapter_name, r, lora_alpha, plain, **kwargs)
        self._orthogonal_init_(adapter_name)

    @torch.no_grad()
    def _orthogonal_init_(self, adapter_name: str) -> None:
        """peft's ``LoraLayer.orthogonal_init`` (same draws, same dtype: the base's logical one), written into
        the adapter's parameters in place, so their device and ``requires_grad`` stay as PEFT set them."""
        rank, dtype = self.r[adapter_name], self.get_base_layer().dtype
        q, _ = torch.linalg.qr(torch.randn(rank, rank))
        lora_a = torch.randn(self.in_features, rank // 2).mm(q[0::2, :]).T / 10.0
        lora_b = torch.randn(rank // 2, self.out_features).T.mm(q[1::2, :]) / 10.0
        self.lora_A[adapter_name].weight.copy_(lora_a.to(dtype))
        self.lora_B[adapter_name].weight.copy_(lora_b.to(dtype))

    def _get_in_out_features(self, module):
        return module.in_features, module.out_features

    def _get_base_layer_device_and_dtype(self, base_layer):
        return base_layer.device, base_layer.dtype  # the logical dtype also for INT8 values

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Add the adapters' updates at the base's kept positions (the layer stays 2:4).

        Args:
            safe_merge: raise ValueError (and leave the layer as it was) if the merged
                tensors are not finite.
            adapter_names: adapters to merge (default: the active ones).
        Raises:
            ValueError, the layer as it was: an adapter's update (weight, or ``lora_bias``) is not
            finite, or the merged tensor overflows the base's dtype (whatever ``safe_merge`` says:
            :meth:`~sparse24.Sparse24Linear.add_to_kept_` refuses it, the bias is checked alike).
        """
        adapter_names = [a for a in check_adapters_to_merge(self, adapter_names) if a in self.lora_A]
        if not adapter_names:
            return
        base = self.get_base_layer()
        before = self._before_merge if self._before_merge is not None else _merged_entries(base)
        # A decode-layout base (frozen 16-bit/INT8/INT4 weights on CUDA) is re-packed through layout v1 by
        # every update, written back into the tensors it holds (new ones only where those are inference
        # tensors): undo by the module's own tables, then values.
        snapshot, backup = base._snapshot(), TensorBackup()
        backup.keep(_base_tensors(base))
        try:
            with torch.no_grad():
                for name in adapter_names:
                    base.add_to_kept_(self.get_delta_weight(name))
                    if self.lora_bias[name]:
                        if base.bias is None:
                            raise RuntimeError("Impossible to merge LoRA with `lora_bias=True` because the base "
                                               "layer has no bias.")
                        # checked as add_to_kept_ checks the weight's update: in the bias's own dtype
                        merged = (base.bias + self.lora_B[name].bias * self.scaling[name]).to(base.bias.dtype)
                        check_finite(merged, f"the bias merged with the lora_bias of adapter {name!r}",
                                     "a diverged adapter? (nothing was changed)")
                        base.bias.copy_(merged)
            if safe_merge and not all(bool(torch.isfinite(t).all()) for t in _base_tensors(base)
                                      if t.is_floating_point()):
                raise ValueError(f"NaNs detected in the merged weights. The adapter(s) {adapter_names} seem to be "
                                 "broken")
        except BaseException:
            base._restore(snapshot)
            backup.restore()
            raise
        self._before_merge = before
        self.merged_adapters.extend(adapter_names)

    def unmerge(self) -> None:
        """Put the base back exactly as it was before the first merge (in whatever layout, device
        and dtype it is held now: the saved entries are layout v1's, loaded as a checkpoint is)."""
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.")
            return
        base = self.get_base_layer()
        base.load_state_dict({**base.state_dict(), **self._before_merge})
        self._before_merge = None
        self.merged_adapters.clear()


def _merged_entries(base: Sparse24Linear) -> dict[str, torch.Tensor]:
    """Copies of the state-dict entries a merge changes (``weight`` or ``values`` and ``scale``, and
    ``bias``): layout v1, whatever layout the base holds."""
    names = {"weight", "values", "scale", "bias"}
    return {k: v.detach().clone() for k, v in base.state_dict().items() if k in names}


def _sparse24_base(target) -> bool:
    base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
    return isinstance(base, Sparse24Linear)


def register() -> None:
    """Route PEFT LoRA's layer creation for :class:`~sparse24.Sparse24Linear` to
    :class:`Sparse24LoraLinear`, and include 2:4 layers in ``target_modules="all-linear"``.
    Every other layer goes through PEFT's own dispatch. Idempotent."""
    create = LoraModel._create_new_module
    if not getattr(create, "_sparse24", False):
        def _create_new_module(lora_config, adapter_name, target, **kwargs):
            if _sparse24_base(target) and kwargs.get("parameter_name") is None:
                return Sparse24LoraLinear(target, adapter_name, config=lora_config, **kwargs)
            return create(lora_config, adapter_name, target, **kwargs)
        _create_new_module._sparse24 = True
        LoraModel._create_new_module = staticmethod(_create_new_module)
    include = tuners_utils._maybe_include_all_linear_layers
    if not getattr(include, "_sparse24", False):
        def _maybe_include_all_linear_layers(peft_config, model):
            wanted = isinstance(getattr(peft_config, "target_modules", None), str) and \
                peft_config.target_modules.lower() == INCLUDE_LINEAR_LAYERS_SHORTHAND
            peft_config = include(peft_config, model)
            if wanted:
                get = getattr(model, "get_output_embeddings", None)
                head = get() if callable(get) else None
                inside = _inside_adapters(model)
                peft_config.target_modules = set(peft_config.target_modules) | {
                    n for n, m in model.named_modules()
                    if isinstance(m, Sparse24Linear) and m is not head and n not in inside}
            # PEFT calls this in inject_adapter after its checks and before it replaces the first layer
            _check_targets(peft_config, model)
            return peft_config
        _maybe_include_all_linear_layers._sparse24 = True
        tuners_utils._maybe_include_all_linear_layers = _maybe_include_all_linear_layers
