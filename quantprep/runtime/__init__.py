"""The serving side: open and check an artifact, install its packed modules, run its kcache.

load.py is `quantprep.load`; hf_quantizer.py makes it transformers' `from_pretrained`; kcache.py
keys, trusts and activates compiled-kernel caches; aot.py and fused.py are what a kcache holds
and what load installs; warm.py fills the kcache on the serving machine. Imports only
format/, targets/, distribution/ and _io/ (tests/test_layers.py)."""
