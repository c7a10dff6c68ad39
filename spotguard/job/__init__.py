"""The ranks of one job together: the store they share (`kvstore`), the events every rank reads
(`broadcast`), the step they agree on (`agreement`), where each rank sits (`topology`), where the
leaving ranks and the survivors of an emergency meet (`departure`), and one rank's emergency
coordination over all of these (`coordination`). The lowest layer of spotguard: nothing of
checkpoint/ or above."""
