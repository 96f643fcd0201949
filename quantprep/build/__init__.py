"""The offline side: recipe -> source checkpoint -> (quantize) -> prepack -> artifact.

recipes.py names what to build, source.py reads and checks a GPTQ checkpoint, quantize.py runs
gptqmodel (its only importer), prepack.py turns layers into a target's layout, pipeline.py runs
the stages and warms each artifact whose device is present. The runtime never imports this
package (tests/test_layers.py)."""
