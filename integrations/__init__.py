"""croupier under the trainers people use: Lightning, Accelerate, the HF Trainer, torch.distributed.checkpoint.

Each submodule imports its framework only when imported itself.
"""
