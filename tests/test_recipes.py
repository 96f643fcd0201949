"""Recipes (build/recipes.py): the shipped ones parse, name their sources and calibration text
exactly, and a recipe's relative paths are relative to it."""

from pathlib import Path

import pytest
from conftest import REPO

from quantprep.errors import RecipeError


def test_recipes_with_gguf_parts(tmp_path):
    from quantprep.build.recipes import find_recipe, parse_recipe

    for name in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"):
        r = find_recipe(name)
        assert len(r.source["gguf_parts"]) in (22, 6) and len(r.source["gguf_sha256"]) == 64
    bad = tmp_path / "bad.toml"
    bad.write_text('[source]\ngguf_parts = ["a", "b"]\n')  # no sha256 to check the joined file against
    with pytest.raises(RecipeError, match="gguf_sha256"):
        parse_recipe(bad)

def test_qwen_recipes_calibrate_on_the_measured_text_disjoint_from_the_held_out_one():
    """The Qwen recipes' calibration file is the one the calibration experiment measured (its sha256;
    benchmarks/experiments/README.md, "Calibration") and shares no paragraph with the held-out text
    quantprep eval scores: quality is not measured on seen text."""
    import hashlib

    from quantprep.build.recipes import find_recipe

    held = (REPO / "quantprep" / "tools" / "heldout.txt").read_text()
    for name in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "qwen2.5-1.5b"):
        r = find_recipe(name)
        text = Path(r.calibration).read_bytes()
        assert hashlib.sha256(text).hexdigest() == "c600445d115549f413b936b2754cdeae6c36dc887cbee3599ec0583345d692ac"
        assert (r.samples, r.seq_len, r.desc_act, r.group_size) == (64, 256, True, 128)
        paragraphs = [p for p in text.decode().split("\n\n") if len(p) > 80]
        assert len(paragraphs) > 800 and not [p[:80] for p in paragraphs if p in held]

def test_a_recipe_calibration_file_is_relative_to_the_recipe(tmp_path):
    from quantprep.build.recipes import parse_recipe

    (tmp_path / "r.toml").write_text('[source]\npath = "x"\n[quantize]\ncalibration = "texts/c.txt"\nsamples = 64\nseq_len = 256\n')
    r = parse_recipe(tmp_path / "r.toml")
    assert r.calibration == str((tmp_path / "texts" / "c.txt").resolve()) and (r.samples, r.seq_len) == (64, 256)


def test_every_shipped_recipe_parses_and_is_listed():
    """pipelines/ at the top of the repository is what quantprep.pipelines ships: each recipe there is listed and parses."""
    from quantprep.build.recipes import list_recipes, parse_recipe

    shipped = sorted(p.stem for p in (REPO / "pipelines").glob("*.toml"))
    listed = {p.stem: p for p in list_recipes()}
    assert shipped and sorted(listed) == shipped
    for name in shipped:
        assert parse_recipe(listed[name]).targets


@pytest.mark.parametrize("text, needle", [
    ('[source]\npath = "x"\n[quantize]\nbits = 3\n', "bits must be one of"),
    ('[source]\npath = "x"\n[quantize]\ngroup_size = 100\n', "group_size must be -1, 32, 64 or 128"),
    ('[source]\npath = "x"\nhub = "y"\n', "exactly one of"),
    ('[source]\npath = "x"\n[warm]\nshapes = []\n', "warm.shapes"),
    ('[source]\npath = "x"\n[build]\ncolour = 1\n', "unknown key"),
    ('[source\n', "malformed TOML"),
])
def test_a_bad_recipe_is_one_line_naming_the_file_and_value(tmp_path, text, needle):
    from quantprep.build.recipes import parse_recipe

    (tmp_path / "r.toml").write_text(text)
    with pytest.raises(RecipeError, match=needle) as e:
        parse_recipe(tmp_path / "r.toml")
    assert str(tmp_path / "r.toml") in str(e.value) and "\n" not in str(e.value)
