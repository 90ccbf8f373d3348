"""The training steps: one shape for both trainers (a Trainer with train_step and
evaluate), and the optimiser pieces they use."""
