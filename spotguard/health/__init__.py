"""Failures that come without a notice: a node that stops answering (`liveness`: a ring of
heartbeats between the nodes, off the training thread) and a training loop that stops stepping
(`hangs`: `guard.step()` is the heartbeat); `stacks` says where each rank stands when one is seen,
and `monitor` ties them to a guard and ends the job so that it restarts from what the nodes hold."""
