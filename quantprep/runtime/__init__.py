"""The serving side: open and check an artifact, install its packed modules, run its kcache.

load.py is `quantprep.load`: checked.py opens and checks an artifact once, torch_model.py builds the
transformers model of a torch target's modules and openvino.py runs a graph artifact;
hf_quantizer.py makes the torch path transformers' `from_pretrained`; kcache.py
keys, trusts and activates compiled-kernel caches; aot.py and fused.py are what a kcache holds
and what load installs; warm.py fills the kcache on the serving machine. Imports only
format/, targets/, distribution/ and _io/ (tests/test_layers.py)."""
