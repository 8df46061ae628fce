"""`python -m rlhf_batch` (and `torchrun -m rlhf_batch`) runs the CLI."""

from rlhf_batch.cli import main

main()
