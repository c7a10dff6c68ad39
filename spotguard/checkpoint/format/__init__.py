"""What a committed step is made of on disk: names, the manifest, its signature, the job's identity and
run, and the restricted unpickler every DCP `.metadata` goes through. Both paths read these."""
