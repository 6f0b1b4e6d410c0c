"""The trainer process: the policy, its optimizer, log-prob passes, data-parallel ranks and checkpoints."""
