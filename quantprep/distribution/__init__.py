"""Moving artifacts between machines: publish and pull (publish.py) over a directory, an OCI
registry (registry.py) or the Hugging Face Hub (hub.py), signatures (signing.py) and the user's
signature policy (policy.py). Everything fetched is untrusted until its digests check."""
