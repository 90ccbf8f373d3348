"""The training steps and what a loop needs around them: one shape for both trainers (a
Trainer with forward_backward, step and evaluate), the world's arithmetic (batching.py),
the CNN's epochs at any world size (epochs.py), and the optimiser pieces they use."""
