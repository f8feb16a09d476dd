"""LoRA adapters served beside the base model: many at once, chosen per row, with no merge.

    model.reserve_adapters(max_loras=4, max_lora_rank=16)   fixed slots (else the first load reserves them)
    model.load_adapter(path, adapter_name="mine")            a peft adapter directory into a free slot
    model.generate(..., adapter="mine" | ["mine", None])     per call, or per prompt (None: the base)
    model.set_adapter("mine")                                the adapter every call uses by default
    model.delete_adapter("mine")

Each targeted linear layer keeps the factors of every slot stacked in two arrays of fixed shapes
(`_stack`), which live in the Model's params, so every program takes them as arguments: loading or
dropping an adapter writes values and compiles nothing. Inside a program, each row's product is a pair
of dense products over the stacked slots, masked to the row's slot (`_product`). peft's checkpoints are
read by `_peft`: LoRA and rsLoRA scaling, per-layer ranks and alphas; DoRA, LoRA on embeddings, trained
biases and `modules_to_save` are refused by name.

Public names: `Adapter`, `AdapterSlots`, `NONE`, `rows`, `product`, `read_adapter`, `PeftAdapter`, `PEFT_PREFIX`,
`with_active`.
"""

from ._peft import PEFT_PREFIX, PeftAdapter, read_adapter
from ._product import product, rows
from ._stack import NONE, Adapter, AdapterSlots, with_active

__all__ = [
    "NONE",
    "PEFT_PREFIX",
    "Adapter",
    "AdapterSlots",
    "PeftAdapter",
    "product",
    "read_adapter",
    "rows",
    "with_active",
]
