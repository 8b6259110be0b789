"""Embedding tables sharded across trainer ranks: the plan types, the input and output
distribution over ``torch.distributed``, and the sharded module that composes them."""
