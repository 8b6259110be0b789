"""An embedding module's state dict by table, as TorchRec names it: each table's weights
``embedding_bags.NAME.weight`` ``[rows, dim]`` (the storage dtype) and its optimizer state
arrays ``embedding_bags.NAME.momentum1`` (and ``momentum2`` for Adam) ``[rows, width]``,
then the module's ``optimizer_step``; views of the module's flat buffers, not copies.

Loading checks every key's shape before it copies anything, so a state dict of other
tables (another order, other sizes) is refused whole, naming the tensors that differ,
where the flat buffers alone would load into any module of the same total size. A
TorchRec ``EmbeddingBagCollection``'s tables load by their names (``strict=False``: it has
no optimizer state); values of another floating dtype are converted.
"""

from __future__ import annotations

import torch


def save_tables(views: dict[str, torch.Tensor], destination: dict, prefix: str, keep_vars: bool) -> None:
    """``nn.Module._save_to_state_dict`` of a module whose state is ``views`` (name: tensor)."""
    for name, view in views.items():
        destination[prefix + name] = view if keep_vars else view.detach()


def load_tables(views: dict[str, torch.Tensor], state_dict: dict, prefix: str, strict: bool,
                missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
    """``nn.Module._load_from_state_dict`` of a module whose state is ``views``: each view
    takes its key's tensor, all or none (any shape mismatch appends to ``error_msgs`` and
    nothing is copied)."""
    given, refused = {}, False
    for name, view in views.items():
        key = prefix + name
        if key not in state_dict:
            missing_keys.append(key)
            continue
        value = state_dict[key]
        if not isinstance(value, torch.Tensor) or value.shape != view.shape:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            error_msgs.append(f"size mismatch for {key}: copying a param with shape {shape} from checkpoint, "
                              f"the shape in current model is {tuple(view.shape)}.")
            refused = True
            continue
        given[name] = value
    if strict:
        unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k[len(prefix):] not in views)
    if refused:
        return  # nothing copied
    with torch.no_grad():
        for name, value in given.items():
            views[name].copy_(value)
