"""How ranks are laid out: data parallel, pipeline stages, tensor-parallel shards (layout.py picks), and activation checkpointing."""
