"""How a guarded process ends: the exit codes and the exit file (`exit_policy`), and which nodes
torchrun's elastic agent must not restart (`elastic`)."""
