"""Model definitions: plain PyTorch, no Horovod (the scripts add the distribution)."""
