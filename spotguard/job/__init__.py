"""The ranks of one job together: the store they share (`kvstore`), the events every rank reads
(`broadcast`), the step they agree on (`agreement`), where each rank sits (`topology`), and one
rank's emergency coordination over all of these (`coordination`)."""
