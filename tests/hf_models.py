"""Small transformers models built in the tests (no downloads) and their independent references."""
import copy

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.pytorch_utils import Conv1D

from sparse24 import Sparse24Linear

from conftest import int4_dequantized_reference, top2_mask

VOCAB = 96


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=32, bos_token_id=1,
                     eos_token_id=2)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(cfg).eval()


def tokens(seed: int = 0, shape=(2, 9)) -> torch.Tensor:
    return torch.randint(3, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def masked_reference(dense, sparse):
    """fp64 copy of ``dense`` whose layers that are 2:4 in ``sparse`` hold W * (independent top-2 mask),
    or for INT8 / INT4 layers the dequantized stored values placed by that mask."""
    ref = copy.deepcopy(dense).double()
    with torch.no_grad():
        for fqn, m in sparse.named_modules():
            if not isinstance(m, Sparse24Linear):
                continue
            lin = ref.get_submodule(fqn)
            w = lin.weight.t() if isinstance(lin, Conv1D) else lin.weight  # (out, in) view
            mask = top2_mask(w)
            if m.mode == "compressed" and m.quantize == "int8":
                q = torch.zeros_like(w)
                q[mask] = (m.values.double() * m.scale.double()[:, None]).flatten()
                w.copy_(q)
            elif m.mode == "compressed" and m.quantize == "int4":
                w.copy_(int4_dequantized_reference(m, mask))
            else:
                w.mul_(mask)
    return ref
