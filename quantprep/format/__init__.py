"""What is on disk, and its checks: GPTQ's integer packing (gptq.py), the artifact's manifest,
shards and side files (artifact.py), and the marks of artifacts hashed in full here (verified.py).
The format never imports build/, runtime/, tools/ or gptqmodel (tests/test_layers.py)."""
