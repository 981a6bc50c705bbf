"""The trainer's plumbing, one room a concern, beside the algorithm in train_grpo.py (the README's layout table
says what each room holds). Rooms import downward only: common; flags and engines; checkpoints; distributed;
batching; memory; then the run directory and metrics. No room imports the trainer, data/ or rewards.py."""
